"""Where an eager Hugging Face step's time goes, patched and not: diagnostics beside
benchmarks/e2e_hf.py, on its models, variants and timing.

- ``--variants``: e2e_hf's comparison with more variants on torch's kernels, each adding one
  step of the patched layer's path (``DIAGNOSTICS``);
- ``--one-kernel KERNEL``: the comparison with one kernel for every shape (``cublaslt``:
  cuBLASLt's heuristic pick per shape): one backend's cost in the model;
- ``--without PREFIX``: the comparison with the tuned kernels, but torch's where a kernel's
  name starts with PREFIX;
- ``--layers``: per linear shape of a step, the host time to issue one call, patched and not;
- ``--profile`` / ``--trace``: cProfile / torch.profiler of eager steps, patched and not.

    PYTHONPATH=src python3 benchmarks/e2e_hf_diag.py --variants [--models llama3-8b]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gemmtune
from gemmtune.families import _switches as switches
from e2e_hf import (BATCHES, LAYERS, MODELS, PREFILL, DecodePoint, PrefillPoint, arguments,
                    build, gemm_shapes, report, run_model, tune_missing, variant, write_rows)
from gemmtune.families.bf16.op import gemm_a16w16
from gemmtune.kernels.torch_ref import TORCH_LINEAR
from gemmtune.nn import TunedLinear

LAYER_ROUNDS = 21  # --layers


def calls_per_step(name: str, tokens: int) -> dict[tuple[int, int, int], int]:
    """(M, N, K) -> linear calls per forward of ``tokens`` tokens (the lm_head sees the last
    token of each sequence only: ``tokens`` for decode, 1 for the prefill)."""
    d = MODELS[name]
    h, hd = d["hidden_size"], d["head_dim"]
    q, kv = d["num_attention_heads"] * hd, d["num_key_value_heads"] * hd
    calls: dict[tuple[int, int, int], int] = {}
    for n, k in ((q, h), (kv, h), (kv, h), (h, q), (d["intermediate_size"], h),
                 (d["intermediate_size"], h), (h, d["intermediate_size"])):
        calls[tokens, n, k] = calls.get((tokens, n, k), 0) + LAYERS
    head = (1 if tokens == PREFILL else tokens, d["vocab_size"], h)
    calls[head] = calls.get(head, 0) + 1
    return calls


def issue_us(fn, calls: int = 100) -> float:
    """Host µs per call to issue ``calls`` back-to-back ``fn()`` (no wait for the GPU inside the
    timing; synchronised after)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


@torch.no_grad()
def layer_costs(name: str) -> list[dict]:
    """``--layers``: per linear shape a step meets, the kernel in force, the host time to issue
    one call of the patched layer and of nn.Linear (median of LAYER_ROUNDS rounds, each timing
    both), and the step's calls of it: what the patch adds to an eager step's host time, shape
    by shape."""
    from gemmtune.families.bf16.op import DISPATCH

    rows = []
    for point, tokens in [(f"decode b={b}", b) for b in BATCHES] + [("prefill", PREFILL)]:
        for (m, n, k), count in sorted(calls_per_step(name, tokens).items()):
            plain = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            patched = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            gemmtune.patch_linear(patched)
            x = torch.randn(m, 1, k, device="cuda", dtype=torch.bfloat16)
            patched(x), plain(x)
            times = {"plain": [], "patched": []}
            for _ in range(LAYER_ROUNDS):
                times["plain"].append(issue_us(lambda: plain(x)))
                times["patched"].append(issue_us(lambda: patched(x)))
            plain_us, patched_us = (statistics.median(times[v]) for v in ("plain", "patched"))
            key = (m, n, k, False, "torch.bfloat16", "torch.bfloat16", False, False)
            rows.append(dict(model=name, point=point, M=m, N=n, K=k, calls=count,
                             kernel=DISPATCH.decide(key).kernel_name,
                             linear_us=round(plain_us, 2), patched_us=round(patched_us, 2),
                             step_delta_us=round(count * (patched_us - plain_us), 1)))
    return rows



def without_backend_table(names: list[str], prefix: str, out_dir: Path) -> None:
    """``--without PREFIX``: for every shape of the models the kernel the tables in force give,
    but the torch row where that kernel's name starts with PREFIX; in force alone."""
    from gemmtune.families.bf16.op import DISPATCH

    chosen = {}
    for m, n, k in sorted({s for name in names for s in gemm_shapes(name)}):
        key = (m, n, k, False, "torch.bfloat16", "torch.bfloat16", False, False)
        kernel = DISPATCH.decide(key).kernel_name
        chosen[m, n, k] = "torch.linear" if kernel.startswith(prefix) else kernel
    write_table(chosen, out_dir / "e2e_without.csv")


def write_table(kernels: dict[tuple[int, int, int], str], path: Path) -> None:
    """A bf16 table of these (M, N, K) -> kernel rows, in force alone for this run."""
    dev = gemmtune.current_device()
    path.write_text(
        "arch,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,"
        "kernelName,err_ratio,tflops,bw\n" + "".join(
            f"{dev.arch},{dev.cu_num},{m},{n},{k},False,torch.bfloat16,torch.bfloat16,False,"
            f"False,x,0,0,1.0,{kernel},0,0,0\n" for (m, n, k), kernel in kernels.items()))
    os.environ["GEMMTUNE_CONFIG_BF16"] = f"replace:{path}"
    gemmtune.reset()


def one_kernel_table(names: list[str], kernel: str, out_dir: Path) -> None:
    """``--one-kernel``: a bf16 table naming ``kernel`` for every shape of the models, in force
    alone for this run; ``cublaslt``: cuBLASLt's heuristic pick for each shape."""
    from gemmtune.kernels import cublaslt

    def name_for(m: int, n: int, k: int) -> str:
        if kernel != "cublaslt":
            return kernel
        return cublaslt.heuristic_algos(m, n, k, torch.bfloat16, torch.bfloat16, False)[0].name

    write_table({(m, n, k): name_for(m, n, k)
                 for m, n, k in sorted({s for name in names for s in gemm_shapes(name)})},
                out_dir / "e2e_one_kernel.csv")



class _TorchRowLinear(nn.Linear):
    """The op with the torch row forced (``--variants``): the op's own host cost in the model,
    with the same cuBLAS kernels as unpatched."""

    def forward(self, x):
        return gemm_a16w16(x, self.weight, self.bias, kernel=TORCH_LINEAR)


class _ParamsDictLinear(nn.Linear):
    """``--variants``: F.linear with the parameters read from the module's dict (not through
    nn.Module.__getattr__), as TunedLinear reads them."""

    def forward(self, x):
        params = self._parameters
        return F.linear(x, params["weight"], params["bias"])


class _SwitchesLinear(nn.Linear):
    """``--variants``: the above after TunedLinear's four switches (compile, grad, autocast)."""

    def forward(self, x):
        if (switches.dynamo_compiling() or switches.compiler._is_compiling_flag
                or switches.grad_enabled() or switches.any_autocast()):
            raise RuntimeError("the diagnostic runs plain eager calls only")
        params = self._parameters
        return F.linear(x, params["weight"], params["bias"])


class _KeyedLinear(nn.Linear):
    """``--variants``: the above and a look-up of ``key(x)`` in a dict of the layer's, which
    holds F.linear (``key``: its input's shape, dtype and device, as TunedLinear's per-layer
    bound calls were keyed in session 12's measurements)."""

    @staticmethod
    def key(x):
        return x.shape, x.dtype, x.get_device()

    def forward(self, x):
        if (switches.dynamo_compiling() or switches.compiler._is_compiling_flag
                or switches.grad_enabled() or switches.any_autocast()):
            raise RuntimeError("the diagnostic runs plain eager calls only")
        params = self._parameters
        runs = self.__dict__.get("_runs")
        if runs is None:
            runs = self.__dict__["_runs"] = {}
        run = runs.get(self.key(x))
        if run is None:
            run = runs[self.key(x)] = F.linear
        return run(x, params["weight"], params["bias"])


class _ShapeKeyedLinear(_KeyedLinear):
    """``--variants``: the look-up by the input's shape alone."""

    @staticmethod
    def key(x):
        return x.shape


class _NumelKeyedLinear(_KeyedLinear):
    """``--variants``: the look-up by the input's element count alone."""

    @staticmethod
    def key(x):
        return x.numel()


# ``--variants``: variants that take the patched layer's path apart, on torch's own kernels.
DIAGNOSTICS = {"op, torch rows": _TorchRowLinear, "params dict": _ParamsDictLinear,
               "+ switches": _SwitchesLinear, "+ layer key": _KeyedLinear,
               "+ shape key": _ShapeKeyedLinear, "+ numel key": _NumelKeyedLinear}



@torch.no_grad()
def profile_steps(name: str, out_dir: Path, steps: int = 60) -> None:
    """``--profile``: cProfile of ``steps`` eager steps, unpatched and patched, at decode b=1
    and the prefill: where the host time of a step goes (full listings in $OUT)."""
    import cProfile
    import io
    import pstats

    model = build(name)
    variants = {"unpatched": variant(name, model, nn.Linear),
                "patched": variant(name, model, TunedLinear)}
    for label, point in (("decode b=1", DecodePoint(model, 1)), ("prefill", PrefillPoint(model))):
        for v, m in variants.items():
            for _ in range(3):
                point.rewind()
                point.step(m)
            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            start = time.perf_counter()
            profiler.enable()
            for _ in range(steps):
                point.rewind()
                point.step(m)
                torch.cuda.synchronize()
            profiler.disable()
            wall = (time.perf_counter() - start) / steps * 1e3
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(40)
            (out_dir / f"profile_{name}_{label.replace(' ', '_')}_{v}.txt").write_text(
                text.getvalue())
            print(f"== {name} {label} {v}: {wall:.3f} ms a step under the profiler")
            print("\n".join(text.getvalue().splitlines()[:28]))


@torch.no_grad()
def trace_steps(name: str, out_dir: Path, steps: int = 20) -> None:
    """``--trace``: torch.profiler of ``steps`` eager decode steps at b=1, unpatched and
    patched: host time per op and GPU time per kernel, and the wall time of each."""
    from torch.profiler import ProfilerActivity, profile

    model = build(name)
    variants = {"unpatched": variant(name, model, nn.Linear),
                "patched": variant(name, model, TunedLinear)}
    point = DecodePoint(model, 1)
    for v, m in variants.items():
        for _ in range(3):
            point.rewind()
            point.step(m)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                point.rewind()
                point.step(m)
                torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / steps * 1e3
        averages = prof.key_averages()
        text = (f"{name} decode b=1 {v}: {wall:.3f} ms a step under the profiler\n"
                + averages.table(sort_by="self_cpu_time_total", row_limit=25)
                + averages.table(sort_by="self_cuda_time_total", row_limit=25))
        (out_dir / f"trace_{name}_{v}.txt").write_text(text)
        prof.export_chrome_trace(str(out_dir / f"trace_{name}_{v}.json"))
        print(text)


def report_layer_costs(names: list[str], out_dir: Path) -> None:
    rows = [row for name in names for row in layer_costs(name)]
    write_rows(rows, out_dir / "e2e_layers.csv")
    print(f"host µs to issue one call, patched layer against nn.Linear (median of "
          f"{LAYER_ROUNDS}); per step: calls x the difference")
    for r in rows:
        print(f"{r['model']:<15} {r['point']:<11} {r['M']:>4} {r['N']:>6} {r['K']:>6} "
              f"x{r['calls']:<3} {r['kernel'][:44]:<44} {r['linear_us']:7.2f} "
              f"{r['patched_us']:7.2f} {r['step_delta_us']:+8.1f}")
    for name in names:
        for point in dict.fromkeys(r["point"] for r in rows if r["model"] == name):
            total = sum(r["step_delta_us"] for r in rows
                        if r["model"] == name and r["point"] == point)
            print(f"{name} {point}: the patch adds {total:+.1f} µs of host time a step")




def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--variants", action="store_true",
                      help="the comparison with the DIAGNOSTICS variants too")
    mode.add_argument("--one-kernel", metavar="KERNEL",
                      help="the comparison with KERNEL for every shape (a table of it alone, "
                           "nothing tuned; 'cublaslt': its heuristic pick per shape)")
    mode.add_argument("--without", metavar="PREFIX",
                      help="the comparison with the tuned kernels, but torch's where a "
                           "kernel's name starts with PREFIX")
    mode.add_argument("--layers", action="store_true",
                      help="the host cost to issue each linear shape, patched and not")
    mode.add_argument("--profile", action="store_true",
                      help="a cProfile of eager steps, patched and not")
    mode.add_argument("--trace", action="store_true",
                      help="a torch.profiler trace of eager decode steps at b=1")
    args = arguments(parser)
    names, out_dir = args.names, args.out_dir
    if args.one_kernel:
        one_kernel_table(names, args.one_kernel, out_dir)
    elif not args.no_tune:
        tune_missing(names, out_dir)
    if args.without:
        without_backend_table(names, args.without, out_dir)
    if args.layers:
        report_layer_costs(names, out_dir)
    elif args.profile or args.trace:
        for name in names:
            (profile_steps if args.profile else trace_steps)(name, out_dir)
    else:
        extra = DIAGNOSTICS if args.variants else {}
        report([row for name in names for row in run_model(name, extra)], out_dir, list(extra))


if __name__ == "__main__":
    main()
