#!/usr/bin/env bash
# Install gemmtune with its test extras and run the whole test suite. Without a GPU the Triton
# kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1) and the
# tests marked `gpu` are skipped; on a GPU machine everything runs on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh "[test]"
exec python -m pytest -q -ra "$@"  # exec: a time limit's signal then reaches pytest itself
