#!/usr/bin/env bash
# Tune the bf16 shapes of the presets the shipped table covers (issue: tuning engine) on this
# GPU, resumably: rows already in the output are skipped, so a run cut off by a time limit is
# continued by running this again with the same OUTPUT (carry the partial table along).
#   OUTPUT  tuned table to write (default src/gemmtune/configs/bf16_tuned_gemm.csv)
#   MS      token counts (default the 11 of the issue)
#   EXTRA   extra flags for gemmtune tune (e.g. "--libtype torch,cublaslt --mp 2")
#   GEMMTUNE  how to run the CLI (default: the gemmtune on PATH)
#   FAMILY  bf16 (default), a8w8 (the same GEMMs with FP8 per-token x per-channel scales) or
#           a8w8-blockscale (FP8 with 1x128 / 128x128 block scales); OUTPUT then defaults to
#           that family's table in src/gemmtune/configs/
set -euo pipefail
cd "$(dirname "$0")/.."
GEMMTUNE=${GEMMTUNE:-gemmtune}
FAMILY=${FAMILY:-bf16}
STEM=${FAMILY//-/_}  # file names spell the family with underscores
OUTPUT=${OUTPUT:-src/gemmtune/configs/${STEM}_tuned_gemm.csv}
MS=${MS:-1,16,32,64,128,256,512,1024,2048,4096,8192}
SHAPES=${SHAPES_DIR:-out/presets}
rm -f "$SHAPES/${STEM}_untuned_gemm.csv"
$GEMMTUNE shapes --model llama3-8b --tp 1 --nsets "$MS" --families "$FAMILY" -o "$SHAPES"
$GEMMTUNE shapes --model llama3-70b --tp 8 --nsets "$MS" --families "$FAMILY" -o "$SHAPES"
$GEMMTUNE shapes --model qwen3-32b --tp 1 --nsets "$MS" --families "$FAMILY" -o "$SHAPES"
$GEMMTUNE shapes --model deepseek-v3 --tp 8 --nsets "$MS" --families "$FAMILY" -o "$SHAPES"
# --sort groups the M values of one weight together, so Triton compiles are reused across M.
# exec: a time limit's SIGTERM then reaches the tuner, which keeps its finished rows.
# shellcheck disable=SC2086
exec $GEMMTUNE tune "$FAMILY" -i "$SHAPES/${STEM}_untuned_gemm.csv" -o "$OUTPUT" -o2 "${PROFILE:-out/profile.csv}" \
    --sort --batch 4 ${EXTRA:-}
