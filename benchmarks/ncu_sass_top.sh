# ncu's per-instruction stall samples of one kernel launch (SASS), the top lines
set -uo pipefail
pip install -q --no-index --no-deps --target /tmp/site .whl/nvmath*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:src
# bash benchmarks/ncu_sass_top.sh KERNEL M,N,K [FAMILY [KERNEL_REGEX [TAG]]]
K=$1; SHAPE=$2; FAMILY=${3:-a8w8-blockscale}; REGEX=${4:-wsring}; TAG=${5:-}
timeout 200 ncu --clock-control none --force-overwrite --kernel-name regex:$REGEX --launch-skip 1 --launch-count 1 \
  --section WarpStateStats --section SourceCounters --export $OUT/src$TAG \
  python3 benchmarks/ncu_probe.py --family $FAMILY --shape $SHAPE --kernels $K --launches 2 > $OUT/ncu$TAG.log 2>&1
tail -3 $OUT/ncu$TAG.log
ncu --import $OUT/src$TAG.ncu-rep --page source --csv --print-source sass > $OUT/sass$TAG.csv 2>>$OUT/ncu$TAG.log
TAG=$TAG python3 - <<'PY'
import csv, os
rows = list(csv.reader(open(os.environ["OUT"] + "/sass" + os.environ.get("TAG", "") + ".csv")))
hdr_i = next(i for i, r in enumerate(rows) if "Source" in r)
hdr = rows[hdr_i]; print(hdr)
body = [r for r in rows[hdr_i+1:] if len(r) == len(hdr)]
col = next(i for i, h in enumerate(hdr) if h.startswith("Warp Stall Sampling (All"))
src = hdr.index("Source")
def num(x):
    try: return float(x.replace(",", ""))
    except: return 0.0
total = sum(num(r[col]) for r in body)
top = sorted(body, key=lambda r: -num(r[col]))[:45]
for r in top:
    print(f"{num(r[col])/total*100:5.1f}% | {r[0]} | {r[src][:110]}")
PY
