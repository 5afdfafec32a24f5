"""config.json / presets -> per-TP-rank GEMM and fused-MoE shapes.

Expected shapes are worked out by hand in the comments (not recomputed with the module's formulas),
so a wrong sharding rule fails here instead of agreeing with itself.
"""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path

import pytest

from gemmtune.models.shapes import (
    DEFAULT_M,
    PRESETS,
    ModelConfigError,
    ModelSpec,
    MoeShape,
    Projection,
    TensorParallelError,
    dense_projections,
    load_model_dir,
    load_preset,
    moe_shapes,
    untuned_rows,
    valid_tp,
)
from gemmtune.families import get_family
from gemmtune.tables.values import QuantType

FIXTURES = Path(__file__).parent / "fixtures"


def nk(projections: list[Projection]) -> dict[str, tuple[int, int]]:
    return {p.name: (p.N, p.K) for p in projections}


# ---------------------------------------------------------------- tiny Llama-like fixture
# hidden 1024, 16 heads, 4 KV heads, no head_dim field -> head_dim 1024/16 = 64,
# intermediate 2816, vocab 32000.


def test_tiny_llama_tp1():
    spec = load_model_dir(FIXTURES / "tiny-llama")
    assert spec.name == "tiny-llama"
    assert spec.head_dim == 64
    assert not spec.is_moe
    assert nk(dense_projections(spec, 1)) == {
        "qkv": (1536, 1024),  # (16 + 2*4) * 64
        "o": (1024, 1024),  # 16*64
        "gate_up": (5632, 1024),  # 2*2816
        "down": (1024, 2816),
        "lm_head": (32000, 1024),
    }
    assert [p.name for p in dense_projections(spec, 1)] == ["qkv", "o", "gate_up", "down", "lm_head"]
    assert moe_shapes(spec, 1) == []


def test_tiny_llama_tp2():
    spec = load_model_dir(FIXTURES / "tiny-llama" / "config.json")  # the file itself works too
    assert nk(dense_projections(spec, 2)) == {
        "qkv": (768, 1024),  # (8 + 2*2) * 64
        "o": (1024, 512),  # 8*64
        "gate_up": (2816, 1024),  # 2*1408
        "down": (1024, 1408),
        "lm_head": (16000, 1024),
    }


def test_tiny_llama_tp8_replicates_kv_heads():
    # 4 KV heads on 8 ranks: each rank keeps one whole KV head -> (16/8 + 2*1) * 64 = 256.
    spec = load_model_dir(FIXTURES / "tiny-llama")
    assert nk(dense_projections(spec, 8)) == {
        "qkv": (256, 1024),
        "o": (1024, 128),  # 2*64
        "gate_up": (704, 1024),  # 2*352
        "down": (1024, 352),
        "lm_head": (4000, 1024),
    }


# ---------------------------------------------------------------- tiny DeepSeek-like MLA + MoE fixture
# hidden 2048, 16 heads, q_lora 768, kv_lora 256, nope 64, rope 32, v 64, dense intermediate 5632
# (first_k_dense_replace 1), 64 routed experts of 704, 2 shared experts, top-6, vocab 102400.


def test_tiny_mla_moe_tp1():
    spec = load_model_dir(FIXTURES / "tiny-mla-moe")
    assert spec.is_moe and spec.mla is not None
    assert nk(dense_projections(spec, 1)) == {
        "q_a": (768, 2048),
        "kv_a": (288, 2048),  # 256 + 32
        "q_b": (1536, 768),  # 16 * (64 + 32)
        "kv_b": (2048, 256),  # 16 * (64 + 64)
        "o": (2048, 1024),  # 16 * 64
        "gate_up": (11264, 2048),  # 2 * 5632
        "down": (2048, 5632),
        "shared_gate_up": (2816, 2048),  # 2 * (2 * 704)
        "shared_down": (2048, 1408),  # 2 * 704
        "router": (64, 2048),  # one score per routed expert, replicated
        "lm_head": (102400, 2048),
    }
    assert moe_shapes(spec, 1) == [MoeShape(model_dim=2048, inter_dim=704, expert=64, topk=6)]


def test_tiny_mla_moe_tp2():
    spec = load_model_dir(FIXTURES / "tiny-mla-moe")
    assert nk(dense_projections(spec, 2)) == {
        "q_a": (768, 2048),  # replicated
        "kv_a": (288, 2048),  # replicated
        "q_b": (768, 768),  # 8 * 96
        "kv_b": (1024, 256),  # 8 * 128
        "o": (2048, 512),  # 8 * 64
        "gate_up": (5632, 2048),
        "down": (2048, 2816),
        "shared_gate_up": (1408, 2048),
        "shared_down": (2048, 704),
        "router": (64, 2048),  # replicated: not divided by tp
        "lm_head": (51200, 2048),
    }
    assert moe_shapes(spec, 2) == [MoeShape(2048, 352, 64, 6)]


def test_mla_without_q_lora_projects_q_from_hidden():
    # DeepSeek-V2-Lite style: q_lora_rank null -> one q projection, N = 16 * (128 + 64) = 3072.
    cfg = {
        "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_attention_heads": 16, "num_key_value_heads": 16,
        "vocab_size": 102400, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    }
    got = nk(dense_projections(ModelSpec.from_config(cfg, "lite"), 1))
    assert got["q"] == (3072, 2048)
    assert got["kv_a"] == (576, 2048)
    assert got["kv_b"] == (4096, 512)  # 16 * (128 + 128)
    assert got["o"] == (2048, 2048)  # 16 * 128
    assert "q_a" not in got and "q_b" not in got


# ---------------------------------------------------------------- presets


def test_preset_list_matches_bundled_files():
    bundled = {
        p.name.removesuffix(".json")
        for p in resources.files("gemmtune.models").joinpath("presets").iterdir()
        if p.name.endswith(".json")
    }
    assert bundled == set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_yields_shapes(name):
    spec = load_preset(name)
    assert spec.name == name
    for tp in (1, 8):
        projections = dense_projections(spec, tp)
        assert projections and all(p.N > 0 and p.K > 0 for p in projections)
        rows = untuned_rows(spec, tp)
        assert rows["bf16"]
        assert ("fmoe" in rows) == spec.is_moe


def test_llama3_70b_tp8():
    got = nk(dense_projections(load_preset("llama3-70b"), 8))
    assert got == {
        "qkv": (1280, 8192),  # (64/8 + 2*1) * 128
        "o": (8192, 1024),  # 64*128/8
        "gate_up": (7168, 8192),  # 2*28672/8
        "down": (8192, 3584),  # 28672/8
        "lm_head": (16032, 8192),  # 128256/8
    }


def test_llama3_8b_tp1():
    assert nk(dense_projections(load_preset("llama3-8b"), 1)) == {
        "qkv": (6144, 4096),  # (32 + 2*8) * 128
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    }


def test_qwen3_32b_head_dim_differs_from_hidden_over_heads():
    # 64 heads * 128 = 8192 != hidden 5120: o's K is 8192, not 5120.
    assert nk(dense_projections(load_preset("qwen3-32b"), 1)) == {
        "qkv": (10240, 5120),  # (64 + 2*8) * 128
        "o": (5120, 8192),
        "gate_up": (51200, 5120),
        "down": (5120, 25600),
        "lm_head": (151936, 5120),
    }


def test_deepseek_v3_tp1():
    spec = load_preset("deepseek-v3")
    assert nk(dense_projections(spec, 1)) == {
        "q_a": (1536, 7168),
        "kv_a": (576, 7168),  # 512 + 64
        "q_b": (24576, 1536),  # 128 * (128 + 64)
        "kv_b": (32768, 512),  # 128 * (128 + 128)
        "o": (7168, 16384),  # 128 * 128
        "gate_up": (36864, 7168),  # first 3 dense layers: 2 * 18432
        "down": (7168, 18432),
        "shared_gate_up": (4096, 7168),  # 1 shared expert: 2 * 2048
        "shared_down": (7168, 2048),
        "router": (256, 7168),  # 256 routed experts
        "lm_head": (129280, 7168),
    }
    assert moe_shapes(spec, 1) == [MoeShape(7168, 2048, 256, 8)]


def test_deepseek_v3_tp8():
    spec = load_preset("deepseek-v3")
    got = nk(dense_projections(spec, 8))
    assert got["q_a"] == (1536, 7168) and got["kv_a"] == (576, 7168)
    assert got["q_b"] == (3072, 1536)
    assert got["kv_b"] == (4096, 512)
    assert got["o"] == (7168, 2048)
    assert got["shared_gate_up"] == (512, 7168)
    assert got["lm_head"] == (16160, 7168)
    assert moe_shapes(spec, 8) == [MoeShape(7168, 256, 256, 8)]


def test_mixtral_has_no_dense_mlp_and_experts_are_intermediate_size_wide():
    spec = load_preset("mixtral-8x7b")
    assert nk(dense_projections(spec, 2)) == {
        "qkv": (3072, 4096),  # (16 + 2*4) * 128
        "o": (4096, 2048),
        "router": (8, 4096),
        "lm_head": (16000, 4096),
    }
    assert moe_shapes(spec, 2) == [MoeShape(4096, 7168, 8, 2)]  # 14336 / 2


def test_qwen3_30b_a3b_every_layer_is_moe():
    spec = load_preset("qwen3-30b-a3b")
    assert nk(dense_projections(spec, 4)) == {
        "qkv": (1280, 2048),  # (32/4 + 2*1) * 128
        "o": (2048, 1024),
        "router": (128, 2048),
        "lm_head": (37984, 2048),
    }
    assert moe_shapes(spec, 4) == [MoeShape(2048, 192, 128, 8)]  # 768 / 4


def test_identical_shapes_are_listed_once_under_the_first_name():
    # o is (512, 8*64=512) and down is (512, 512): down is dropped.
    cfg = {"hidden_size": 512, "intermediate_size": 512, "num_attention_heads": 8,
           "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 1000}
    got = dense_projections(ModelSpec.from_config(cfg, "toy"), 1)
    assert [p.name for p in got] == ["qkv", "o", "gate_up", "lm_head"]
    assert got[1] == Projection("o", 512, 512)


# ---------------------------------------------------------------- errors


def test_missing_field_names_field_and_file(tmp_path):
    cfg = json.loads((FIXTURES / "tiny-llama" / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="hidden_size") as err:
        load_model_dir(tmp_path)
    assert str(tmp_path / "config.json") in str(err.value)


def test_moe_without_topk_is_a_clear_error(tmp_path):
    cfg = json.loads((FIXTURES / "tiny-mla-moe" / "config.json").read_text())
    del cfg["num_experts_per_tok"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        load_model_dir(tmp_path)


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelConfigError, match="config.json") as err:
        load_model_dir(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_non_integer_field_is_rejected():
    with pytest.raises(ModelConfigError, match="'vocab_size' must be a non-negative integer"):
        ModelSpec.from_config({"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                               "vocab_size": "many"}, "bad")


def test_unknown_preset_lists_presets():
    with pytest.raises(ModelConfigError, match="llama3-9000") as err:
        load_preset("llama3-9000")
    for name in PRESETS:
        assert name in str(err.value)


def test_tp_that_does_not_divide_heads():
    spec = load_preset("llama3-70b")
    with pytest.raises(TensorParallelError, match="num_attention_heads=64") as err:
        dense_projections(spec, 3)
    assert "valid tp for this model: 1, 2, 4, 8, 16, 32, 64" in str(err.value)
    with pytest.raises(TensorParallelError):
        moe_shapes(spec, 3)
    with pytest.raises(TensorParallelError, match="tp must be >= 1"):
        dense_projections(spec, 0)


def test_tp_that_splits_kv_heads_unevenly():
    # 6 KV heads on 4 ranks: neither 6/4 nor 4/6 is whole.
    cfg = {"hidden_size": 1536, "intermediate_size": 6144, "num_attention_heads": 24,
           "num_key_value_heads": 6, "vocab_size": 1000}
    spec = ModelSpec.from_config(cfg, "kv6")
    with pytest.raises(TensorParallelError, match="num_key_value_heads=6"):
        dense_projections(spec, 4)
    assert valid_tp(spec, 8) == (1, 2, 3, 6)  # 24 heads, 6144 = 2^11 * 3 wide MLP, 6 KV heads


def test_tp_that_does_not_divide_expert_width():
    cfg = {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 1000,
           "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 100}
    spec = ModelSpec.from_config(cfg, "moe100")
    assert spec.dense_intermediate_size is None  # no intermediate_size needed: every layer is MoE
    with pytest.raises(TensorParallelError, match="tp=8 does not divide moe_intermediate_size=100"):
        moe_shapes(spec, 8)


# ---------------------------------------------------------------- untuned rows


def shaped(family, rows):
    """Rows as dicts of column name -> value, through the family's schema."""
    assert all(type(r.key) is get_family(family).schema.key_type for r in rows)
    return [r.key._asdict() for r in rows]


def test_bf16_rows_columns_order_and_values():
    spec = load_model_dir(FIXTURES / "tiny-llama")
    rows = untuned_rows(spec, 2, m_values=(16, 1, 16))
    # dense: no fmoe
    assert set(rows) == {"bf16", "a8w8", "a8w8_blockscale", "a8w8_bpreshuffle", "a16w4",
                         "a4w4_blockscale"}
    bf16 = shaped("bf16", rows["bf16"])
    # MXFP4 weights: the same GEMMs (every K here a multiple of 32), x in bf16 or MXFP4, each
    # followed by its packed twin where K is a multiple of 128 (1408 is not).
    layouts = [(r["M"], r["N"], r["K"], packed) for r in bf16
               for packed in ((False, True) if r["K"] % 128 == 0 else (False,))]
    assert [r.key for r in rows["a16w4"]] == [(m, n, k, "torch.bfloat16", packed)
                                              for m, n, k, packed in layouts]
    assert [r.key for r in rows["a4w4_blockscale"]] == layouts
    # a8w8: the same GEMMs with FP8 weights, in the same order; pre-shuffled too (every weight
    # here tiles: N a multiple of 16, K of 128).
    assert [r.key for r in rows["a8w8"]] == [
        (r["M"], r["N"], r["K"], "torch.float8_e4m3fn") for r in bf16]
    assert [r.key for r in rows["a8w8_bpreshuffle"]] == [r.key for r in rows["a8w8"]]
    assert [r.key for r in rows["a8w8_blockscale"]] == [
        (r["M"], r["N"], r["K"]) for r in bf16]
    # tp=2 shapes sorted by (N, K): (768,1024) (1024,512) (1024,1408) (2816,1024) (16000,1024); M 1 then 16.
    assert [(r["M"], r["N"], r["K"]) for r in bf16] == [
        (1, 768, 1024), (16, 768, 1024),
        (1, 1024, 512), (16, 1024, 512),
        (1, 1024, 1408), (16, 1024, 1408),
        (1, 2816, 1024), (16, 2816, 1024),
        (1, 16000, 1024), (16, 16000, 1024),
    ]
    assert bf16[0] == {"M": 1, "N": 768, "K": 1024, "bias": False, "dtype": "torch.bfloat16",
                       "outdtype": "torch.bfloat16", "scaleAB": False, "bpreshuffle": False}


def test_fmoe_rows_columns_and_values():
    rows = untuned_rows(load_model_dir(FIXTURES / "tiny-mla-moe"), 2)
    fmoe = shaped("fmoe", rows["fmoe"])
    assert [r["token"] for r in fmoe] == list(DEFAULT_M)
    assert fmoe[0] == {
        "token": 1, "model_dim": 2048, "inter_dim": 352, "expert": 64, "topk": 6,
        "act_type": "ActivationType.Silu", "dtype": "torch.bfloat16", "q_dtype_a": "torch.bfloat16",
        "q_dtype_w": "torch.bfloat16", "q_type": "QuantType.No", "use_g1u1": 1, "doweight_stage1": 0,
    }
    # 11 distinct projections at tp=2 (see test_tiny_mla_moe_tp2) x 11 default M.
    assert len(rows["bf16"]) == 11 * len(DEFAULT_M)


def test_fmoe_rows_of_fp8_experts_and_of_an_expert_parallel_rank():
    spec = load_preset("deepseek-v3")
    (row,) = untuned_rows(spec, 8, (4,), fmoe_q_type=QuantType.per_1x128)["fmoe"]
    assert (row.key.inter_dim, row.key.expert) == (256, 256)  # TP8: every expert, 1/8 wide
    assert (row.key.q_dtype_a, row.key.q_dtype_w, row.key.q_type) == (
        "torch.float8_e4m3fn", "torch.float8_e4m3fn", "QuantType.per_1x128")
    (row,) = untuned_rows(spec, 1, (4,), ep=8)["fmoe"]
    assert (row.key.inter_dim, row.key.expert, row.key.q_type) == (2048, 32, "QuantType.No")
    with pytest.raises(ValueError, match="per_Token"):
        untuned_rows(spec, 1, (4,), fmoe_q_type=QuantType.per_128x128)
    with pytest.raises(TensorParallelError, match="ep=3"):
        untuned_rows(spec, 1, (4,), ep=3)


def test_rows_have_no_duplicates():
    for name in PRESETS:
        for family, rows in untuned_rows(load_preset(name), 8).items():
            keys = [r.key for r in rows]
            assert len(keys) == len(set(keys)), (name, family)


def test_bad_m_values():
    spec = load_preset("llama3-8b")
    with pytest.raises(ValueError, match="positive integers"):
        untuned_rows(spec, 1, m_values=(0, 16))
    with pytest.raises(ValueError, match="positive integers"):
        untuned_rows(spec, 1, m_values=())


def test_copied_model_dir_is_named_after_folder(tmp_path):
    target = tmp_path / "My-Model"
    shutil.copytree(FIXTURES / "tiny-llama", target)
    assert load_model_dir(target).name == "My-Model"


# ------------------------------------------------------- nested text configs and bias flags
def _llama_fields(**extra) -> dict:
    return {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4,
            "intermediate_size": 2816, "vocab_size": 32000, **extra}


def test_a_multimodal_config_with_its_language_model_under_text_config():
    """Gemma-3 and Llama-4 keep the language model's fields under text_config."""
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": _llama_fields(head_dim=256, model_type="gemma3_text"),
           "vision_config": {"hidden_size": 1152, "intermediate_size": 4304}}
    spec = ModelSpec.from_config(cfg, "gemma-3")
    assert spec.architectures == ("Gemma3ForConditionalGeneration",)
    assert nk(dense_projections(spec, 1))["qkv"] == ((16 + 2 * 4) * 256, 1024)
    assert nk(dense_projections(spec, 1))["gate_up"] == (2 * 2816, 1024)
    with pytest.raises(ModelConfigError, match="'vocab_size' is missing or null \\(also under "
                                               "'text_config'\\)"):
        ModelSpec.from_config({"text_config": {k: v for k, v in _llama_fields().items()
                                               if k != "vocab_size"}}, "x")


@pytest.mark.parametrize("extra, model_type, biased", [
    ({}, "llama", set()),
    ({}, "qwen2", {"qkv"}),  # Qwen2's q/k/v always add a bias; o does not
    ({"attention_bias": True}, "llama", {"qkv", "o"}),
    ({"mlp_bias": True}, "llama", {"gate_up", "down"}),
])
def test_bias_flags_reach_the_projections_and_the_bf16_rows(extra, model_type, biased):
    spec = ModelSpec.from_config({**_llama_fields(**extra), "model_type": model_type}, "m")
    projections = dense_projections(spec, 1)
    assert {p.name for p in projections if p.bias} == biased
    rows = untuned_rows(spec, 1, m_values=(4,))
    bf16 = {(r.key.N, r.key.K): r.key.bias for r in rows["bf16"]}
    assert bf16 == {(p.N, p.K): p.bias for p in projections}
    assert len(rows["a8w8"]) == len({(p.N, p.K) for p in projections})  # no bias column there


def test_a_presets_moe_shape_and_the_label_its_results_are_filed_under():
    from gemmtune.models.shapes import ModelConfigError, MoeShape, preset_moe_shape

    assert preset_moe_shape("deepseek-v3", 8) == (MoeShape(7168, 256, 256, 8), "deepseek-v3-tp8")
    assert preset_moe_shape("mixtral-8x7b") == (MoeShape(4096, 14336, 8, 2), "mixtral-8x7b")
    with pytest.raises(ModelConfigError, match="no MoE layers"):
        preset_moe_shape("llama3-8b")
