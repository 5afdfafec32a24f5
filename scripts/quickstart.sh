#!/usr/bin/env bash
# Install gemmtune and run the main job on a model preset: write its shapes to tune, then run the
# tuned op on every shape, checking it against an fp32 reference and timing it. Without a GPU it
# runs on the CPU and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
MODEL=${MODEL:-llama3-8b}
gemmtune shapes --model "$MODEL" -o out/shapes/
gemmtune tables
gemmtune check --model "$MODEL"
