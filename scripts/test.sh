#!/usr/bin/env bash
# Install gemmtune with its test extras and run the whole test suite. Without a GPU the Triton
# kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1) and the
# tests marked `gpu` are skipped; on a GPU machine everything runs on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh "[test]"
# The layering of DESIGN.md (Layout) as import contracts (pyproject.toml). A GPU machine's venv
# reuses the system packages and may lack import-linter: there it is said, not skipped silently.
if python -c "import importlinter" 2>/dev/null; then
    lint-imports --no-cache
else
    echo "note: import-linter is not installed here; the import contracts were not checked" >&2
fi
exec python -m pytest -q -ra "$@"  # exec: a time limit's signal then reaches pytest itself
