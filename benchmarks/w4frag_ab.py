"""``triton.w4frag`` against an earlier revision of itself, in one run (H100): for each shape,
the best of the same configs with the working tree's kernel and with the kernel of ``--rev``
(its ``gemm_w4frag.py`` loaded as a second module), beside bf16 ``F.linear``; CUDA graphs,
cold L2, interleaved. Configs: the kernel's candidates with PDL (packed w, or row-major with
``--row-major``).

    PYTHONPATH=src python3 benchmarks/w4frag_ab.py --rev HEAD [--shapes M,N,K ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from gemmtune import quant
from gemmtune.kernels.triton import gemm_w4frag
from gemmtune.kernels.triton._splits import PDL_WAIT
from gemmtune.measure.timing import cold_copies, interleaved_graph_us

SHAPES = ((1, 4096, 4096), (16, 4096, 4096), (1, 6144, 4096), (1, 28672, 4096),
          (16, 28672, 4096), (1, 4096, 14336), (16, 4096, 14336), (32, 4096, 4096),
          (1, 1280, 8192), (1, 8192, 1024), (1, 7168, 8192), (8, 8192, 3584))


def _shape(text: str) -> tuple[int, int, int]:
    m, n, k = (int(v) for v in text.split(","))
    return m, n, k


def module_at(rev: str):
    """``gemm_w4frag`` as it was at ``rev``, imported under another name (from a temporary
    file that stays: Triton reads a kernel's source from its file when it compiles)."""
    source = subprocess.run(["git", "show", f"{rev}:src/gemmtune/kernels/triton/gemm_w4frag.py"],
                            capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parent.parent).stdout
    path = tempfile.NamedTemporaryFile("w", suffix="_w4frag_old.py", delete=False)
    path.write(source)
    path.close()
    spec = importlib.util.spec_from_file_location("gemm_w4frag_at_rev", path.name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def time_shape(m, n, k, old, packed, out):
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    wq, ws = quant.mxfp4(w)
    stored = quant.prepack_mxfp4(wq, ws)[0] if packed else wq
    # Each op's own operands beyond L2 (F.linear's bf16 weight; the kernels' codes and scales)
    sets = cold_copies((x, w.to(torch.bfloat16), stored, ws), per_op=((0, 1), (0, 2, 3)))
    configs = [c for c in gemm_w4frag.candidates(m, n, k, torch.bfloat16, pdl=PDL_WAIT,
                                                  packed=packed) if c.pdl == PDL_WAIT]
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    fns = [lambda s: F.linear(s[0], s[1])]
    for module in (gemm_w4frag, old):
        for c in configs:
            cfg = module.W4FragConfig.from_name(c.name)
            module.launch_gemm_w4frag(x, stored, None, y, None, ws, cfg)
            fns.append(lambda s, cfg=cfg, module=module: module.launch_gemm_w4frag(
                s[0], s[2], None, y, None, s[3], cfg))
    # the two kernels agree (same config, same order of sums)
    a = gemm_w4frag.gemm_w4frag(x, stored, ws, None, configs[0])
    b = old.gemm_w4frag(x, stored, ws, None, old.W4FragConfig.from_name(configs[0].name))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    times = [t for t, _ in interleaved_graph_us(fns, sets, rounds=10)]
    linear, new, before = times[0], times[1:1 + len(configs)], times[1 + len(configs):]
    for c, t_new, t_old in zip(configs, new, before):
        out.write(f"{m},{n},{k},{int(packed)},{c.name},{t_new:.3f},{t_old:.3f},{linear:.3f}\n")
    out.flush()
    bn, bo = min(range(len(configs)), key=new.__getitem__), min(range(len(configs)),
                                                                 key=before.__getitem__)
    return (f"{m:>4} {n:>6} {k:>6} {linear:>8.2f} {before[bo]:>8.2f} {new[bn]:>8.2f} "
            f"{before[bo] / new[bn]:>6.2f} {linear / new[bn]:>6.2f}  {configs[bn].name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--shapes", nargs="*", type=_shape, default=list(SHAPES))
    parser.add_argument("--row-major", action="store_true")
    parser.add_argument("--all-times", type=argparse.FileType("w"), default=sys.stderr)
    args = parser.parse_args()
    old = module_at(args.rev)
    args.all_times.write("M,N,K,packed,config,us,us_at_rev,linear_us\n")
    print(f"{'M':>4} {'N':>6} {'K':>6} {'linear':>8} {'at rev':>8} {'now':>8} {'gain':>6} "
          f"{'x lin':>6}  best config now (µs)")
    for m, n, k in args.shapes:
        print(time_shape(m, n, k, old, not args.row_major, args.all_times), flush=True)


if __name__ == "__main__":
    main()
