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
class: the eager noise floor of the run). benchmarks/e2e_hf_diag.py takes the eager step
apart:

- decode, one token per sequence against a static KV cache of ``CONTEXT`` tokens, at batch
  1, 8 and 32: eagerly (one step, synchronised) and as a captured CUDA graph;
- a ``PREFILL``-token prefill (logits of the last token), eagerly and as a CUDA graph.

Logits: the prefill's of both against the model in fp32, the patched error within 1.5x the
unpatched one (+1e-3); each decode point's patched logits against the unpatched ones, within 3x
the prefill's unpatched error (at least 1e-2). Prints speed-up = unpatched time / patched time,
the median over the rounds (``EAGER_ROUNDS`` of one eager step, ``ROUNDS`` of graph replays)
of each round's ratio (the variants in an order rotated each round).

    PYTHONPATH=src python3 benchmarks/e2e_hf.py [--no-tune] [--models llama3-8b]
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
from gemmtune.nn import TunedLinear

LAYERS = 4
BATCHES = (1, 8, 32)
PREFILL = 512
CONTEXT = 128  # tokens in the KV cache when a decode step runs
ROUNDS = 31  # of graph replays
EAGER_ROUNDS = 241  # of one eager step
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


def use_overlay(variable: str, tuned: Path) -> None:
    """``tuned`` (if written) as an overlay of a family's table (``variable``) for this run."""
    if tuned.exists():
        os.environ[variable] = str(tuned)
        gemmtune.reset()


def tune_into_overlay(family: str, variable: str, header: str, lines: list[str], tuned: Path,
                      *extra: str) -> None:
    """The untuned rows ``lines`` (under ``header``) tuned into ``tuned`` (``gemmtune tune
    FAMILY``, ``extra`` flags), made an overlay of the family's table for this run."""
    if lines:
        untuned = tuned.with_name(tuned.stem.replace("tuned", "untuned") + ".csv")
        untuned.write_text(header + "".join(lines))
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", "gemmtune.cli", "tune", family, "-i",
                              str(untuned), "-o", str(tuned), "--mp", "8", *extra])
        print(f"tuned {len(lines)} {family} rows in {time.perf_counter() - start:.0f} s "
              f"(rc {rc})")
    use_overlay(variable, tuned)


def tuned_here(dispatch, key) -> bool:
    """Whether the tables in force have an exact row for ``key`` measured on this GPU model (a
    similar GPU's row would serve the call, but its kernel was not timed here)."""
    from gemmtune.tables.lookup import Rule

    decision = dispatch.decide(key)
    return decision.rule is Rule.exact and decision.row.gpu == gemmtune.current_device().gpu


def tune_missing(names: list[str], out_dir: Path) -> None:
    """Tune the shapes with no exact row of this GPU model in the tables in force into
    $OUT/e2e_tuned.csv, and make it an overlay of the bf16 table for this run."""
    from gemmtune.families.bf16.op import DISPATCH

    tuned = out_dir / "e2e_tuned.csv"
    use_overlay("GEMMTUNE_CONFIG_BF16", tuned)  # an earlier run's, before looking for gaps
    missing = set()
    for name in names:
        for m, n, k in gemm_shapes(name):
            key = (m, n, k, False, "torch.bfloat16", "torch.bfloat16", False, False)
            if not tuned_here(DISPATCH, key):
                missing.add((m, n, k))
    tune_into_overlay("bf16", "GEMMTUNE_CONFIG_BF16",
                      "M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle\n",
                      [f"{m},{n},{k},False,torch.bfloat16,torch.bfloat16,False,False\n"
                       for m, n, k in sorted(missing)], tuned)


class _SameLinear(nn.Linear):
    """nn.Linear under another class, its forward the same: the A/A control, which shows how
    far two identical models' eager times differ in this run."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


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


def graph_of(run, reset=lambda: None):
    """``run()`` as a CUDA graph (run twice on a side stream first, ``reset()`` before each run
    and before the capture, outside it) and its output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            reset()
            run()
    torch.cuda.current_stream().wait_stream(side)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def capture(point, model):
    """The point's step as a CUDA graph (warmed up on a side stream first) and its output."""
    return graph_of(lambda: point.step(model), point.rewind)


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


def time_point(point, variants: dict, graphs: dict, base: str = "unpatched") -> dict:
    """Each variant's eager step (one, synchronised: generate's loop waits for every token)
    in EAGER_ROUNDS rounds, and its graph's GRAPH_REPLAYS replays in ROUNDS rounds, the
    variants in an order rotated each round; each variant's speed-up is the median over the
    rounds of the round's ``base`` time over the variant's (the host's speed drifts by 10%
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
                    ratios[kind, v].append(times[kind, base][-1] / times[kind, v][-1])
    return {key: (statistics.median(times[key]), statistics.median(r))
            for key, r in ratios.items() if r}


@torch.no_grad()
def run_model(name: str, extra: dict | None = None) -> list[dict]:
    """Every point of one model: its rows (``extra``: more variants, label -> linear class,
    whose eager speed-up each row gets as ``eager LABEL``)."""
    extra = extra or {}
    model = build(name)
    variants = {"unpatched": variant(name, model, nn.Linear),
                "A/A": variant(name, model, _SameLinear),
                "patched": variant(name, model, TunedLinear)}
    variants.update((label, variant(name, model, cls)) for label, cls in extra.items())
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
        row.update((f"eager {label}", round(timed["eager", label][1], 3)) for label in extra)
        rows.append(row)
        del graphs
    print(f"{name}: prefill logits vs fp32: unpatched {base_err:.2e}, patched {patched_err:.2e}")
    del model, variants
    torch.cuda.empty_cache()
    return rows


def write_rows(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def report(rows: list[dict], out_dir: Path, extra_labels=()) -> None:
    """$OUT/e2e_hf.csv and the table (the extra variants' eager speed-ups after it)."""
    write_rows(rows, out_dir / "e2e_hf.csv")
    print(f"{torch.cuda.get_device_name()}, {LAYERS} layers, speed-up = unpatched / patched")
    print(f"{'model':<16} {'point':<14} {'eager ms':>9} {'patched':>9} {'x':>6} "
          f"{'graph ms':>9} {'patched':>9} {'x':>6} {'A/A':>6}  logits err")
    for r in rows:
        print(f"{r['model']:<16} {r['point']:<14} {r['eager_ms']:>9.3f} "
              f"{r['eager_patched_ms']:>9.3f} {r['eager_speedup']:>6.3f} {r['graph_ms']:>9.3f} "
              f"{r['graph_patched_ms']:>9.3f} {r['graph_speedup']:>6.3f} {r['eager_aa']:>6.3f}  "
              f"{r['logits_rel_err']}")
    if extra_labels:
        print("eager speed-up of the other variants: " + ", ".join(extra_labels))
        for r in rows:
            print(f"{r['model']:<16} {r['point']:<14} " + " ".join(
                f"{r[f'eager {label}']:>6.3f}" for label in extra_labels))


def arguments(parser: argparse.ArgumentParser) -> argparse.Namespace:
    """The options of this benchmark (and of e2e_hf_diag.py's, added to ``parser``)."""
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--no-tune", action="store_true",
                        help="use the tables in force as they are")
    args = parser.parse_args()
    args.names = args.models.split(",")
    args.out_dir = Path(os.environ.get("OUT", "out"))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    return args


def main() -> None:
    args = arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    if not args.no_tune:
        tune_missing(args.names, args.out_dir)
    report([row for name in args.names for row in run_model(name)], args.out_dir)


if __name__ == "__main__":
    main()
