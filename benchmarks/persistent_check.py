"""First GPU check of the persistent TMA kernel: correct against torch, and its time next to the
tile kernel and torch on large-M shapes (hot L2, triton.testing.do_bench, median of ~100 ms).

    PYTHONPATH=src python3 benchmarks/persistent_check.py
"""

from __future__ import annotations

import torch
import triton

from gemmtune import quant
from gemmtune.kernels.triton.gemm_persistent import PersistentConfig, gemm_persistent
from gemmtune.kernels.triton.gemm_tile import TileConfig, gemm_tile
from gemmtune.kernels.torch_ref import scaled_mm_torch

SHAPES = ((4096, 4096, 4096), (2048, 28672, 4096), (8192, 7168, 2048))


def row(name, ms, ref_ms, err):
    return f"{name:<44} {ms * 1e3:9.1f} us  {ref_ms / ms:5.2f}x torch  rel err {err:.1e}"


def main() -> None:
    print(torch.cuda.get_device_name())
    for m, n, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        ref = x.float() @ w.float().t()
        t_torch = triton.testing.do_bench(lambda: torch.nn.functional.linear(x, w))
        print(f"bf16 {m}x{n}x{k}: torch {t_torch * 1e3:.1f} us")
        for cfg in (PersistentConfig(128, 128, 64, 8, 8, 3), PersistentConfig(128, 256, 64, 8, 8, 3),
                    TileConfig(128, 128, 64, 8, 4, 3), TileConfig(128, 256, 64, 8, 8, 3)):
            launch = gemm_persistent if isinstance(cfg, PersistentConfig) else gemm_tile
            y = launch(x, w, config=cfg)
            err = float((y.float() - ref).norm() / ref.norm())
            print(row(cfg.name, triton.testing.do_bench(lambda: launch(x, w, config=cfg)),
                      t_torch, err), flush=True)
        per_token, per_channel = quant.token_channel_quantisers(torch.float8_e4m3fn)
        (xq, xs), (wq, ws) = per_token(x.float()), per_channel(w.float())
        xs, ws = xs.reshape(-1), ws.reshape(-1)
        ref8 = scaled_mm_torch(xq, wq, None, torch.float32, xs, ws)
        t8 = triton.testing.do_bench(lambda: scaled_mm_torch(xq, wq, None, torch.bfloat16, xs, ws))
        print(f"fp8 {m}x{n}x{k}: torch._scaled_mm {t8 * 1e3:.1f} us")
        for cfg in (PersistentConfig(128, 128, 128, 8, 8, 3), PersistentConfig(128, 256, 128, 8, 8, 3),
                    TileConfig(128, 256, 128, 8, 8, 3)):
            launch = gemm_persistent if isinstance(cfg, PersistentConfig) else gemm_tile
            y = launch(xq, wq, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16, config=cfg)
            err = float((y.float() - ref8).norm() / ref8.norm())
            print(row(cfg.name, triton.testing.do_bench(
                lambda: launch(xq, wq, scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16,
                               config=cfg)), t8, err), flush=True)


if __name__ == "__main__":
    main()
