"""From a model's ``config.json`` (or a bundled preset) to the GEMM and fused-MoE shapes it runs.

Every linear layer is ``y = x @ W.T`` with ``x`` of shape (M, K) and ``W`` of shape (N, K):
M = tokens, N = out_features, K = in_features. Shapes are per tensor-parallel rank, sharded the
way vLLM and SGLang shard them: column-parallel layers (qkv, gate_up, q_b, kv_b, lm_head) split N,
row-parallel layers (o, down) split K, MLA's low-rank down-projections (q_a, kv_a) are replicated,
and TP splits each expert's FFN width (``inter_dim``) while every rank keeps every expert.

Only ``config.json`` is read; nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterable, Sequence

from gemmtune.families import all_families
from gemmtune.families.fmoe.op import FmoeKey
from gemmtune.families.fmoe.quantised import SCALINGS
from gemmtune.tables.store import Row
from gemmtune.tables.values import ActivationType, QuantType

__all__ = [
    "DEFAULT_M",
    "MlaDims",
    "ModelConfigError",
    "ModelSpec",
    "MoeShape",
    "PRESETS",
    "Projection",
    "TensorParallelError",
    "dense_projections",
    "load_model_dir",
    "load_preset",
    "moe_shapes",
    "preset_moe_shape",
    "untuned_rows",
    "valid_tp",
]

PRESETS: tuple[str, ...] = (
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "qwen3-32b",
    "mixtral-8x7b",
    "deepseek-v3",
    "qwen3-30b-a3b",
)

# Decode (1..256) and prefill (512..8192) token counts; the look-up pads other M to these buckets.
DEFAULT_M: tuple[int, ...] = (1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


_BF16 = "torch.bfloat16"
_FP8 = "torch.float8_e4m3fn"


class ModelConfigError(ValueError):
    """A config.json (or preset) that lacks a field gemmtune needs, or names an unknown preset."""


class TensorParallelError(ValueError):
    """A tensor-parallel degree that does not divide what each rank must hold a whole share of."""


# ---------------------------------------------------------------------------------------------
# The model, normalised across the Llama / Qwen / Mixtral / DeepSeek spellings of config.json
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MlaDims:
    """Multi-head latent attention (DeepSeek-V2/V3) projection widths."""

    q_lora_rank: int | None  # None: q is projected straight from hidden (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelSpec:
    """What the GEMM shapes of a decoder LLM depend on, whatever its config spelled them as.

    ``dense_intermediate_size`` is the width of the dense SwiGLU MLP, or None when no layer has one
    (Mixtral, Qwen3-MoE). ``moe_intermediate_size`` is one routed expert's width (Mixtral spells it
    ``intermediate_size``). ``shared_expert_intermediate_size`` is all shared experts together
    (DeepSeek: ``n_shared_experts * moe_intermediate_size``), 0 when there are none.
    """

    name: str
    source: str  # the file it was read from, for messages
    model_type: str
    architectures: tuple[str, ...]
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # MLA: the q/k head width, qk_nope_head_dim + qk_rope_head_dim
    vocab_size: int
    dense_intermediate_size: int | None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0
    num_hidden_layers: int | None = None
    mla: MlaDims | None = None
    qkv_bias: bool = False  # the q/k/v projections add a bias (Qwen2, attention_bias)
    o_bias: bool = False  # the output projection adds one (attention_bias)
    mlp_bias: bool = False  # the MLP's gate/up and down projections add one (mlp_bias)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_config(cls, cfg: dict, name: str, source: str | None = None) -> "ModelSpec":
        """Parse a Hugging Face ``config.json`` dict; ``source`` (default ``name``) names the file."""
        src = source or name
        if not isinstance(cfg, dict):
            raise ModelConfigError(f"{src}: expected a JSON object, got {type(cfg).__name__}")
        cfg = _language_model_fields(cfg, src)
        fields = _Fields(cfg, src)
        model_type = str(cfg.get("model_type", ""))
        architectures = tuple(str(a) for a in cfg.get("architectures") or ())
        biases = _biases(cfg, model_type, src)

        hidden = fields.required("hidden_size")
        heads = fields.required("num_attention_heads")
        kv_heads = fields.optional("num_key_value_heads") or heads  # absent: multi-head attention
        vocab = fields.required("vocab_size")

        mla = None
        if cfg.get("kv_lora_rank") is not None:
            mla = MlaDims(
                q_lora_rank=fields.optional("q_lora_rank"),
                kv_lora_rank=fields.required("kv_lora_rank"),
                qk_nope_head_dim=fields.required("qk_nope_head_dim"),
                qk_rope_head_dim=fields.required("qk_rope_head_dim"),
                v_head_dim=fields.required("v_head_dim"),
            )
            head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        else:
            head_dim = fields.optional("head_dim") or 0
            if not head_dim:
                if hidden % heads:
                    raise ModelConfigError(
                        f"{src}: no 'head_dim' and hidden_size={hidden} is not a multiple of "
                        f"num_attention_heads={heads}; add 'head_dim' to the config"
                    )
                head_dim = hidden // heads

        # Routed experts: Mixtral says num_local_experts, Qwen-MoE num_experts, DeepSeek n_routed_experts.
        num_experts = 0
        for key in ("num_local_experts", "num_experts", "n_routed_experts"):
            num_experts = fields.optional(key) or 0
            if num_experts:
                break

        if not num_experts:
            return cls(
                name=name, source=src, model_type=model_type, architectures=architectures,
                hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                head_dim=head_dim, vocab_size=vocab,
                dense_intermediate_size=fields.required("intermediate_size", "the dense MLP width"),
                num_hidden_layers=fields.optional("num_hidden_layers"), mla=mla, **biases,
            )

        topk = fields.required("num_experts_per_tok", "experts per token of an MoE model")
        # Mixtral has no moe_intermediate_size: its experts are intermediate_size wide.
        if cfg.get("moe_intermediate_size") is not None:
            expert_width = fields.required("moe_intermediate_size")
        else:
            expert_width = fields.required("intermediate_size", "the expert width of an MoE model")

        # Dense MLP layers in an MoE model: DeepSeek's first_k_dense_replace, Qwen-MoE's
        # mlp_only_layers / decoder_sparse_step > 1. They are intermediate_size wide.
        has_dense = (
            (fields.optional("first_k_dense_replace") or 0) > 0
            or bool(cfg.get("mlp_only_layers"))
            or (fields.optional("decoder_sparse_step") or 1) > 1
        )
        dense_width = (
            fields.required("intermediate_size", "the width of the dense MLP layers") if has_dense else None
        )

        shared = (fields.optional("n_shared_experts") or 0) * expert_width
        if not shared:
            shared = fields.optional("shared_expert_intermediate_size") or 0  # Qwen2-MoE

        return cls(
            name=name, source=src, model_type=model_type, architectures=architectures,
            hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
            head_dim=head_dim, vocab_size=vocab, dense_intermediate_size=dense_width,
            num_experts=num_experts, num_experts_per_tok=topk, moe_intermediate_size=expert_width,
            shared_expert_intermediate_size=shared,
            num_hidden_layers=fields.optional("num_hidden_layers"), mla=mla, **biases,
        )


# Families whose q/k/v projections always add a bias, with no config field saying so.
_QKV_BIAS_MODEL_TYPES = {"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"}


def _biases(cfg: dict, model_type: str, src: str) -> dict[str, bool]:
    """Which projections add a bias, as transformers builds them: ``attention_bias`` for q/k/v
    and o (Llama, Qwen3, DeepSeek), Qwen2's built-in q/k/v bias, ``mlp_bias`` for the MLP."""
    flags = {}
    for key in ("attention_bias", "mlp_bias"):
        value = cfg.get(key) or False  # absent or null: no bias
        if not isinstance(value, bool):
            raise ModelConfigError(f"{src}: field {key!r} must be true or false, got {value!r}")
        flags[key] = value
    return {"qkv_bias": flags["attention_bias"] or model_type in _QKV_BIAS_MODEL_TYPES,
            "o_bias": flags["attention_bias"], "mlp_bias": flags["mlp_bias"]}


def _language_model_fields(cfg: dict, src: str) -> dict:
    """The fields the GEMM shapes come from. Multimodal configs (Gemma-3, Llama-4, some
    Qwen-VL) keep their language model's under ``text_config``; those override the top level,
    which keeps ``architectures`` and ``model_type`` for what the text config lacks."""
    text = cfg.get("text_config")
    if text is None:
        return cfg
    if not isinstance(text, dict):
        raise ModelConfigError(f"{src}: 'text_config' must be an object, got {type(text).__name__}")
    return {**cfg, **{k: v for k, v in text.items() if v is not None}}


class _Fields:
    """Typed reads of config.json fields whose errors name the field and the file."""

    def __init__(self, cfg: dict, source: str) -> None:
        self._cfg = cfg
        self._source = source

    def required(self, key: str, what: str = "") -> int:
        value = self.optional(key)
        if value is None:
            need = f" ({what})" if what else ""
            raise ModelConfigError(
                f"{self._source}: required field {key!r}{need} is missing or null (also under "
                f"'text_config'). Point at the model's Hugging Face config.json, or add {key!r} "
                f"to it."
            )
        return value

    def optional(self, key: str) -> int | None:
        value = self._cfg.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ModelConfigError(
                f"{self._source}: field {key!r} must be a non-negative integer, got {value!r}"
            )
        return value


def load_preset(name: str) -> ModelSpec:
    """The bundled preset ``name`` (one of ``PRESETS``)."""
    if name not in PRESETS:
        raise ModelConfigError(f"unknown model preset {name!r}; expected one of: {', '.join(PRESETS)}")
    resource = resources.files("gemmtune.models").joinpath("presets", f"{name}.json")
    return ModelSpec.from_config(json.loads(resource.read_text()), name, source=f"preset {name}.json")


def load_model_dir(path: str | Path) -> ModelSpec:
    """Read ``path/config.json`` (``path`` may also be the config file itself); named after the folder."""
    path = Path(path).expanduser()
    config_file = path if path.is_file() else path / "config.json"
    if not config_file.is_file():
        raise ModelConfigError(
            f"{config_file}: no such file; --model_dir must be a folder holding the model's "
            f"Hugging Face config.json (or use a preset: {', '.join(PRESETS)})"
        )
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{config_file}: not valid JSON ({exc})") from exc
    return ModelSpec.from_config(cfg, config_file.parent.name, source=str(config_file))


# ---------------------------------------------------------------------------------------------
# Tensor parallelism
# ---------------------------------------------------------------------------------------------


def _tp_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why ``tp`` cannot shard ``spec`` evenly, or None when it can."""
    if tp < 1:
        return f"tp must be >= 1, got {tp}"
    needs = [("num_attention_heads", spec.num_attention_heads)]
    if spec.dense_intermediate_size is not None:
        needs.append(("intermediate_size", spec.dense_intermediate_size))
    if spec.moe_intermediate_size is not None:
        needs.append(("moe_intermediate_size", spec.moe_intermediate_size))
    if spec.shared_expert_intermediate_size:
        needs.append(("shared expert width", spec.shared_expert_intermediate_size))
    for what, value in needs:
        if value % tp:
            return f"tp={tp} does not divide {what}={value}"
    kv = spec.num_key_value_heads
    # KV heads split across ranks when there are at least tp of them, else each is replicated
    # on tp/kv ranks; either way the split has to be even.
    if spec.mla is None and kv % tp and tp % kv:
        return f"tp={tp} neither divides num_key_value_heads={kv} nor is a multiple of it"
    return None


def valid_tp(spec: ModelSpec, limit: int = 64) -> tuple[int, ...]:
    """Every tensor-parallel degree up to ``limit`` that shards ``spec`` evenly."""
    return tuple(tp for tp in range(1, limit + 1) if _tp_problem(spec, tp) is None)


def _check_tp(spec: ModelSpec, tp: int) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise TensorParallelError(f"tp must be an integer, got {tp!r}")
    problem = _tp_problem(spec, tp)
    if problem is not None:
        choices = ", ".join(str(t) for t in valid_tp(spec))
        raise TensorParallelError(f"{spec.name}: {problem}; valid tp for this model: {choices}")


# ---------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Projection:
    """One linear layer per TP rank: y (M, N) = x (M, K) @ W.T (+ bias), W (N, K)."""

    name: str
    N: int
    K: int
    bias: bool = False


@dataclass(frozen=True)
class MoeShape:
    """One fused-MoE layer per TP rank: every expert, each ``inter_dim`` wide on this rank."""

    model_dim: int
    inter_dim: int
    expert: int
    topk: int


def _attention(spec: ModelSpec, tp: int) -> list[Projection]:
    hidden, heads = spec.hidden_size, spec.num_attention_heads
    if spec.mla is None:
        kv_per_rank = max(1, spec.num_key_value_heads // tp)
        return [
            Projection("qkv", (heads // tp + 2 * kv_per_rank) * spec.head_dim, hidden,
                       spec.qkv_bias),
            Projection("o", hidden, heads * spec.head_dim // tp, spec.o_bias),
        ]
    mla = spec.mla
    qk_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    if mla.q_lora_rank is None:
        q = [Projection("q", heads * qk_head // tp, hidden)]
    else:
        q = [Projection("q_a", mla.q_lora_rank, hidden)]  # replicated
    kv_a = Projection("kv_a", mla.kv_lora_rank + mla.qk_rope_head_dim, hidden)  # replicated
    q_b = [] if mla.q_lora_rank is None else [Projection("q_b", heads * qk_head // tp, mla.q_lora_rank)]
    return q + [kv_a] + q_b + [
        Projection("kv_b", heads * (mla.qk_nope_head_dim + mla.v_head_dim) // tp, mla.kv_lora_rank),
        Projection("o", hidden, heads * mla.v_head_dim // tp),
    ]


def _mlp(prefix: str, hidden: int, width: int, tp: int, bias: bool = False) -> list[Projection]:
    return [
        Projection(f"{prefix}gate_up", 2 * width // tp, hidden, bias),  # fused, column-parallel
        Projection(f"{prefix}down", hidden, width // tp, bias),  # row-parallel
    ]


def dense_projections(spec: ModelSpec, tp: int = 1) -> list[Projection]:
    """The distinct (N, K, bias) linear layers of ``spec`` per TP rank, in layer order; first name
    wins."""
    _check_tp(spec, tp)
    hidden = spec.hidden_size
    layers = _attention(spec, tp)
    if spec.dense_intermediate_size is not None:
        layers += _mlp("", hidden, spec.dense_intermediate_size, tp, spec.mlp_bias)
    if spec.shared_expert_intermediate_size:
        layers += _mlp("shared_", hidden, spec.shared_expert_intermediate_size, tp)
    if spec.is_moe:
        # The router scores every token against every expert on every rank: replicated.
        layers.append(Projection("router", spec.num_experts, hidden))
    # Engines pad the vocabulary so every rank holds the same number of rows.
    layers.append(Projection("lm_head", -(-spec.vocab_size // tp), hidden))
    seen: set[tuple[int, int, bool]] = set()
    distinct = []
    for proj in layers:
        if (proj.N, proj.K, proj.bias) not in seen:
            seen.add((proj.N, proj.K, proj.bias))
            distinct.append(proj)
    return distinct


def moe_shapes(spec: ModelSpec, tp: int = 1, ep: int = 1) -> list[MoeShape]:
    """The fused-MoE layer shapes of ``spec`` per rank; empty for a dense model. Tensor
    parallelism splits every expert's ``inter_dim`` over ``tp`` ranks; expert parallelism
    (``ep`` > 1) instead gives each of ``ep`` ranks whole experts, ``num_experts / ep`` of them
    (``fused_moe``'s ``expert_mask``)."""
    _check_tp(spec, tp)
    if not spec.is_moe or spec.moe_intermediate_size is None:
        return []
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise TensorParallelError(f"ep must be a positive integer, got {ep!r}")
    if ep > 1:
        if spec.num_experts % ep:
            raise TensorParallelError(f"{spec.name}: {spec.num_experts} experts do not split "
                                      f"over ep={ep} ranks")
        return [MoeShape(spec.hidden_size, spec.moe_intermediate_size, spec.num_experts // ep,
                         spec.num_experts_per_tok)]
    inter_dim = spec.moe_intermediate_size // tp
    return [MoeShape(spec.hidden_size, inter_dim, spec.num_experts, spec.num_experts_per_tok)]


def preset_moe_shape(name: str, tp: int = 1) -> tuple[MoeShape, str]:
    """The fused-MoE shape of preset ``name`` per TP rank, and the label results are filed under
    (``name``, or ``name-tpN`` for a shard)."""
    shapes = moe_shapes(load_preset(name), tp)
    if not shapes:
        raise ModelConfigError(f"preset {name!r} has no MoE layers; expected one of the MoE "
                               f"presets")
    return shapes[0], name if tp == 1 else f"{name}-tp{tp}"


def _m_values(m_values: Iterable[int]) -> list[int]:
    given = list(m_values)
    bad = [m for m in given if isinstance(m, bool) or not isinstance(m, int) or m < 1]
    if bad or not given:
        raise ValueError(f"token counts (M) must be positive integers, got {given!r}")
    return sorted(set(given))


def _with_other_layouts(family, key: tuple) -> tuple[tuple, ...]:
    return (key,) + (family.other_layouts(key) if family.other_layouts else ())


def untuned_rows(
    spec: ModelSpec, tp: int = 1, m_values: Sequence[int] = DEFAULT_M,
    fmoe_q_type: QuantType = QuantType.No, ep: int = 1,
) -> dict[str, list[Row]]:
    """Untuned-table rows per family name: the model's dense GEMMs for every family with a GEMM
    key, in its default dtype (bf16; FP8 weights for the a8w8 families; only the weight shapes
    a family takes: ``Family.why_not_gemm``; each followed by its twins in the family's other
    weight layouts, ``Family.other_layouts``: a16w4's packed MXFP4), and fmoe for
    MoE models (bf16 experts, or FP8 ones quantised by ``fmoe_q_type``; per EP rank with ``ep``).

    Rows are ordered by (N, K, bias) then M (fmoe: by shape, then token) and hold no duplicates.
    """
    ms = _m_values(m_values)
    gemms = sorted({(p.N, p.K, p.bias) for p in dense_projections(spec, tp)})
    rows: dict[str, list[Row]] = {}
    for family in all_families():
        if family.gemm_key is None or not family.bench_dtypes:
            continue
        # A family whose key has no bias column gives one key for both: keep it once.
        dtype = family.bench_dtypes[0]
        keys = (key for n, k, bias in gemms if family.refuses_gemm(n, k, dtype) is None
                for m in ms
                for key in _with_other_layouts(family, family.gemm_key(m, n, k, dtype,
                                                                       bias=bias)))
        rows[family.name] = [Row("", 0, key) for key in dict.fromkeys(keys)]
    moe = sorted({(s.model_dim, s.inter_dim, s.expert, s.topk) for s in moe_shapes(spec, tp, ep)})
    if fmoe_q_type is not QuantType.No and fmoe_q_type not in SCALINGS:
        raise ValueError(f"fmoe experts are bf16 (QuantType.No) or FP8: "
                         f"{', '.join(q.canonical for q in SCALINGS)}; not "
                         f"{fmoe_q_type.canonical}")
    if moe:
        q_dtype = _BF16 if fmoe_q_type is QuantType.No else _FP8
        rows["fmoe"] = [
            Row("", 0, FmoeKey(m, model_dim, inter_dim, expert, topk,
                               ActivationType.Silu.canonical, _BF16, q_dtype, q_dtype,
                               fmoe_q_type.canonical, True, False))
            for model_dim, inter_dim, expert, topk in moe
            for m in ms
        ]
    return rows
