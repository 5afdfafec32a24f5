"""End to end in Hugging Face transformers: Llama-architecture models with real dimensions,
patched with ``gemmtune.patch_linear`` against unpatched, in one run.

Models (random weights, nothing downloaded, ``LAYERS`` decoder layers): llama3-8b, and the
llama3-70b shard one GPU of eight holds under tensor parallelism (heads, KV heads, MLP width
and vocabulary divided by 8). First the GEMM shapes of the Hugging Face layout (separate q, k,
v, gate and up projections; the lm_head) at every token count timed here are tuned, where the
tables in force have no exact row (``gemmtune tune bf16``, into $OUT/e2e_tuned.csv, used as
an overlay). Then per model, in interleaved rounds (the host's speed drifts), the model and
its variants, each its own model object with the same weights (so timing one switches no
class of another's): unpatched, patched, the A/A control (the unpatched model under another
class: the eager noise floor of the run) and with ``--diagnose`` variants on torch's kernels
that add the patched layer's steps one at a time (``DIAGNOSTICS``):

- decode, one token per sequence against a static KV cache of ``CONTEXT`` tokens, at batch
  1, 8 and 32: eagerly (one step, synchronised) and as a captured CUDA graph;
- a ``PREFILL``-token prefill (logits of the last token), eagerly and as a CUDA graph.

Logits: the prefill's of both against the model in fp32, the patched error within 1.5x the
unpatched one (+1e-3); each decode point's patched logits against the unpatched ones, within 3x
the prefill's unpatched error (at least 1e-2). Prints speed-up = unpatched time / patched time,
the median over the rounds (``EAGER_ROUNDS`` of one eager step, ``ROUNDS`` of graph replays)
of each round's ratio (the variants in an order rotated each round).

    PYTHONPATH=src python3 benchmarks/e2e_hf.py [--no-tune] [--models llama3-8b] [--diagnose]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gemmtune
from gemmtune.families.bf16.op import gemm_a16w16
from gemmtune.kernels.torch_ref import TORCH_LINEAR
import gemmtune.nn as tuned_nn
from gemmtune.nn import TunedLinear

LAYERS = 4
BATCHES = (1, 8, 32)
PREFILL = 512
CONTEXT = 128  # tokens in the KV cache when a decode step runs
ROUNDS = 31  # of graph replays
EAGER_ROUNDS = 241  # of one eager step
LAYER_ROUNDS = 21  # --layers
GRAPH_REPLAYS = 20

# Llama 3 dimensions; "-tp8" is one GPU's shard under 8-way tensor parallelism.
MODELS = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256),
    "llama3-70b-tp8": dict(hidden_size=8192, intermediate_size=28672 // 8,
                           num_attention_heads=64 // 8, num_key_value_heads=1, head_dim=128,
                           vocab_size=128256 // 8),
}


def build(name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=LAYERS, max_position_embeddings=8192,
                         rope_theta=500000.0, **MODELS[name])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


def gemm_shapes(name: str) -> list[tuple[int, int, int]]:
    """(M, N, K) of every projection of the Hugging Face layout at the timed token counts (the
    lm_head sees one token per sequence: the prefill keeps the last token's logits only)."""
    d = MODELS[name]
    h, hd = d["hidden_size"], d["head_dim"]
    q, kv = d["num_attention_heads"] * hd, d["num_key_value_heads"] * hd
    layer = {(q, h), (kv, h), (h, q), (d["intermediate_size"], h), (h, d["intermediate_size"])}
    shapes = {(m, n, k) for m in BATCHES + (PREFILL,) for n, k in layer}
    shapes |= {(m, d["vocab_size"], h) for m in BATCHES + (1,)}
    return sorted(shapes)


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


def tune_missing(names: list[str], out_dir: Path) -> None:
    """Tune the shapes with no exact row in the tables in force into $OUT/e2e_tuned.csv, and
    make it an overlay of the bf16 table for this run."""
    from gemmtune.families.bf16.op import DISPATCH
    from gemmtune.tables.lookup import Rule

    tuned = out_dir / "e2e_tuned.csv"
    if tuned.exists():  # an earlier run's, in force before looking for what is missing
        os.environ["GEMMTUNE_CONFIG_BF16"] = str(tuned)
        gemmtune.reset()
    missing = []
    for name in names:
        for m, n, k in gemm_shapes(name):
            key = (m, n, k, False, "torch.bfloat16", "torch.bfloat16", False, False)
            if DISPATCH.decide(key).rule is not Rule.exact:
                missing.append((m, n, k))
    if missing:
        untuned = out_dir / "e2e_untuned.csv"
        untuned.write_text("M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle\n" + "".join(
            f"{m},{n},{k},False,torch.bfloat16,torch.bfloat16,False,False\n"
            for m, n, k in sorted(set(missing))))
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", "gemmtune.cli", "tune", "bf16", "-i",
                              str(untuned), "-o", str(tuned), "--mp", "8"])
        print(f"tuned {len(set(missing))} shapes in {time.perf_counter() - start:.0f} s "
              f"(rc {rc})")
    if tuned.exists():
        os.environ["GEMMTUNE_CONFIG_BF16"] = str(tuned)
        gemmtune.reset()


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


class _SameLinear(nn.Linear):
    """nn.Linear under another class, its forward the same: the A/A control, which shows how
    far two identical models' eager times differ in this run."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class _TorchRowLinear(nn.Linear):
    """The op with the torch row forced (``--diagnose``): the op's own host cost in the model,
    with the same cuBLAS kernels as unpatched."""

    def forward(self, x):
        return gemm_a16w16(x, self.weight, self.bias, kernel=TORCH_LINEAR)


class _ParamsDictLinear(nn.Linear):
    """``--diagnose``: F.linear with the parameters read from the module's dict (not through
    nn.Module.__getattr__), as TunedLinear reads them."""

    def forward(self, x):
        params = self._parameters
        return F.linear(x, params["weight"], params["bias"])


class _SwitchesLinear(nn.Linear):
    """``--diagnose``: the above after TunedLinear's four switches (compile, grad, autocast)."""

    def forward(self, x):
        if (tuned_nn._dynamo_compiling() or tuned_nn._compiler._is_compiling_flag
                or tuned_nn._grad_enabled() or tuned_nn._any_autocast()):
            raise RuntimeError("the diagnostic runs plain eager calls only")
        params = self._parameters
        return F.linear(x, params["weight"], params["bias"])


class _KeyedLinear(nn.Linear):
    """``--diagnose``: the above and a look-up of ``key(x)`` in a dict of the layer's, which
    holds F.linear: TunedLinear's path for a torch row (``key``: its input's shape, dtype and
    device) without its generation and identity checks."""

    @staticmethod
    def key(x):
        return x.shape, x.dtype, x.get_device()

    def forward(self, x):
        if (tuned_nn._dynamo_compiling() or tuned_nn._compiler._is_compiling_flag
                or tuned_nn._grad_enabled() or tuned_nn._any_autocast()):
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
    """``--diagnose``: the look-up by the input's shape alone."""

    @staticmethod
    def key(x):
        return x.shape


class _NumelKeyedLinear(_KeyedLinear):
    """``--diagnose``: the look-up by the input's element count alone."""

    @staticmethod
    def key(x):
        return x.numel()


# ``--diagnose``: variants that take the patched layer's path apart, on torch's own kernels.
DIAGNOSTICS = {"op, torch rows": _TorchRowLinear, "params dict": _ParamsDictLinear,
               "+ switches": _SwitchesLinear, "+ layer key": _KeyedLinear,
               "+ shape key": _ShapeKeyedLinear, "+ numel key": _NumelKeyedLinear}


def variant(name: str, model, linear_class):
    """The model built again (the same seed: the same weights, checked), its plain linear
    layers made ``linear_class`` (``TunedLinear`` through ``patch_linear``; ``nn.Linear``
    leaves them). Every timed variant is built this way and is its own object, so timing one
    switches no class of another's, and none is the model the checks converted."""
    other = build(name)
    if not all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters())):
        raise RuntimeError(f"{name}: a second build has other weights")
    if linear_class is TunedLinear:
        gemmtune.patch_linear(other)
    elif linear_class is not nn.Linear:
        for module in other.modules():
            if type(module) is nn.Linear:
                module.__class__ = linear_class
    return other


class DecodePoint:
    """One decode step of ``batch`` sequences against a static cache holding CONTEXT tokens
    (the cache is the point's: every variant's step reads and advances it the same way)."""

    def __init__(self, model, batch: int):
        from transformers import StaticCache

        # Each step (eager or a graph's replay) advances the cache's counters by one.
        self.cache = StaticCache(config=model.config,
                                 max_cache_len=CONTEXT + GRAPH_REPLAYS + 8)
        gen = torch.Generator(device="cuda").manual_seed(batch)
        vocab = model.config.vocab_size
        prompt = torch.randint(0, vocab, (batch, CONTEXT), device="cuda", generator=gen)
        self.ids = torch.randint(0, vocab, (batch, 1), device="cuda", generator=gen)
        self.position = torch.full((batch, 1), CONTEXT, device="cuda")
        self.cache_position = torch.tensor([CONTEXT], device="cuda")
        with torch.no_grad():
            model(prompt, past_key_values=self.cache, use_cache=True,
                  cache_position=torch.arange(CONTEXT, device="cuda"), logits_to_keep=1)

    def rewind(self) -> None:
        """Back to CONTEXT tokens in the cache (each step advances the layers' counters)."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(CONTEXT)

    def step(self, model) -> torch.Tensor:
        return model(self.ids, past_key_values=self.cache, use_cache=True,
                     position_ids=self.position, cache_position=self.cache_position,
                     logits_to_keep=1).logits


class PrefillPoint:
    def __init__(self, model):
        gen = torch.Generator(device="cuda").manual_seed(PREFILL)
        self.ids = torch.randint(0, model.config.vocab_size, (1, PREFILL), device="cuda",
                                 generator=gen)

    def rewind(self) -> None:
        pass

    def step(self, model) -> torch.Tensor:
        return model(self.ids, use_cache=False, logits_to_keep=1).logits


def ms_per_call(point, fn, calls: int) -> float:
    """Wall ms per call of ``calls`` back-to-back ``fn()`` from the point's start, synchronised."""
    point.rewind()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e3


def capture(point, model):
    """The point's step as a CUDA graph (warmed up on a side stream first) and its output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            point.rewind()
            point.step(model)
    torch.cuda.current_stream().wait_stream(side)
    point.rewind()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = point.step(model)
    return graph, out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def check_prefill_accuracy(name: str, model, patched, prefill) -> tuple[float, float]:
    """The prefill's logits, unpatched and patched, against the model in fp32 (bf16 -> fp32 ->
    bf16 is exact: the same weights after)."""
    bf16_logits = prefill.step(model).clone()
    patched_logits = prefill.step(patched).clone()
    model.float()
    fp32_logits = prefill.step(model).clone()
    model.to(torch.bfloat16)
    base_err, patched_err = (rel_err(bf16_logits, fp32_logits),
                             rel_err(patched_logits, fp32_logits))
    if patched_err > 1.5 * base_err + 1e-3:
        raise RuntimeError(f"{name} prefill: patched logits off fp32 by {patched_err:.2e}, "
                           f"unpatched by {base_err:.2e}")
    return base_err, patched_err


def time_point(point, variants: dict, graphs: dict) -> dict:
    """Each variant's eager step (one, synchronised: generate's loop waits for every token)
    in EAGER_ROUNDS rounds, and its graph's GRAPH_REPLAYS replays in ROUNDS rounds, the
    variants in an order rotated each round; each variant's speed-up is the median over the
    rounds of the round's unpatched time over the variant's (the host's speed drifts by 10%
    between seconds: the shorter the round, the less it moves within one)."""
    names = list(variants)
    times = {(kind, v): [] for v in names for kind in ("eager", "graph")}
    ratios = {(kind, v): [] for v in names for kind in ("eager", "graph")}
    for kind, rounds in (("eager", EAGER_ROUNDS), ("graph", ROUNDS)):
        for i in range(rounds):
            shift = i % len(names)
            for v in names[shift:] + names[:shift]:
                if kind == "eager":
                    ms = ms_per_call(point, lambda: point.step(variants[v]), 1)
                elif v in graphs:
                    ms = ms_per_call(point, graphs[v].replay, GRAPH_REPLAYS)
                else:
                    continue
                times[kind, v].append(ms)
            for v in names:
                if times[kind, v]:
                    ratios[kind, v].append(times[kind, "unpatched"][-1] / times[kind, v][-1])
    return {key: (statistics.median(times[key]), statistics.median(r))
            for key, r in ratios.items() if r}


@torch.no_grad()
def run_model(name: str, diagnose: bool) -> list[dict]:
    model = build(name)
    variants = {"unpatched": variant(name, model, nn.Linear),
                "A/A": variant(name, model, _SameLinear),
                "patched": variant(name, model, TunedLinear)}
    if diagnose:
        variants.update((label, variant(name, model, cls)) for label, cls in DIAGNOSTICS.items())
    prefill = PrefillPoint(model)
    base_err, patched_err = check_prefill_accuracy(name, model, variants["patched"], prefill)
    decode_bound = max(3 * base_err, 1e-2)
    points = [(f"decode b={b}", DecodePoint(model, b)) for b in BATCHES]
    points.append((f"prefill {PREFILL}", prefill))
    rows = []
    for label, point in points:
        logits, graphs = {}, {}
        for v in ("unpatched", "patched"):
            point.rewind()
            logits[v] = point.step(variants[v]).clone()
            graphs[v] = capture(point, variants[v])[0]
        err = rel_err(logits["patched"], logits["unpatched"])
        if label.startswith("decode") and err > decode_bound:
            raise RuntimeError(f"{name} {label}: patched logits off by {err:.2e} "
                               f"(bound {decode_bound:.2e})")
        timed = time_point(point, variants, graphs)
        row = dict(model=name, point=label,
                   eager_ms=round(timed["eager", "unpatched"][0], 4),
                   eager_patched_ms=round(timed["eager", "patched"][0], 4),
                   eager_speedup=round(timed["eager", "patched"][1], 3),
                   graph_ms=round(timed["graph", "unpatched"][0], 4),
                   graph_patched_ms=round(timed["graph", "patched"][0], 4),
                   graph_speedup=round(timed["graph", "patched"][1], 3),
                   eager_aa=round(timed["eager", "A/A"][1], 3),
                   logits_rel_err=f"{err:.1e}")
        if diagnose:
            row.update((f"eager {label}", round(timed["eager", label][1], 3))
                       for label in DIAGNOSTICS)
        rows.append(row)
        del graphs
    print(f"{name}: prefill logits vs fp32: unpatched {base_err:.2e}, patched {patched_err:.2e}")
    del model, variants
    torch.cuda.empty_cache()
    return rows


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
    with open(out_dir / "e2e_layers.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
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
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--no-tune", action="store_true",
                        help="use the tables in force as they are")
    parser.add_argument("--diagnose", action="store_true",
                        help="also time the op with its torch row forced")
    parser.add_argument("--layers", action="store_true",
                        help="only the host cost to issue each linear shape, patched and not")
    parser.add_argument("--one-kernel", metavar="KERNEL",
                        help="patched with KERNEL for every shape (a table of it alone, "
                             "nothing tuned): one backend's cost in the model")
    parser.add_argument("--without", metavar="PREFIX",
                        help="the kernels the tables give, but torch's where a kernel's name "
                             "starts with PREFIX (after tuning)")
    parser.add_argument("--trace", action="store_true",
                        help="only a torch.profiler trace of eager decode steps at b=1")
    parser.add_argument("--profile", action="store_true",
                        help="only a cProfile of eager steps, patched and not")
    args = parser.parse_args()
    names = args.models.split(",")
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.one_kernel:
        one_kernel_table(names, args.one_kernel, out_dir)
    elif not args.no_tune:
        tune_missing(names, out_dir)
    if args.without:
        without_backend_table(names, args.without, out_dir)
    if args.trace:
        for name in names:
            trace_steps(name, out_dir)
        return
    if args.profile:
        for name in names:
            profile_steps(name, out_dir)
        return
    if args.layers:
        report_layer_costs(names, out_dir)
        return
    rows = [row for name in names for row in run_model(name, args.diagnose)]
    with open(out_dir / "e2e_hf.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"{torch.cuda.get_device_name()}, {LAYERS} layers, speed-up = unpatched / patched")
    print(f"{'model':<16} {'point':<14} {'eager ms':>9} {'patched':>9} {'x':>6} "
          f"{'graph ms':>9} {'patched':>9} {'x':>6} {'A/A':>6}  logits err")
    for r in rows:
        print(f"{r['model']:<16} {r['point']:<14} {r['eager_ms']:>9.3f} "
              f"{r['eager_patched_ms']:>9.3f} {r['eager_speedup']:>6.3f} {r['graph_ms']:>9.3f} "
              f"{r['graph_patched_ms']:>9.3f} {r['graph_speedup']:>6.3f} {r['eager_aa']:>6.3f}  "
              f"{r['logits_rel_err']}")
    if args.diagnose:
        print("eager speed-up of variants on torch's kernels: " + ", ".join(DIAGNOSTICS))
        for r in rows:
            print(f"{r['model']:<16} {r['point']:<14} " + " ".join(
                f"{r[f'eager {label}']:>6.3f}" for label in DIAGNOSTICS))


if __name__ == "__main__":
    main()
