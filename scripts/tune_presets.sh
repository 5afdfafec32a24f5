#!/usr/bin/env bash
# Tune the bf16 shapes of the presets the shipped table covers (issue: tuning engine) on this
# GPU, resumably: rows already in the output are skipped, so a run cut off by a time limit is
# continued by running this again with the same OUTPUT (carry the partial table along).
#   OUTPUT  tuned table to write (default src/gemmtune/configs/bf16_tuned_gemm.csv)
#   MS      token counts (default the 11 of the issue)
#   EXTRA   extra flags for gemmtune tune (e.g. "--libtype torch,cublaslt --mp 2")
#   GEMMTUNE  how to run the CLI (default: the gemmtune on PATH)
set -euo pipefail
cd "$(dirname "$0")/.."
GEMMTUNE=${GEMMTUNE:-gemmtune}
OUTPUT=${OUTPUT:-src/gemmtune/configs/bf16_tuned_gemm.csv}
MS=${MS:-1,16,32,64,128,256,512,1024,2048,4096,8192}
SHAPES=${SHAPES_DIR:-out/presets}
rm -f "$SHAPES/bf16_untuned_gemm.csv"
$GEMMTUNE shapes --model llama3-8b --tp 1 --nsets "$MS" --families bf16 -o "$SHAPES"
$GEMMTUNE shapes --model llama3-70b --tp 8 --nsets "$MS" --families bf16 -o "$SHAPES"
$GEMMTUNE shapes --model qwen3-32b --tp 1 --nsets "$MS" --families bf16 -o "$SHAPES"
$GEMMTUNE shapes --model deepseek-v3 --tp 8 --nsets "$MS" --families bf16 -o "$SHAPES"
# --sort groups the M values of one weight together, so Triton compiles are reused across M.
# exec: a time limit's SIGTERM then reaches the tuner, which keeps its finished rows.
# shellcheck disable=SC2086
exec $GEMMTUNE tune bf16 -i "$SHAPES/bf16_untuned_gemm.csv" -o "$OUTPUT" -o2 "${PROFILE:-out/profile.csv}" \
    --sort --batch 4 ${EXTRA:-}
