"""Does loading an FP8 weight straight into the warpgroup MMA's registers beat the shared-memory
path at decode? (issue 15, item 2: the route a pre-shuffled layout could pay on Hopper)

Plain Triton feeds both operands of a dot through shared memory, and a layout of w cannot change
that: 16 x 128-byte tiles ran at 1.00x row-major there (docs/benchmarks.md, session 19). Hopper's
wgmma takes its A operand from registers, though: in the swapped decode dot (y.T = w @ x.T, w's
64 rows as the MMA's M, x's few rows as its N) each thread could load its A fragments from
global memory itself. Stored in fragment order (``benchmarks/preshuffle_probe.py``'s ``frag``:
per 16 rows x 32 of K, lane l's 16 bytes contiguous), that is one 16-byte load per fragment,
with no shared-memory round trip and no barrier for w. This probe writes that kernel in Gluon
(Triton's layout-explicit dialect; the device runs Triton 3.6):

- ``frag``: w in fragment order, loaded as T[band, k32, lane, byte] (each thread one lane's 16
  contiguous bytes) and reshaped to the (BN, BK) A operand; the layout conversion to the
  wgmma operand layout is then free (the compiler checks the two layouts equal; ``--ptx``
  shows 16-byte loads and no extra shared-memory traffic);
- ``rowreg``: w row-major, loaded straight in the operand layout (4-byte loads);
- beside the split-K kernel's swapped dot on row-major w through shared memory (the shipped
  a8w8 kernel, same BN / BK / split) and ``torch._scaled_mm``.

The next K step of w is loaded before the current one's MMA (one step in flight per thread
beyond the one being used); K is split over a second grid axis, fp32 partials added atomically.
Every variant is checked against the fp32 reference before it is timed (interleaved CUDA-graph
replays over weight copies exceeding L2).

    PYTHONPATH=src python3 benchmarks/gluon_frag_probe.py [--out DIR]      # GPU
    python3 benchmarks/gluon_frag_probe.py --ptx     # CPU: compile for sm_90, count the loads
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

# The other probe's shapes, fragment order (``shuffle(w, "frag")``: per 16 rows x 32 of K, lane
# l's 16 bytes contiguous, in the m16n8k32 A fragment's register order) and report; a sibling
# script, found as this one is run.
from preshuffle_probe import MS, SHAPES, best_by_kind, print_ratios, shuffle, write_rows

BN = 64  # w rows per program: one warpgroup's MMA M


@gluon.jit
def _w_frag_offsets(band0, K, BN: gl.constexpr, BK: gl.constexpr, t_layout: gl.constexpr):
    """Element offsets of T[band, k32, lane, byte] of a program's first K step, fragment order."""
    b = gl.arange(0, BN // 16, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, t_layout))))
    kt = gl.arange(0, BK // 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, t_layout))))
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, t_layout))))
    byte = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, t_layout))))
    return ((band0 + b).to(gl.int64) * 16 * K)[:, None, None, None] \
        + (kt * 512)[None, :, None, None] + (lane * 16)[None, None, :, None] \
        + byte[None, None, None, :]


@gluon.jit
def frag_dot_kernel(x_ptr, w_ptr, y_ptr, M, N, K, steps_per_split,
                    FRAG: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BM, 32])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    # T: a warp per 16-row band, a thread per lane, its 16 bytes in registers
    t_layout: gl.constexpr = gl.BlockedLayout([1, 1, 1, 16], [1, 1, 32, 1], [4, 1, 1, 1],
                                              [3, 2, 1, 0])
    x_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])
    x_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.float8e4nv)
    pid = gl.program_id(0)
    split = gl.program_id(1)
    step_lo = split * steps_per_split
    step_hi = step_lo + steps_per_split
    if FRAG:
        w_offs = _w_frag_offsets(pid * (BN // 16), K, BN, BK, t_layout)
        w_step = BK * 16  # one K step of every band: BK / 32 fragment tiles of 512 bytes
    else:
        rows = (pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, a_layout))).to(gl.int64)
        ks = gl.arange(0, BK, layout=gl.SliceLayout(0, a_layout))
        w_offs = rows[:, None] * K + ks[None, :]
        w_step = BK
    xm = gl.arange(0, BM, layout=gl.SliceLayout(1, x_layout))
    xk = gl.arange(0, BK, layout=gl.SliceLayout(0, x_layout))
    x_rows = x_ptr + xm[:, None] * K + xk[None, :]
    x_smem = gl.allocate_shared_memory(gl.float8e4nv, [BM, BK], x_smem_layout)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    w_next = gl.load(w_ptr + w_offs + step_lo.to(gl.int64) * w_step)
    for step in range(step_lo, step_hi):
        w_now = w_next
        # The next step's w is in flight while this one multiplies (the last step re-reads its
        # own: a few L2 hits instead of a branch).
        ahead = gl.minimum(step + 1, step_hi - 1).to(gl.int64)
        w_next = gl.load(w_ptr + w_offs + ahead * w_step)
        if FRAG:
            # [band, k32, row in 8, k4, k half, row half, byte] -> (BN, BK)
            w7 = gl.reshape(w_now, [BN // 16, BK // 32, 8, 4, 2, 2, 4])
            w_now = gl.reshape(gl.permute(w7, [0, 5, 2, 1, 4, 3, 6]), [BN, BK])
        w_now = gl.convert_layout(w_now, a_layout)
        x = gl.load(x_rows + step * BK, mask=xm[:, None] < M, other=0.0)
        x_smem.store(x)
        fence_async_shared()
        acc = warpgroup_mma(w_now, x_smem.permute((1, 0)), acc)
    # Exactly one thread per element (64 rows: 32 lanes x 2 warps; columns over the other two
    # warps and registers): a layout that repeated elements across threads would add them twice.
    out_layout: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [2, 2], [0, 1])
    out = gl.convert_layout(acc, out_layout)
    on = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, out_layout))
    om = gl.arange(0, BM, layout=gl.SliceLayout(0, out_layout))
    gl.atomic_add(y_ptr + om[None, :] * N + on[:, None], out, mask=om[None, :] < M,
                  sem="relaxed")


def ptx_counts(bk: int = 128, bm: int = 16) -> dict[str, dict[str, int]]:
    """Compile both variants for sm_90 (no GPU needed) and count what the loads became."""
    from triton.backends.compiler import GPUTarget

    found = {}
    for frag in (True, False):
        sig = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "y_ptr": "*fp32", "M": "i32",
               "N": "i32", "K": "i32", "steps_per_split": "i32", "FRAG": "constexpr",
               "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"}
        aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 5)}
        src = gluon._runtime.GluonASTSource(
            fn=frag_dot_kernel, signature=sig, attrs=aligned,
            constexprs={"FRAG": frag, "BM": bm, "BN": BN, "BK": bk})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 128)).asm["ptx"]
        found["frag" if frag else "rowreg"] = {
            "wgmma": len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3", ptx)),
            **{op: ptx.count(op) for op in ("ld.global.v4", "ld.global.b32", "ld.shared",
                                            "st.shared")}}
    return found


class Variant:
    def __init__(self, frag: bool, bk: int, split: int, m: int, n: int, k: int):
        self.frag, self.bk, self.split = frag, bk, split
        self.bm = max(16, triton.next_power_of_2(m))
        self.steps = k // bk // split
        self.grid = (n // BN, split)
        self.name = f"{'frag' if frag else 'rowreg'}.BK{bk}.SK{split}"

    def __call__(self, x, w, y):
        y.zero_()
        m, k = x.shape
        frag_dot_kernel[self.grid](x, w, y, m, y.shape[1], k, self.steps, self.frag, self.bm,
                                   BN, self.bk, num_warps=4)
        return y


def splits_for(n: int, k: int, bk: int, sms: int) -> list[int]:
    steps, tiles = k // bk, n // BN
    found = []
    for per_sm in (1, 2, 4):
        split = max(1, min(steps, -(-per_sm * sms // tiles)))
        while steps % split:
            split -= 1
        found.append(split)
    return sorted(set(found))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--ptx", action="store_true", help="compile for sm_90 and count loads")
    args = parser.parse_args()
    if args.ptx:
        for bk in (128, 256):
            print(f"BK{bk}:", ptx_counts(bk))
        return
    from gemmtune.kernels.torch_ref import scaled_mm_torch
    from gemmtune.kernels.triton.gemm_splitk import SplitKConfig, fits, launch_gemm_splitk
    from gemmtune.measure.timing import copies_to_exceed_l2, interleaved_graph_us

    args.out.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for n, k in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        w = (torch.randn(n, k, generator=gen, device="cuda") / 8).to(torch.float8_e4m3fn)
        copies = [{"row": c, "frag": shuffle(c, "frag").view(n, k)}
                  for c in [w] + [w.clone() for _ in range(copies_to_exceed_l2(2 * n * k) - 1)]]
        one = torch.ones(1, device="cuda")
        for m in MS:
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.float8_e4m3fn)
            ref = x.float() @ w.float().T
            y = torch.empty(m, n, device="cuda")
            y_bf16 = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            fns, names = [], []
            for bk in (128, 256):
                for split in splits_for(n, k, bk, sms):
                    for frag in (True, False):
                        v = Variant(frag, bk, split, m, n, k)
                        got = v(x, copies[0]["frag" if frag else "row"], torch.empty_like(y))
                        if float((got - ref).norm() / ref.norm()) < 1e-2:
                            fns.append(lambda c, v=v: v(x, c["frag" if v.frag else "row"], y))
                            names.append(v.name)
                        else:
                            print(f"{m}x{n}x{k} {v.name}: wrong, skipped", flush=True)
                    cfg = SplitKConfig(max(16, triton.next_power_of_2(m)), BN, bk, split, 4, 4,
                                       swap_ab=1)
                    if not fits(cfg, m, n, k, torch.float8_e4m3fn):
                        continue
                    launch_gemm_splitk(x, w, None, y_bf16, one, one, cfg)
                    if float((y_bf16.float() - ref).norm() / ref.norm()) < 1e-2:
                        fns.append(lambda c, cfg=cfg: launch_gemm_splitk(
                            x, c["row"], None, y_bf16, one, one, cfg))
                        names.append(f"smem.BK{bk}.SK{split}")
            fns.append(lambda c: scaled_mm_torch(x, c["row"], None, torch.bfloat16, one, one))
            names.append("scaled_mm")
            times = [t for t, _ in interleaved_graph_us(fns, copies, rounds=9, replays=2)]
            best = best_by_kind([(name.split(".")[0], name) for name in names], times)
            rec = {"M": m, "N": n, "K": k}
            for kind, (t, name) in best.items():
                rec[f"{kind}_us"], rec[f"{kind}_cfg"] = t, name
            rows.append(rec)
            print(f"{m:>3}x{n}x{k}: " + " | ".join(f"{kind} {t:7.2f}" for kind, (t, _)
                                                   in sorted(best.items())), flush=True)
    write_rows(rows, args.out / "gluon_frag_probe.csv")
    print_ratios(rows, "register-direct / shared-memory split-K time, geomean (below 1: "
                 "registers faster)", {kind: (f"{kind}_us", "smem_us")
                                       for kind in ("frag", "rowreg", "scaled_mm")})


if __name__ == "__main__":
    main()
