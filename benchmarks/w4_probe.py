"""MXFP4 GEMMs on the GPU (issue 16): ``gemm_w4``'s configs (``gemm_w4.candidates``: K split
for decode included) with bf16 x and with MXFP4 x, against bf16 ``F.linear`` and the FP8
per-token op (``gemm_a8w8``, its shipped rows) on the same (N, K), in one run: CUDA graphs, cold
L2, the best config per shape.

    PYTHONPATH=src python3 benchmarks/w4_probe.py [--shapes M,N,K ...] [--configs NAME ...]
        [--all-times FILE]

``--configs``: time these configs (``triton.w4``, ``triton.w4frag``, ``triton.w4xa``,
``triton.w4wg`` and ``triton.w4deq`` names; those that fit each shape) instead of the kernels'
candidates. ``--only GLOB ...``: of those, the configs whose names match one of the patterns.
``--all-times``: every config's time per shape, as CSV. Session 22 timed six shapes with twelve
unsplit configs: 0.45-0.60x F.linear.
"""

from __future__ import annotations

import argparse
import fnmatch

import torch
import torch.nn.functional as F

from gemmtune import quant
from gemmtune.families.a8w8 import gemm_a8w8
from gemmtune.kernels.triton import gemm_w4, gemm_w4deq, gemm_w4frag, gemm_w4wg, gemm_w4xa
from gemmtune.kernels.triton._splits import pdl_where_supported
from gemmtune.measure.timing import cold_copies, interleaved_graph_us

SHAPES = ((1, 4096, 4096), (16, 4096, 4096), (1, 14336, 4096), (16, 14336, 4096),
          (1, 4096, 14336), (16, 4096, 14336), (1, 2880, 2880), (16, 2880, 2880),
          (64, 4096, 4096), (1024, 4096, 4096))


def _shape(text: str) -> tuple[int, int, int]:
    m, n, k = (int(v) for v in text.split(","))
    return m, n, k


_CONFIGS = {gemm_w4.KERNEL_PREFIX: gemm_w4.W4Config,
            gemm_w4frag.KERNEL_PREFIX: gemm_w4frag.W4FragConfig,
            gemm_w4deq.KERNEL_PREFIX: gemm_w4deq.W4DeqConfig,
            gemm_w4wg.KERNEL_PREFIX: gemm_w4wg.W4WgConfig,
            gemm_w4xa.KERNEL_PREFIX: gemm_w4xa.W4XaConfig}
_MODULES = {gemm_w4.W4Config: gemm_w4, gemm_w4frag.W4FragConfig: gemm_w4frag,
            gemm_w4deq.W4DeqConfig: gemm_w4deq, gemm_w4wg.W4WgConfig: gemm_w4wg,
            gemm_w4xa.W4XaConfig: gemm_w4xa}


def _config(name: str):
    return _CONFIGS[name.split(":", 1)[0]].from_name(name)


def _module(config):
    return _MODULES[type(config)]


def _configs(named: list | None, m: int, n: int, k: int, dtype: torch.dtype,
             frag_candidates: bool = False) -> list:
    """The named configs that fit (and with ``frag_candidates`` the register-direct, the
    warpgroup-MMA and the dequantise-then-cuBLAS kernels' candidates, both layouts), else all
    four kernels' candidates (the register-direct one's for bf16 and MXFP4 x, M <= 32; the
    other two's from M = 64, the warpgroup MMA's for bf16 x and w as quantised)."""
    frags = [c for packed in (False, True) for c in gemm_w4frag.candidates(
        m, n, k, dtype, pdl=pdl_where_supported(), packed=packed)
        + gemm_w4wg.candidates(m, n, k, dtype, packed=packed)
        + gemm_w4deq.candidates(m, n, k, dtype, packed=packed)
        + gemm_w4xa.candidates(m, n, k, dtype, pdl=pdl_where_supported(), packed=packed)]
    if named is None:
        return gemm_w4.candidates(m, n, k, dtype) + frags
    return [c for c in named if _module(c).why_not_fits(c, m, n, k, dtype) is None] + \
        (frags if frag_candidates else [])


def _launch(config, x, w, out, x_scale, w_scale, w_packed=None):
    if isinstance(config, gemm_w4xa.W4XaConfig):  # packed w only
        return gemm_w4xa.launch_gemm_w4xa(x, w_packed, None, out, x_scale, w_scale, config)
    if isinstance(config, gemm_w4frag.W4FragConfig):
        return gemm_w4frag.launch_gemm_w4frag(x, w_packed if config.packed else w, None, out,
                                              x_scale, w_scale, config)
    if isinstance(config, gemm_w4wg.W4WgConfig):
        return gemm_w4wg.launch_gemm_w4wg(x, w_packed if config.packed else w, None, out,
                                          x_scale, w_scale, config)
    if isinstance(config, gemm_w4deq.W4DeqConfig):
        return gemm_w4deq.launch_gemm_w4deq(x, w_packed if config.packed else w, None, out,
                                            x_scale, w_scale, config)
    return gemm_w4.launch_gemm_w4(x, w, None, out, x_scale, w_scale, config)


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def time_shape(m: int, n: int, k: int, named: list | None, all_times,
               mxfp4_x: bool = True, frag_candidates: bool = False,
               only: list[str] | None = None) -> str:
    w = torch.randn(n, k, device="cuda") / k ** 0.5
    x = torch.randn(m, k, device="cuda")
    wq, ws = quant.mxfp4(w)
    xq4, xs4 = quant.mxfp4(x)
    x16, w16 = x.to(torch.bfloat16), w.to(torch.bfloat16)
    xq8, xs8 = quant.per_token_fp8(x)
    wq8, ws8 = quant.per_channel_fp8(w)
    wqp = quant.prepack_mxfp4(wq, ws)[0] if k % 128 == 0 else wq
    # Each op's own operands beyond L2: F.linear's, the FP8 op's, the MXFP4 kernels' (bf16 x,
    # MXFP4 x, packed w)
    sets = cold_copies((x16, w16, wq, ws, xq4, xs4, xq8, xs8, wq8, ws8, wqp),
                       per_op=((0, 1), (6, 7, 8, 9), (0, 2, 3), (4, 5, 2, 3), (0, 3, 10)))
    configs = _configs(named, m, n, k, torch.bfloat16, frag_candidates)
    a4_configs = _configs(named, m, n, k, torch.uint8, frag_candidates) if mxfp4_x else []
    if only is not None:  # the configs whose names match one of the patterns
        configs = [c for c in configs if _matches(c.name, only)]
        a4_configs = [c for c in a4_configs if _matches(c.name, only)]
    out16 = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    fns = [lambda s: F.linear(s[0], s[1]),
           lambda s: gemm_a8w8(s[6], s[8], s[7], s[9])]
    for c in configs:
        _launch(c, x16, wq, out16, None, ws, wqp)  # compiled before the capture
        fns.append(lambda s, c=c: _launch(c, s[0], s[2], out16, None, s[3], s[10]))
    for c in a4_configs:
        _launch(c, xq4, wq, out16, xs4, ws, wqp)
        fns.append(lambda s, c=c: _launch(c, s[4], s[2], out16, s[5], s[3], s[10]))
    fns[1](sets[0])  # the FP8 op planned before the capture
    times = [t for t, _ in interleaved_graph_us(fns, sets, rounds=10)]
    linear, fp8 = times[0], times[1]
    w4 = times[2:2 + len(configs)]
    a4 = times[2 + len(configs):]
    if all_times is not None:
        for x_kind, cs, ts in (("bf16", configs, w4), ("mxfp4", a4_configs, a4)):
            for c, t in zip(cs, ts):
                all_times.write(f"{m},{n},{k},{x_kind},{c.name},{t:.3f},{linear:.3f}\n")
        all_times.flush()
    best16 = min(range(len(w4)), key=w4.__getitem__)
    line = (f"{m:>5} {n:>6} {k:>6} {linear:>9.2f} {fp8:>8.2f} {w4[best16]:>9.2f} "
            f"{linear / w4[best16]:>6.2f}")
    if not a4:
        return f"{line} {'-':>9} {'-':>6}  {configs[best16].name}"
    best4 = min(range(len(a4)), key=a4.__getitem__)
    return (f"{line} {a4[best4]:>9.2f} {linear / a4[best4]:>6.2f}  "
            f"{configs[best16].name} | {a4_configs[best4].name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     fromfile_prefix_chars="@")
    parser.add_argument("--shapes", nargs="*", type=_shape, default=list(SHAPES))
    parser.add_argument("--configs", nargs="*", type=_config, default=None)
    parser.add_argument("--all-times", type=argparse.FileType("w"), default=None)
    parser.add_argument("--bf16-x-only", action="store_true",
                        help="time bf16 x alone (not MXFP4 x too): half the compiles")
    parser.add_argument("--frag-candidates", action="store_true",
                        help="with --configs: the w4frag, w4wg and w4deq kernels' candidates "
                             "too")
    parser.add_argument("--only", metavar="GLOB", nargs="+", default=None,
                        help="time only the configs whose names match one of the GLOBs "
                             "(fnmatch), e.g. 'triton.w4frag:*P1.R1.L1*' 'triton.w4xa:*'")
    args = parser.parse_args()
    if args.all_times is not None:
        args.all_times.write("M,N,K,x,config,us,linear_us\n")
    print(f"{'M':>5} {'N':>6} {'K':>6} {'linear':>9} {'fp8 op':>8} {'a16w4':>9} {'x':>6} "
          f"{'a4w4':>9} {'x':>6}  best configs (µs; x = F.linear / it)")
    for m, n, k in args.shapes:
        print(time_shape(m, n, k, args.configs, args.all_times, not args.bf16_x_only,
                         args.frag_candidates, args.only), flush=True)


if __name__ == "__main__":
    main()
