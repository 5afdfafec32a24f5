#!/usr/bin/env bash
# One call on the GPU machine: the checks and timings of a session, each stage under its own
# time limit so one stuck stage cannot eat the others. Full results go under $OUT; the short
# tables print last.
#
#   bash benchmarks/gpu_session.sh tests sweep cost      # stages to run, in this order
#
# Stages: tests (scripts/test.sh: the whole suite, gpu-marked tests included), gputests (only the
# gpu-marked kernel, op and dispatch tests), a8w8 (tune 16 FP8 shapes, bench them), sweep
# (benchmarks/splitk_sweep.py, kernels precompiled in parallel first), cost
# (benchmarks/tune_cost.py, then `gemmtune tune bf16` on one (N, K) x 8 M with a cold Triton
# cache: the tuning-cost figure), presets[:FAMILY] (scripts/tune_presets.sh into the shipped
# table of FAMILY, bf16 or a8w8, cut off after PRESETS_LIMIT seconds; run again to resume; MS
# the token counts, TUNE_EXTRA more tuner flags, e.g. --kernels), bench:MODEL[:TP] (gemmtune bench bf16 on
# the shipped table), persistent (the persistent TMA kernel's gpu tests and
# benchmarks/persistent_check.py), smallk (tiny and ragged K through the a8w8 tuners), fp8acc
# (benchmarks/fp8_accumulation.py: promoted FP8 accumulation, error and time),
# pytest:FILE[:KEYWORDS] (one test file, or its tests matching `-k KEYWORDS`; not node ids).
# The other stages are described where they are defined below.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # carried wheels (nvmath-python for cuBLASLt)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/nvmath*.whl .whl/pytest_timeout*.whl .whl/filelock*.whl
    export PYTHONPATH=/tmp/site:src
else
    export PYTHONPATH=src
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
summary="$OUT/summary.txt"
: > "$summary"

model_and_tp() {  # model_and_tp MODEL[:TP]: sets model and tp (1 when not given)
    model=${1%%:*}
    tp=1; [[ $1 == *:* ]] && tp=${1#*:}
}

stage() {  # stage NAME SECONDS CMD...: run CMD under a limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$summary"
    tail -n "${TAIL:-25}" "$OUT/$name.log" >> "$summary"
}

for what in "$@"; do
    case $what in
        tests)
            stage tests 560 bash scripts/test.sh -p no:cacheprovider --timeout 300 ;;
        gputests)  # the gpu-marked tests of the kernels, ops and tuner: the quick check
            stage gputests 240 python3 -m pytest -q -x -p no:cacheprovider --timeout 200 -m gpu \
                tests/test_kernel_gemm_splitk.py tests/test_kernel_gemm_tile.py \
                tests/test_ops_a8w8.py tests/test_ops_a8w8_blockscale.py tests/test_gpu_ops.py \
                tests/test_cublaslt.py tests/test_kernel_gemm_persistent.py ;;
        ops)  # every test of the ops, dispatch, cuBLASLt and layout, on the GPU (not only gpu-marked)
            stage ops 420 python3 -m pytest -q -p no:cacheprovider --timeout 200 \
                tests/test_cublaslt.py tests/test_gpu_ops.py tests/test_ops_dispatch.py \
                tests/test_ops_a8w8.py tests/test_ops_a8w8_blockscale.py tests/test_layout.py \
                tests/test_triton_json.py ;;
        pytest:*)  # pytest:FILE[:KEYWORDS]: one test file, or its tests matching -k KEYWORDS
            # (PYTEST_LIMIT seconds, 300 unless set)
            spec=${what#pytest:}
            file=${spec%%:*}
            keywords=""; [[ $spec == *:* ]] && keywords=${spec#*:}
            stage "pytest_$(basename "$file" .py)" "${PYTEST_LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider \
                --timeout 200 "$file" ${keywords:+-k "$keywords"} ;;
        smallk)  # tiny and ragged K through the tuners: which candidates fail there, and why
            printf 'M,N,K,q_dtype_w\n5,48,64,torch.float8_e4m3fn\n20,32,96,torch.int8\n' \
                > "$OUT/smallk_a8w8.csv"
            printf 'M,N,K\n5,200,300\n' > "$OUT/smallk_blockscale.csv"
            stage smallk_a8w8 200 python3 -m gemmtune.cli tune a8w8 -i "$OUT/smallk_a8w8.csv" \
                -o "$OUT/smallk_a8w8_tuned.csv" -o2 "$OUT/smallk_a8w8_profile.csv" --mp 14
            stage smallk_blockscale 200 python3 -m gemmtune.cli tune a8w8-blockscale \
                -i "$OUT/smallk_blockscale.csv" -o "$OUT/smallk_blockscale_tuned.csv" \
                -o2 "$OUT/smallk_blockscale_profile.csv" --mp 14
            grep -hv ',ok,' "$OUT"/smallk_*_profile.csv | cut -c1-400 | head -40 >> "$summary" ;;
        persistent)  # the persistent TMA kernel: its gpu tests, then correctness and time vs tile
            stage persistent_tests 240 python3 -m pytest -q -p no:cacheprovider --timeout 200 \
                -m gpu tests/test_kernel_gemm_persistent.py
            stage persistent 240 python3 benchmarks/persistent_check.py ;;
        preshuffle)  # issue 15 item 2: what a pre-shuffled FP8 weight layout buys, same kernel
            TAIL=20 stage preshuffle "${PRESHUFFLE_LIMIT:-300}" python3 \
                benchmarks/preshuffle_probe.py --out "$OUT" ;;
        gluonfrag)  # issue 15 item 2: w's fragments loaded straight into wgmma's registers
            # (Gluon) against the split-K kernel's shared-memory path
            TAIL=14 stage gluonfrag "${GLUONFRAG_LIMIT:-300}" python3 \
                benchmarks/gluon_frag_probe.py --out "$OUT" ;;
        streamk)  # issue 15 item 1: the swapped dot fed by TMA, grid split and stream-K, against
            # the shipped a8w8 rows (cuBLASLt at most M = 16-64 shapes) and _scaled_mm
            TAIL=24 stage streamk "${STREAMK_LIMIT:-420}" python3 benchmarks/streamk_probe.py \
                --m "${STREAMK_M:-16,32,64}" --out "$OUT" ;;
        gluonring)  # issue 15 item 1: a deep TMA ring on every SM against cuBLASLt at M = 16-64
            TAIL=50 stage gluonring "${GLUONRING_LIMIT:-500}" python3 benchmarks/gluon_ring_probe.py \
                --m "${GLUONRING_M:-16,32,64}" --out "$OUT" ;;
        fragsplit)  # issue 15 item 2: triton.frag with and without PDL beside the Gluon probe
            TAIL=14 stage fragsplit "${FRAGSPLIT_LIMIT:-300}" python3 \
                benchmarks/frag_split_probe.py --out "$OUT" ;;
        bpreshuffle)  # issue 15 item 2: gemm_a8w8_bpreshuffle beside gemm_a8w8, presets' (N, K)
            TAIL=12 stage bpreshuffle "${BPRESHUFFLE_LIMIT:-300}" python3 \
                benchmarks/bpreshuffle_vs_a8w8.py --m "${BPRESHUFFLE_M:-1,16,32,64}" --out "$OUT" ;;
        fp8acc)  # the Triton FP8 rows' error and time with and without promoted accumulation
            TAIL=12 stage fp8acc "${FP8ACC_LIMIT:-540}" python3 benchmarks/fp8_accumulation.py --out "$OUT" ;;
        a8w8)  # tune FP8 a8w8 on decode and prefill shapes, then bench them through that table
            printf 'M,N,K,q_dtype_w\n' > "$OUT/a8w8_untuned.csv"
            for nk in 576,7168 4096,4096 28672,4096 1280,8192; do
                for m in 1 16 64 1024; do
                    echo "$m,$nk,torch.float8_e4m3fn" >> "$OUT/a8w8_untuned.csv"
                done
            done
            stage a8w8_tune 300 python3 -m gemmtune.cli tune a8w8 -i "$OUT/a8w8_untuned.csv" \
                -o "$OUT/a8w8_tuned.csv" -o2 "$OUT/a8w8_profile.csv" --mp "${MP:-8}" --timeout 60
            GEMMTUNE_CONFIG_A8W8="replace:$OUT/a8w8_tuned.csv" TAIL=30 stage a8w8_bench 200 \
                python3 -m gemmtune.cli bench a8w8 --dtype fp8 --shapes "$OUT/a8w8_untuned.csv" \
                -o "$OUT/bench_a8w8" ;;
        sweep)
            stage precompile 200 python3 benchmarks/splitk_sweep.py --precompile-only --jobs 14
            TAIL=50 stage sweep 330 python3 benchmarks/splitk_sweep.py --deadline 200 ;;
        cost)
            stage cost 240 python3 benchmarks/tune_cost.py --nk 4096,4096 \
                --M 1,16,32,64,128,256,512,1024
            printf 'M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle\n' > "$OUT/cost_untuned.csv"
            for m in 1 16 32 64 128 256 512 1024; do
                echo "$m,6144,4096,False,bf16,bf16,False,False" >> "$OUT/cost_untuned.csv"
            done
            TRITON_CACHE_DIR=$(mktemp -d) stage tune_cold 420 python3 -m gemmtune.cli tune bf16 \
                -i "$OUT/cost_untuned.csv" -o "$OUT/cost_tuned.csv" -o2 "$OUT/cost_profile.csv" \
                --mp "${MP:-8}" --timeout 60 ;;
        presets|presets:*)  # presets[:FAMILY[:MP]]; resumable: carry the partial table back in
            spec=bf16; [[ $what == presets:* ]] && spec=${what#presets:}
            family=${spec%%:*}
            mp=${MP:-8}; [[ $spec == *:* ]] && mp=${spec##*:}
            GEMMTUNE="python3 -m gemmtune.cli" FAMILY=$family \
                PROFILE="$OUT/presets_profile.csv" SHAPES_DIR="$OUT/presets" \
                EXTRA="--mp $mp --timeout 60 ${TUNE_EXTRA:-}" \
                stage "presets_$family" "${PRESETS_LIMIT:-540}" bash scripts/tune_presets.sh
            cp "src/gemmtune/configs/${family//-/_}_tuned_gemm.csv" "$OUT/" ;;
        retie:*)  # retie:FAMILY: the shipped table's torch rows tuned again with torch and
            # cuBLASLt only (the tie order keeps cuBLASLt's own pick on a tie), cut off after
            # RETIE_LIMIT seconds; resumable (carry the partial table back)
            family=${what#retie:}
            stage "retie_$family" "${RETIE_LIMIT:-300}" python3 scripts/retune_rows.py "$family" \
                --kernel torch. --libtype torch,cublaslt --work "$OUT/retie_$family" -- --mp 8
            cp "src/gemmtune/configs/${family//-/_}_tuned_gemm.csv" "$OUT/" ;;
        challenge:*)  # challenge:FAMILY[:MS[:PREFIXES]]: the shipped rows of those M (default
            # 1,16) against new kernels (PREFIXES, else CHALLENGE, default triton.gemv), in
            # place; the table and a per-shape summary (old kernel / best challenger / torch,
            # one run) come back
            spec=${what#challenge:}
            family=${spec%%:*}
            ms=1,16; [[ $spec == *:* ]] && ms=${spec#*:}
            challengers=${CHALLENGE:-triton.gemv}
            [[ $ms == *:* ]] && { challengers=${ms#*:}; ms=${ms%%:*}; }
            stem=${family//-/_}
            table="src/gemmtune/configs/${stem}_tuned_gemm.csv"
            cp "$table" "$OUT/${stem}_before.csv"
            stage "challenge_$family" "${CHALLENGE_LIMIT:-420}" python3 scripts/retune_rows.py \
                "$family" --m "$ms" --challenge "$challengers" \
                --work "$OUT/challenge_$family" -- --mp "${MP:-14}" --timeout 60
            cp "$table" "$OUT/"
            python3 benchmarks/challenge_summary.py "$OUT/${stem}_before.csv" \
                "$OUT/challenge_$family/${stem}_retune_profile.csv" "$table" \
                --prefix "$challengers" > "$OUT/challenge_$family.txt"
            grep '^M=' "$OUT/challenge_$family.txt" >> "$summary"
            python3 benchmarks/added_splits.py \
                "$OUT/challenge_$family/${stem}_retune_profile.csv" > "$OUT/added_$family.txt"
            grep '^M=' "$OUT/added_$family.txt" >> "$summary" ;;
        probe:*)  # probe:FAMILY:SHAPES[:OLD]: the shapes of SHAPES (a csv) tuned into a scratch
            # table with the challengers (CHALLENGE) and the kernels OLD (else PROBE_OLD) names
            # (a file of one comma list: the shipped rows' own), then the summary against the
            # shipped rows' kernels, all timed in this run: this GPU's own rows challenged (seeded
            # below), and where it has none, the other GPU's rows' kernels by OLD; resumable
            spec=${what#probe:}
            family=${spec%%:*}; shapes=${spec#*:}
            old=${PROBE_OLD:-}
            [[ $shapes == *:* ]] && old=${shapes#*:} && shapes=${shapes%%:*}
            stem=${family//-/_}; name=$(basename "$shapes" .csv)
            dir="$OUT/probe_$name"; mkdir -p "$dir"
            [[ -n ${PROBE_FROM:-} ]] && cp -n "$PROBE_FROM"/* "$dir/"
            kernels=${CHALLENGE:-triton.gemv}
            [[ -n $old ]] && kernels="$kernels,$(tr -d '\n' < "$old")"
            # This GPU's own rows of the shapes, challenged (each row's kernel timed even where
            # the candidates no longer offer its config)
            python3 benchmarks/seed_probe_rows.py "$family" "$shapes" "$dir/tuned.csv" \
                >> "$summary" 2>&1
            stage "probe_$name" "${PROBE_LIMIT:-420}" python3 -m gemmtune.cli tune "$family" \
                -i "$shapes" -o "$dir/tuned.csv" -o2 "$dir/profile.csv" --kernels "$kernels" \
                --mp "${MP:-14}" --timeout 60
            python3 benchmarks/challenge_summary.py "src/gemmtune/configs/${stem}_tuned_gemm.csv" \
                "$dir/profile.csv" "$dir/tuned.csv" --prefix "${CHALLENGE:-triton.gemv}" \
                > "$OUT/probe_$name.txt"
            grep '^M=' "$OUT/probe_$name.txt" >> "$summary" ;;
        newshapes:*)  # newshapes:FAMILY: (N, K) that no preset has (NEW_NK, default three), at
            # NEW_M (default 1,16,32,64): tuned with every candidate, then benched through that
            # table alone (issue 15 asks the kernels to hold off the presets too)
            family=${what#newshapes:}
            stem=${family//-/_}
            dir="$OUT/new_$stem"; mkdir -p "$dir"
            case $family in
                bf16) header=M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle
                      tail=,False,torch.bfloat16,torch.bfloat16,False,False; dtype=bf16 ;;
                a8w8) header=M,N,K,q_dtype_w; tail=,torch.float8_e4m3fn; dtype=fp8 ;;
                *) header=M,N,K; tail=""; dtype=fp8 ;;
            esac
            echo "$header" > "$dir/untuned.csv"
            for nk in ${NEW_NK:-2048,8192 16384,4096 3584,12288}; do
                for m in ${NEW_M:-1 16 32 64}; do echo "$m,$nk$tail" >> "$dir/untuned.csv"; done
            done
            stage "newshapes_tune_$stem" "${NEW_LIMIT:-330}" python3 -m gemmtune.cli tune "$family" \
                -i "$dir/untuned.csv" -o "$dir/tuned.csv" -o2 "$dir/profile.csv" --sort \
                --mp "${MP:-14}" --timeout 60
            export "GEMMTUNE_CONFIG_${stem^^}=replace:$dir/tuned.csv"
            TAIL=20 stage "newshapes_bench_$stem" 200 python3 -m gemmtune.cli bench "$family" \
                --dtype "$dtype" --shapes "$dir/untuned.csv" -o "$dir/bench"
            unset "GEMMTUNE_CONFIG_${stem^^}" ;;
        gemvm:*)  # gemvm:FAMILY:MS: the presets' shapes at those M, GEMV configs against torch
            # alone (a scratch table; where the GEMV stops paying as M grows)
            spec=${what#gemvm:}
            family=${spec%%:*}; ms=${spec#*:}
            stem=${family//-/_}
            dir="$OUT/gemvm_$family"
            rm -f "$dir/${stem}_untuned_gemm.csv"
            for preset in llama3-8b:1 llama3-70b:8 qwen3-32b:1 deepseek-v3:8; do
                python3 -m gemmtune.cli shapes --model "${preset%%:*}" --tp "${preset#*:}" \
                    --nsets "$ms" --families "$family" -o "$dir" > /dev/null
            done
            stage "gemvm_$family" "${CHALLENGE_LIMIT:-420}" python3 -m gemmtune.cli tune "$family" \
                -i "$dir/${stem}_untuned_gemm.csv" -o "$dir/tuned.csv" -o2 "$dir/profile.csv" \
                --kernels "${CHALLENGE:-triton.gemv}" --sort --mp "${MP:-14}" --timeout 60
            python3 benchmarks/challenge_summary.py "$dir/${stem}_untuned_gemm.csv" \
                "$dir/profile.csv" "$dir/tuned.csv" --prefix "${CHALLENGE:-triton.gemv}" \
                > "$OUT/gemvm_$family.txt"
            grep '^M=' "$OUT/gemvm_$family.txt" >> "$summary" ;;
        compare:*)  # compare:FAMILY:MODEL[:TP]: bench before (.before/src) and after, alternately
            spec=${what#compare:}
            family=${spec%%:*}; rest=${spec#*:}
            model=${rest%%:*}
            tp=1; [[ $rest == *:* ]] && tp=${rest##*:}
            ms=${COMPARE_M:-1,16,64,256,1024,4096}
            for side in before after; do
                src=src; [[ $side == before ]] && src=.before/src
                PYTHONPATH=/tmp/site:$src TAIL=6 stage "cmp_${family}_${model}_$side" 400 \
                    python3 -m gemmtune.cli bench "$family" --model "$model" --tp "$tp" \
                    --M "$ms" -o "$OUT/cmp_${family}_${model}_$side"
            done
            python3 benchmarks/compare_benches.py --label "$model tp$tp" \
                "$OUT/cmp_${family}_${model}_before/bench_${family//-/_}.csv" \
                "$OUT/cmp_${family}_${model}_after/bench_${family//-/_}.csv" \
                | tee -a "$OUT/compare.txt" >> "$summary" ;;
        bench:*)
            model_and_tp "${what#bench:}"
            TAIL=40 stage "bench_$model" 400 python3 -m gemmtune.cli bench bf16 --model "$model" \
                --tp "$tp" -o "$OUT/bench_${model}_tp$tp" ;;
        benchf:*)  # benchf:FAMILY:MODEL[:TP]: gemmtune bench FAMILY through its shipped table, at
            # BENCH_M (default the bench's own M)
            rest=${what#benchf:}; family=${rest%%:*}; model_and_tp "${rest#*:}"
            m_arg=(); [[ -n ${BENCH_M:-} ]] && m_arg=(--M "$BENCH_M")
            TAIL=40 stage "benchf_${family}_$model" 400 python3 -m gemmtune.cli bench "$family" \
                --model "$model" --tp "$tp" "${m_arg[@]}" -o "$OUT/benchf_${family}_${model}_tp$tp" ;;
        rows:*)  # rows:FAMILY:MODEL[:TP]: this GPU's rows for one preset into FAMILY's shipped
            # table, at MS (default 1,2,4,8,16), MXFP4 weights in LAYOUTS (both, default;
            # packed; plain); resumable (rows already there skipped): carry the table back
            rest=${what#rows:}; family=${rest%%:*}; model_and_tp "${rest#*:}"
            stem=${family//-/_}; dir="$OUT/rows_${stem}_${model}_tp$tp"; mkdir -p "$dir"
            python3 -m gemmtune.cli shapes --model "$model" --tp "$tp" --nsets "${MS:-1,2,4,8,16}" \
                --families "$family" -o "$dir" > /dev/null
            case ${LAYOUTS:-both} in
                packed) grep -v ',False$' "$dir/${stem}_untuned_gemm.csv" > "$dir/untuned.csv" ;;
                plain) grep -v ',True$' "$dir/${stem}_untuned_gemm.csv" > "$dir/untuned.csv" ;;
                *) cp "$dir/${stem}_untuned_gemm.csv" "$dir/untuned.csv" ;;
            esac
            stage "rows_${stem}_$model" "${ROWS_LIMIT:-420}" python3 -m gemmtune.cli tune \
                "$family" -i "$dir/untuned.csv" -o "src/gemmtune/configs/${stem}_tuned_gemm.csv" \
                -o2 "$dir/profile.csv" --sort --mp "${MP:-14}" --timeout 60
            cp "src/gemmtune/configs/${stem}_tuned_gemm.csv" "$OUT/" ;;
        benchbs:*)  # the same for a8w8-blockscale through its shipped table
            model_and_tp "${what#benchbs:}"
            TAIL=40 stage "benchbs_$model" 400 python3 -m gemmtune.cli bench a8w8-blockscale \
                --model "$model" --tp "$tp" -o "$OUT/benchbs_${model}_tp$tp" ;;
        bench8:*)  # the same for a8w8 (FP8 per-token x per-channel) through its shipped table
            model_and_tp "${what#bench8:}"
            TAIL=40 stage "bench8_$model" 400 python3 -m gemmtune.cli bench a8w8 --dtype fp8 \
                --model "$model" --tp "$tp" -o "$OUT/bench8_${model}_tp$tp" ;;
        ltprobe)  # cuBLASLt FP8 with per-tensor and per-row scales: supported here? right?
            stage ltprobe 120 python3 benchmarks/cublaslt_fp8_probe.py ;;
        smallm)  # one split-K config over M = 1..16 and one-change variants
            stage smallm 120 python3 benchmarks/small_m.py ;;
        triton:*)  # triton:DTYPE[:FAMILY]: tune-triton split-K JSONs for the presets' (N, K),
            # space benchmarks/spaces/splitk_DTYPE[_FAMILY].json; resumable
            spec=${what#triton:}
            dtype=${spec%%:*}
            family=""; [[ $spec == *:* ]] && family=${spec#*:}
            space="benchmarks/spaces/splitk_${dtype}${family:+_${family//-/_}}.json"
            mkdir -p "$OUT/triton"
            cp src/gemmtune/configs/triton/*.json "$OUT/triton/" 2>/dev/null
            # TRITON_FROM: the output folder of a run cut off earlier (carried), to resume (files already there, from an earlier stage of this call, are kept)
            [[ -n ${TRITON_FROM:-} ]] && cp -n "$TRITON_FROM"/* "$OUT/triton/"
            nks=$(python3 -c "import csv; print(' '.join(f'--nk {n},{k}' for n, k in sorted({(int(r['N']), int(r['K'])) for r in csv.DictReader(open('src/gemmtune/configs/bf16_tuned_gemm.csv'))})))")
            TAIL=40 stage "triton_$dtype${family:+_$family}" "${TRITON_LIMIT:-420}" \
                python3 -m gemmtune.cli tune-triton splitk --dtype "$dtype" \
                ${family:+--family "$family"} $nks --m 16,32,64,128,256 --space "$space" \
                --jobs 14 --resume -o "$OUT/triton" ;;
        jsondefault:*)  # jsondefault:FAMILY[:DTYPE]: (N, K) no preset has, at M of each JSON
            # bucket, through the op (no CSV row: the default JSON file in $OUT/triton, else the
            # shipped one, names the kernel) against torch
            spec=${what#jsondefault:}
            family=${spec%%:*}
            dtype=""; [[ $spec == *:* ]] && dtype=${spec#*:}
            printf 'M,N,K\n' > "$OUT/jsondefault_shapes.csv"
            for nk in 2048,8192 16384,4096 3584,12288; do
                for m in 8 24 48 100 200; do echo "$m,$nk" >> "$OUT/jsondefault_shapes.csv"; done
            done
            GEMMTUNE_TRITON_CONFIG_DIR="$OUT/triton" TAIL=40 stage "jsondefault_$family" 240 \
                python3 -m gemmtune.cli bench "$family" ${dtype:+--dtype "$dtype"} \
                --shapes "$OUT/jsondefault_shapes.csv" -o "$OUT/bench_jsondefault_$family" ;;
        json8)  # FP8 shapes with no table row: dispatch takes the shipped Triton JSON or torch
            printf 'M,N,K,q_dtype_w\n' > "$OUT/json8_shapes.csv"
            for nk in 576,7168 7168,2048 4096,4096 6144,4096 4096,14336 28672,4096; do
                for m in 8 24 48 100 200; do
                    echo "$m,$nk,torch.float8_e4m3fn" >> "$OUT/json8_shapes.csv"
                done
            done
            TAIL=40 stage json8 200 python3 -m gemmtune.cli bench a8w8 --dtype fp8 \
                --shapes "$OUT/json8_shapes.csv" -o "$OUT/bench_json8" ;;
        fmoetune:*)  # fmoetune:MODEL[:TP]: tune fmoe over 14 token counts (FMOE_NSETS: others;
            # FMOE_Q: FP8 experts, e.g. per_Token, into fmoe_MODEL_per_Token; FMOE_EP: one rank of
            # that many expert-parallel ranks)
            model_and_tp "${what#fmoetune:}"
            dir="$OUT/fmoe_$model${FMOE_Q:+_$FMOE_Q}${FMOE_EP:+_ep$FMOE_EP}"
            python3 -m gemmtune.cli shapes --model "$model" --tp "$tp" --families fmoe \
                -o "$dir" ${FMOE_Q:+--q_type "$FMOE_Q"} ${FMOE_EP:+--ep "$FMOE_EP"} \
                --nsets "${FMOE_NSETS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192}" \
                > /dev/null
            TAIL=30 stage "fmoetune_$model${FMOE_Q:+_$FMOE_Q}${FMOE_EP:+_ep$FMOE_EP}" \
                "${FMOE_LIMIT:-330}" python3 -m gemmtune.cli tune fmoe \
                -i "$dir/untuned_fmoe.csv" -o "$dir/tuned_fmoe.csv" \
                -o2 "$dir/profile.csv" --mp "${FMOE_MP:-8}" --batch 1 ${FMOE_EP:+--ep "$FMOE_EP"}
            python3 benchmarks/fmoe_tune_summary.py "$dir/tuned_fmoe.csv" \
                "$dir/profile.csv" | tee -a "$summary" ;;
        readprobe:*)  # readprobe:MODEL[:TP]: one launch reading the routed experts' weights, no GEMM
            model_and_tp "${what#readprobe:}"
            TAIL=40 stage "readprobe_$model" 200 python3 benchmarks/moe_read_probe.py \
                --model "$model" --tp "$tp" --tokens "${PROBE_TOKENS:-1,4}" --out "$OUT" ;;
        gmmprobe:*)  # gmmprobe:MODEL[:TP]: torch._grouped_mm's two GEMMs beside our op, T >= 1024
            model_and_tp "${what#gmmprobe:}"
            TAIL=8 stage "gmmprobe_$model" 200 python3 benchmarks/grouped_mm_probe.py \
                --model "$model" --tp "$tp" --out "$OUT" ;;
        routeprobe)  # the routing preparation launch by launch, 4-16 warps, three models' experts
            TAIL=20 stage routeprobe 200 python3 benchmarks/moe_routing_probe.py --out "$OUT" ;;
        persistprobe:*)  # persistprobe:MODEL[:TP]: the persistent stages part by part, T 1024-8192
            model_and_tp "${what#persistprobe:}"
            TAIL=40 stage "persistprobe_$model" 300 python3 benchmarks/moe_persistent_probe.py \
                --model "$model" --tp "$tp" --out "$OUT" ;;
        timeline:*)  # timeline:MODEL[:TP]: the 1-stage kernel's programs on the GPU timer, T 1-4
            model_and_tp "${what#timeline:}"
            TAIL=30 stage "timeline_$model" 200 python3 benchmarks/moe_one_stage_timeline.py \
                --model "$model" --tp "$tp" --tokens 1,2,4 --out "$OUT" ;;
        moebreak:*)  # routing / stage 1 / stage 2 / whole against the floors, tuned configs
            model=${what#moebreak:}
            tuned="$OUT/fmoe_$model/tuned_fmoe.csv"
            tuned_arg=(); [[ -f $tuned ]] && tuned_arg=(--tuned "$tuned")
            TAIL=8 stage "moebreak_$model" 200 python3 benchmarks/moe_breakdown.py \
                --model "$model" --out "$OUT" "${tuned_arg[@]}" ;;
        vllm:*)  # vllm:MODEL[:TUNED]: ours against vLLM's Triton fused-MoE kernel (.vllm/fused_moe,
            # carried), through the shipped table or this call's fmoetune:TUNED table
            spec=${what#vllm:}
            model=${spec%%:*}
            tuned="$OUT/fmoe_${spec#*:}/tuned_fmoe.csv"
            tuned_arg=(); [[ -f $tuned ]] && tuned_arg=(--tuned "$tuned")
            TAIL=14 stage "vllm_$model" 300 python3 benchmarks/vllm_moe_compare.py \
                --vllm-dir .vllm/fused_moe --model "$model" --out "$OUT" "${tuned_arg[@]}" ;;
        benchmoe:*)  # benchmoe:MODEL[:TP]: gemmtune bench fmoe, shipped table (+ this call's rows;
            # BENCH_M: token counts other than the 14; FMOE_Q: FP8 experts, beside bf16; FMOE_EP)
            model_and_tp "${what#benchmoe:}"
            name="$model${FMOE_Q:+_$FMOE_Q}${FMOE_EP:+_ep$FMOE_EP}"
            tuned="$OUT/fmoe_$name/tuned_fmoe.csv"  # this call's fmoetune rows over the shipped
            [[ -f $tuned ]] && export GEMMTUNE_CONFIG_FMOE="$tuned"
            TAIL=24 stage "benchmoe_$name" 400 python3 -m gemmtune.cli bench fmoe \
                --model "$model" --tp "$tp" -o "$OUT/bench_fmoe_$name" ${BENCH_M:+--M "$BENCH_M"} \
                ${FMOE_Q:+--q_type "$FMOE_Q"} ${FMOE_EP:+--ep "$FMOE_EP"}
            unset GEMMTUNE_CONFIG_FMOE ;;
        quantprobe)  # the row quantiser of decode's activations, by warps and passes
            TAIL=8 stage quantprobe 200 python3 benchmarks/quant_rows_probe.py --out "$OUT" ;;
        fp8parts:*)  # fp8parts:MODEL[:TABLE_MODEL]: each launch of the tuned FP8 solution at
            # PARTS_T tokens (FMOE_Q, default per_Token; MODEL as moe_fp8_parts.py names it),
            # from this call's fmoetune:TABLE_MODEL table if given, else the shipped one
            spec=${what#fp8parts:}
            model=${spec%%:*}
            q=${FMOE_Q:-per_Token}
            table=""; [[ $spec == *:* ]] && table="$OUT/fmoe_${spec#*:}_$q/tuned_fmoe.csv"
            for t in ${PARTS_T:-1}; do
                TAIL=3 stage "fp8parts_${model}_$t" 200 python3 benchmarks/moe_fp8_parts.py \
                    --model "$model" --tokens "$t" --q_type "$q" ${table:+--table "$table"} \
                    --out "$OUT"
            done ;;
        readfloor)  # issue 15: how near the attainable floor a pure read of each decode weight gets
            TAIL=50 stage readfloor 400 python3 benchmarks/read_floor_probe.py ;;
        readfloor8)  # the same for FP8-sized weights: the ceiling of the FP8 families' targets
            TAIL=30 stage readfloor8 "${READFLOOR_LIMIT:-300}" python3 benchmarks/read_floor_probe.py \
                --weight-bytes 1 ;;
        moehost)  # host µs per eager MoE call: plain, recorded chain, transformers' backends
            TAIL=20 stage moehost 300 python3 benchmarks/moe_host_cost.py ;;
        overhead)  # host µs per eager call of every op's backends (benchmarks/dispatch_overhead.py)
            TAIL=40 stage overhead 400 python3 benchmarks/dispatch_overhead.py ;;
        w4probe|w4probe:*)  # issue 16: the MXFP4 kernel's configs (bf16 and MXFP4 x) against
            # F.linear and the FP8 op, one run; w4probe:NAME with the arguments of
            # benchmarks/w4_probe_args/NAME.args, else W4PROBE_ARGS (e.g. --shapes ... --configs
            # ...); every config's time: w4probe[_NAME]_all.csv
            name=w4probe; args=(${W4PROBE_ARGS:-})
            [[ $what == w4probe:* ]] && name=w4probe_${what#w4probe:} \
                && args=("@benchmarks/w4_probe_args/${what#w4probe:}.args")
            TAIL=14 stage "$name" "${W4PROBE_LIMIT:-400}" python3 benchmarks/w4_probe.py \
                --all-times "$OUT/${name}_all.csv" "${args[@]}" ;;
        eagerring)  # host µs per eager call of triton.ring rows against the rows they beat
            TAIL=8 stage eagerring 200 python3 benchmarks/eager_ring_probe.py ;;
        named:*)  # named:NAME: benchmarks/named_probe.py with benchmarks/named_probe_args/NAME.args
            # (named kernels of an FP8 family against each other, configs no tuner offers too)
            name=${what#named:}
            TAIL=${NAMED_TAIL:-40} stage "named_$name" "${NAMED_LIMIT:-300}" python3 \
                benchmarks/named_probe.py "@benchmarks/named_probe_args/$name.args" \
                --csv "$OUT/named_$name.csv" ;;
        pdltwins:*)  # pdltwins:FAMILY[:KERNEL,...]: each shipped row's kernel (triton.ring unless
            # named) at M <= PDL_MAX_M (64) of GPUs PDL_GPU names, against its twin launched the
            # other way (with PDL or without): benchmarks/pdl_twins.py
            spec=${what#pdltwins:}
            family=${spec%%:*}; kernels=triton.ring
            [[ $spec == *:* ]] && kernels=${spec#*:}
            limit=${PDL_LIMIT:-300}
            TAIL=4 stage "pdltwins_$family" "$limit" python3 benchmarks/pdl_twins.py \
                --family "$family" --kernels ${kernels//,/ } --max-m "${PDL_MAX_M:-64}" \
                --gpu "${PDL_GPU:-}" --deadline $((limit - 30)) --csv "$OUT/pdltwins_$family.csv" ;;
        ncu:*)  # ncu:FAMILY:M,N,K:KERNEL[,KERNEL...]: Nsight Compute on each kernel's launches
            # (cold caches, clocks left alone) of benchmarks/ncu_probe.py (cuBLAS's kernels too:
            # nvjet, xmma, cutlass; NCU_KERNELS sets the regex); the report and its raw
            # metrics ($OUT/ncu_*.ncu-rep, .csv), a summary (time, DRAM and issue use,
            # occupancy, the largest stalls) after
            spec=${what#ncu:}
            family=${spec%%:*}; rest=${spec#*:}
            shape=${rest%%:*}; kernels=${rest#*:}
            tag="ncu_${family}_${shape//,/x}"
            stage "$tag" "${NCU_LIMIT:-300}" ncu --clock-control none --force-overwrite \
                --kernel-name "regex:${NCU_KERNELS:-gemm|ring|frag|w4|splitk|tile|nvjet|xmma|cutlass}" \
                --section SpeedOfLight --section WarpStateStats --section Occupancy \
                --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis \
                --section ComputeWorkloadAnalysis \
                --export "$OUT/$tag" \
                python3 benchmarks/ncu_probe.py --family "$family" --shape "$shape" \
                --kernels "$kernels" --launches 2
            ncu --import "$OUT/$tag.ncu-rep" --csv --page raw > "$OUT/$tag.csv" 2>> "$OUT/$tag.log"
            python3 benchmarks/ncu_summary.py "$OUT/$tag.csv" | tee "$OUT/$tag.txt" >> "$summary" ;;
        probe)  # the host cost of a Triton row's eager call, layer by layer
            TAIL=30 stage probe 200 python3 benchmarks/host_cost_probe.py ;;
        firstcall)  # a Triton row's first call in a fresh process, with and without precompile
            TAIL=12 stage firstcall 400 python3 benchmarks/first_call.py ;;
        l2prefetch)  # issue 16: each e2e weight prefetched into L2 while a stand-in for the
            # step's other kernels runs, against cold and hot (benchmarks/l2_prefetch_probe.py)
            TAIL=14 stage l2prefetch "${L2_LIMIT:-300}" python3 benchmarks/l2_prefetch_probe.py ;;
        e2emxfp4)  # issue 16: the Llama decode step, bf16 against MXFP4 (and its siblings fused)
            TAIL=12 stage e2emxfp4 "${E2E_LIMIT:-400}" python3 benchmarks/e2e_hf_mxfp4.py ;;
        e2ediag)  # e2e with variants on torch's kernels that take the patched layer's path apart
            TAIL=16 stage e2ediag 500 python3 benchmarks/e2e_hf_diag.py --variants ;;
        e2elayers)  # per linear shape of the e2e models: host cost to issue, patched and not
            TAIL=80 stage e2elayers 400 python3 benchmarks/e2e_hf_diag.py --layers ;;
        e2etrace)  # torch.profiler of eager decode steps of the e2e models, patched and not
            TAIL=10 stage e2etrace 300 python3 benchmarks/e2e_hf_diag.py --trace --models llama3-70b-tp8 ;;
        e2eprofile)  # a cProfile of eager steps of the e2e models, patched and not
            TAIL=240 stage e2eprofile 300 python3 benchmarks/e2e_hf_diag.py --profile ;;
        e2ewithout:*)  # e2ewithout:PREFIX: e2e with torch rows where the tables name PREFIX...
            TAIL=16 stage "e2ewithout_${what#e2ewithout:}" 300 python3 benchmarks/e2e_hf_diag.py \
                --without "${what#e2ewithout:}" ;;
        e2eone:*)  # e2eone:KERNEL: e2e patched with one kernel for every shape
            TAIL=16 stage "e2eone_${what#e2eone:}" 300 python3 benchmarks/e2e_hf_diag.py \
                --one-kernel "${what#e2eone:}" ;;
        e2emoe*)  # e2emoe[:MODELS]: transformers MoE models, experts through gemmtune vs
            # transformers' grouped_mm and batched_mm (E2E_FP8=1: gemmtune's FP8 experts too;
            # E2E_EXPERTS=1: each backend's experts alone and the graph step's ceiling)
            models=${what#e2emoe}; models=${models#:}
            TAIL=$((12 ${E2E_FP8:+ + 12} ${E2E_EXPERTS:+ + 10})) stage "e2emoe${models:+_$models}" 400 \
                python3 benchmarks/e2e_hf_moe.py ${models:+--models $models} \
                ${E2E_FP8:+--fp8} ${E2E_EXPERTS:+--experts} ;;
        e2e*)  # e2e[:MODELS]: transformers Llama models patched vs not (tunes missing shapes first)
            models=${what#e2e}; models=${models#:}
            TAIL=16 stage e2e 580 python3 benchmarks/e2e_hf.py ${models:+--models $models} ;;
        *) echo "unknown stage $what" | tee -a "$summary" ;;
    esac
done
# Only a few files come back from the GPU machine: pack everything into one archive.
rm -f "$OUT"/*.lock "$OUT"/*/*.lock
tar czf /tmp/gpu_session.tgz -C "$OUT" . && mv /tmp/gpu_session.tgz "$OUT/all.tgz"
find "$OUT" -mindepth 1 -not -name all.tgz -not -name summary.txt -delete
echo
cat "$summary"
