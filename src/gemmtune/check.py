"""``gemmtune check``: run gemm_a16w16 on a model's dense shapes, verify it, say what ran and how fast."""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch

from gemmtune.device import current_device, has_gpu
from gemmtune.kernels.torch_ref import gemm_a16w16_ref
from gemmtune.models.shapes import dense_projections, load_preset
from gemmtune.ops.gemm_a16w16 import DISPATCH, gemm_a16w16
from gemmtune.tune.timing import copies_to_exceed_l2, graph_replay_us

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# ||out - ref|| / ||ref|| bounds. The output is rounded to its dtype (bf16: 8 mantissa bits,
# relative rounding error up to 2^-9 ≈ 2e-3 per element; fp16: 2^-12), and accumulation order
# differs between kernels; fp32 without tf32 is exact to ~1e-6 per element at these K.
REL_NORM_BOUND = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}

GPU_M = (1, 16, 128, 1024, 4096)
CPU_M = (1, 16)


@dataclass
class CheckResult:
    name: str
    m: int
    n: int
    k: int
    rule: str
    kernel: str
    us: float
    rel_err: float
    ok: bool


def _time_us(x: torch.Tensor, w: torch.Tensor) -> float:
    """GPU: time per call under CUDA-graph replay with cold weights; CPU: median wall time."""
    if x.is_cuda:
        sets = [(x, w.clone()) for _ in range(copies_to_exceed_l2(w.numel() * w.element_size()))]
        return graph_replay_us(lambda a: gemm_a16w16(*a), sets)[0]
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        gemm_a16w16(x, w)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def check_shape(name: str, m: int, n: int, k: int, dtype: torch.dtype, device: str,
                gen: torch.Generator) -> CheckResult:
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(dtype)
    y = gemm_a16w16(x, w)
    ref = gemm_a16w16_ref(x, w, out_dtype=torch.float32)
    rel = ((y.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    ok = bool(torch.isfinite(y).all()) and rel <= REL_NORM_BOUND[dtype]
    decision = DISPATCH.plans[(m, n, k, False, dtype, dtype, False, False, x.get_device())].decision
    us = _time_us(x, w)
    return CheckResult(name, m, n, k, decision.rule.value, decision.kernel_name, us, rel, ok)


def run_check(model: str, tp: int, m_values: list[int] | None, dtype_name: str) -> int:
    gpu = has_gpu()
    dev = current_device()
    if gpu:
        print(f"GPU: {torch.cuda.get_device_name()} ({dev})")
    else:
        print(f"no GPU found: running on the CPU ({dev}) with the torch backend; GPU table rows "
              f"do not apply and times are CPU times")
    dtype = DTYPES[dtype_name]
    spec = load_preset(model)
    ms = m_values or list(GPU_M if gpu else CPU_M)
    gen = torch.Generator(device="cuda" if gpu else "cpu").manual_seed(0)
    results = []
    for proj in dense_projections(spec, tp):
        for m in ms:
            r = check_shape(proj.name, m, proj.N, proj.K, dtype, "cuda" if gpu else "cpu", gen)
            results.append(r)
            print(f"  {r.name:<14} M={r.m:<5} N={r.n:<6} K={r.k:<6} {r.rule:<8} "
                  f"{r.kernel:<40} {r.us:>10.1f} us  err {r.rel_err:.1e} "
                  f"{'ok' if r.ok else 'WRONG'}", flush=True)
    bad = [r for r in results if not r.ok]
    print(f"{model} tp={tp} {dtype_name}: {len(results) - len(bad)}/{len(results)} shapes correct"
          + (f"; WRONG: {', '.join(f'{r.name} M={r.m}' for r in bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(run_check("llama3-8b", 1, None, "bf16"))
