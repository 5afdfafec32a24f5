"""Does cuBLASLt on this GPU run FP8 GEMMs with per-tensor (SCALAR_32F) and per-row
(OUTER_VEC_32F) scales, and are they right? For each scale mode and a few shapes: how many
algorithms the heuristic returns, the top one's relative error against the fp32 dequantised
product, and its time next to torch._scaled_mm (hot L2, events, 200 calls).

    PYTHONPATH=src python3 benchmarks/cublaslt_fp8_probe.py
"""

from __future__ import annotations

import numpy as np
import torch

from gemmtune import quant
from gemmtune.measure.timing import events_us
from gemmtune.kernels.cublaslt import _bindings as lt
from gemmtune.kernels.cublaslt.algo import algo_of
from gemmtune.kernels.cublaslt.plans import WORKSPACE_BYTES, device_state
from gemmtune.kernels.torch_ref import gemm_a8w8_ref, scaled_mm_torch

CUDA_R_8F_E4M3 = 28
SHAPES = ((1, 6144, 4096), (16, 4096, 4096), (64, 28672, 4096), (1024, 4096, 4096))


def set_desc(L, desc, attr, value) -> None:
    lt.set_attr(L.matmul_desc_set_attribute, L.get_matmul_desc_attribute_dtype, desc, attr,
                value)


def probe(mode: str, m: int, n: int, k: int) -> str:
    L = lt.bindings()
    attr = L.MatmulDescAttribute
    per_token, per_channel = quant.token_channel_quantisers(torch.float8_e4m3fn)
    xq, xs = per_token(torch.randn(m, k, device="cuda"))
    wq, ws = per_channel(torch.randn(n, k, device="cuda") / k ** 0.5)
    xs, ws = xs.reshape(-1).contiguous(), ws.reshape(-1).contiguous()
    if mode == "tensor":
        xs, ws = xs.max().reshape(1), ws.max().reshape(1)
    ref = gemm_a8w8_ref(xq, wq, xs, ws, None, torch.float32)
    desc = L.matmul_desc_create(lt.COMPUTE_32F, lt.CUDA_R_32F)
    set_desc(L, desc, attr.TRANSA, lt.OP_T)
    scale_mode = int(L.MatmulMatrixScale.SCALAR_32F if mode == "tensor"
                     else L.MatmulMatrixScale.OUTER_VEC_32F)
    set_desc(L, desc, attr.A_SCALE_MODE, scale_mode)
    set_desc(L, desc, attr.B_SCALE_MODE, scale_mode)
    set_desc(L, desc, attr.A_SCALE_POINTER, ws.data_ptr())  # A = w: cuBLAS rows are N
    set_desc(L, desc, attr.B_SCALE_POINTER, xs.data_ptr())  # B = x: cuBLAS columns are M
    a = L.matrix_layout_create(CUDA_R_8F_E4M3, k, n, k)
    b = L.matrix_layout_create(CUDA_R_8F_E4M3, k, m, k)
    c = L.matrix_layout_create(lt.CUDA_TYPES[torch.bfloat16], n, m, n)
    pref = L.matmul_preference_create()
    lt.set_attr(L.matmul_preference_set_attribute, L.get_matmul_preference_attribute_dtype,
                pref, L.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, WORKSPACE_BYTES)
    dev = device_state(torch.cuda.current_device())
    results = np.zeros(16, dtype=L.matmul_heuristic_result_dtype)
    returned = np.zeros(1, dtype=np.int32)
    try:
        L.matmul_algo_get_heuristic(dev.handle, desc, a, b, c, c, pref, 16, results.ctypes.data,
                                    returned.ctypes.data)
    except L.cuBLASLtError as e:
        return f"{mode:<6} {m}x{n}x{k}: heuristic refused ({e})"
    count = int(returned[0])
    if count == 0:
        return f"{mode:<6} {m}x{n}x{k}: no algorithm"
    algo = results["algo"][0:1].copy()
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    alpha, beta = np.ones(1, np.float32), np.zeros(1, np.float32)
    stream = torch.cuda.current_stream().cuda_stream
    workspace = dev.workspace(stream)

    def run():
        L.matmul(dev.handle, desc, alpha.ctypes.data, wq.data_ptr(), a, xq.data_ptr(), b,
                 beta.ctypes.data, out.data_ptr(), c, out.data_ptr(), c, algo.ctypes.data,
                 workspace, WORKSPACE_BYTES, stream)

    try:
        run()
        torch.cuda.synchronize()
    except L.cuBLASLtError as e:
        return f"{mode:<6} {m}x{n}x{k}: {count} algorithm(s), the top one fails to run ({e})"
    rel = float((out.float() - ref).norm() / ref.norm())
    name = algo_of(algo)
    t_lt = events_us(run, 200)
    t_torch = events_us(lambda: scaled_mm_torch(xq, wq, None, torch.bfloat16, xs, ws), 200)
    return (f"{mode:<6} {m}x{n}x{k}: {count} algorithm(s); top {name.name if name else '?'}; "
            f"rel err {rel:.2e}; {t_lt:.2f} us vs torch._scaled_mm {t_torch:.2f} us (hot)")


def main() -> None:
    print(f"cuBLASLt {lt.bindings().get_version()}, {torch.cuda.get_device_name()}")
    for mode in ("tensor", "outer"):
        for shape in SHAPES:
            print(probe(mode, *shape), flush=True)


if __name__ == "__main__":
    main()
