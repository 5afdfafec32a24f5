"""Where the host time of an eager Triton GEMM call goes, layer by layer, beside F.linear.

    PYTHONPATH=src python3 benchmarks/host_cost_probe.py

For one small shape (host-bound), each line times many back-to-back eager calls (median of
loops, the device synchronised at each loop's end): F.linear; torch.empty of the output; the
tile kernel through ``kernel[grid](...)`` (Triton's binder, cache look-up and launch); through
the compiled kernel's ``[grid]`` runner; through ``CompiledKernel.run`` called directly with
the current stream; the plan's launch function (``launch_gemm_tile``); and the whole op
(``gemm_a16w16`` through a table row naming the same config).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import gemmtune
from gemmtune.families.bf16.op import _CALLS as _BF16_CALLS
from gemmtune.families.bf16.op import bound_linear
from gemmtune.kernels.triton import gemm_tile
from gemmtune.kernels.triton._replay import all_arguments, launch
from gemmtune.kernels.triton.gemm_tile import launch_gemm_tile
from gemmtune.measure.timing import host_us_per_call

M, N, K = 16, 256, 256  # GPU time ~2-3 µs: every line is host-bound
ROUNDS = 5


def main() -> None:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    config = gemm_tile.default_config(M, N, K, torch.bfloat16)
    call = gemm_tile.tile_call(x, w, None, y, None, None, config)  # what launch_gemm_tile runs
    kernel, grid = call.kernel, call.grid
    args, kwargs = call.args, {**call.constexprs, **call.options}
    compiled = launch(call)
    runner = compiled[(grid[0], 1, 1)]
    ordered = all_arguments(call)
    compiled._init_handles()

    def direct():
        stream = torch.cuda.current_stream().cuda_stream
        compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                     None, None, *ordered)

    path = Path(tempfile.mkdtemp()) / "rows.csv"
    dev = gemmtune.current_device()
    path.write_text(
        "arch,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,"
        "kernelName,err_ratio,tflops,bw\n"
        f"{dev.arch},{dev.cu_num},{M},{N},{K},False,torch.bfloat16,torch.bfloat16,False,False,"
        f"triton,0,0,1.0,{config.name},0,0,0\n")
    os.environ["GEMMTUNE_CONFIG_BF16"] = f"replace:{path}"
    gemmtune.reset()
    direct()
    torch.cuda.synchronize()
    ref = x.float() @ w.float().t()
    print(f"direct launch rel err {float((y.float() - ref).norm() / ref.norm()):.1e}")
    launcher = compiled.run  # Triton's CudaLauncher: its C ``launch`` takes ints for pointers
    c_launch = launcher.launch
    fixed = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None,
             None, compiled.packed_metadata, None, None, None)
    device_index = x.get_device()
    cuda = torch.device("cuda", device_index)

    def c_launch_tensors():
        c_launch(grid[0], 1, 1, torch._C._cuda_getCurrentRawStream(device_index), *fixed,
                 *ordered)

    pointers = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in ordered]

    def c_launch_ints():
        c_launch(grid[0], 1, 1, torch._C._cuda_getCurrentRawStream(device_index), *fixed,
                 *pointers)

    xq = x.to(torch.float8_e4m3fn)
    wq_t = w.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    row_a, row_b = torch.ones(M, 1, device="cuda"), torch.ones(1, N, device="cuda")
    rows = [
        ("F.linear", lambda: F.linear(x, w)),
        ("torch._scaled_mm, per tensor", lambda: torch._scaled_mm(
            xq, wq_t, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)),
        ("torch._scaled_mm, per row", lambda: torch._scaled_mm(
            xq, wq_t, scale_a=row_a, scale_b=row_b, out_dtype=torch.bfloat16)),
        ("torch.empty (M, N)", lambda: torch.empty(M, N, device="cuda", dtype=torch.bfloat16)),
        ("torch.empty, a torch.device", lambda: torch.empty((M, N), dtype=torch.bfloat16,
                                                             device=cuda)),
        ("x.new_empty (M, N)", lambda: x.new_empty((M, N))),
        ("x.new_empty M, N (ints)", lambda: x.new_empty(M, N)),
        ("torch.empty, 'cuda:0'", lambda: torch.empty((M, N), dtype=torch.bfloat16,
                                                       device=f"cuda:{device_index}")),
        ("torch.empty M, N, a torch.device", lambda: torch.empty(M, N, dtype=torch.bfloat16,
                                                                 device=cuda)),
        ("C launch, tensors", c_launch_tensors),
        ("C launch, int pointers", c_launch_ints),
        ("key: shapes, dtypes, devices", lambda: (x.shape, w.shape, x.dtype, w.dtype,
                                                  x.get_device(), w.get_device())),
        ("the op's call key + dict hit", lambda: bound_linear(x, w, None)),
        ("is_compiling + autocast + grad", lambda: (
            torch.compiler.is_compiling(), torch._C._is_any_autocast_enabled(),
            x.requires_grad, w.requires_grad)),
        ("is_contiguous + data_ptr x2", lambda: (x.is_contiguous(), x.data_ptr(),
                                                 w.is_contiguous(), w.data_ptr())),
        ("kernel[grid](...)", lambda: kernel[grid](*args, **kwargs)),
        ("compiled[grid](...)", lambda: runner(*ordered)),
        ("CompiledKernel.run, direct", direct),
        ("launch_gemm_tile", lambda: launch_gemm_tile(x, w, None, y, None, None, config)),
        ("gemm_a16w16, Triton row", lambda: gemmtune.gemm_a16w16(x, w)),
        # The op's hot path in layers, with the torch row (F.linear) as the kernel.
        ("switches, then F.linear", lambda: _switches_then_linear(x, w)),
        ("switches, key, dict, F.linear", lambda: _keyed_linear(x, w, kernel="torch.linear")),
        ("gemm_a16w16, torch row", lambda: gemmtune.gemm_a16w16(x, w, kernel="torch.linear")),
    ]
    gemmtune.gemm_a16w16(x, w, kernel="torch.linear")  # plan and bind
    print(f"{torch.cuda.get_device_name()}, {M}x{N}x{K}, {config.name}: host µs per eager call "
          f"(median of {ROUNDS} interleaved rounds)")
    times = {name: [] for name, _ in rows}
    for _ in range(ROUNDS):
        for name, fn in rows:
            times[name].append(host_us_per_call(fn, calls=1000, loops=1))
    torch_row = dict(rows)["gemm_a16w16, torch row"]
    with torch.no_grad():
        times["gemm_a16w16, torch row, no_grad"] = [
            host_us_per_call(torch_row, calls=1000, loops=1) for _ in range(ROUNDS)]
    base = statistics.median(times["F.linear"])
    for name, t in times.items():
        us = statistics.median(t)
        print(f"  {name:<34} {us:7.2f}  ({us / base:.3f}x F.linear)")


def _switches_then_linear(x, w, bias=None, otype=None, scale_a=None, scale_b=None,
                          kernel=None):
    if torch.compiler.is_compiling():
        return None
    if torch._C._is_any_autocast_enabled():
        return None
    if torch.is_grad_enabled() and (
            x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    if scale_a is not None or scale_b is not None:
        return None
    return F.linear(x, w, bias)


def _keyed_linear(x, w, bias=None, otype=None, scale_a=None, scale_b=None, kernel=None):
    if torch.compiler.is_compiling():
        return None
    if torch._C._is_any_autocast_enabled():
        return None
    if torch.is_grad_enabled() and (
            x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    if scale_a is not None or scale_b is not None:
        return None
    call_key = (x.shape, w.shape, x.dtype, w.dtype, x.get_device(), w.get_device(), otype,
                kernel, None if bias is None else (bias.shape, bias.dtype, bias.get_device()))
    return _BF16_CALLS.get(call_key)(x, w, bias)


if __name__ == "__main__":
    main()
