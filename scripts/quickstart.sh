#!/usr/bin/env bash
# Install gemmtune and run the main job on a model preset: write its shapes to tune, show the
# tables in force, then run the tuned op on every shape against torch and the roofline, checking
# each result against an fp32 reference. Without a GPU it runs on the CPU and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
MODEL=${MODEL:-llama3-8b}
gemmtune shapes --model "$MODEL" -o out/shapes/
gemmtune tables
gemmtune bench bf16 --model "$MODEL" -o out/bench
echo "gemmtune is installed in $VENV: run '. $VENV/bin/activate' to use the commands of README's Workflow"
