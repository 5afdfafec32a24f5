"""gemmtune as transformers' experts backend (gemmtune.experts): tiny Mixtral, Qwen3-MoE and
DeepSeek-V3 models give the logits of transformers' grouped_mm backend, with every MoE layer
through fused_moe, in forward passes and in generate()."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gemmtune  # noqa: E402
from gemmtune import experts  # noqa: E402
from gemmtune.tables.values import QuantType  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative norm of the logits


def tiny_config(name: str):
    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2)
    if name == "mixtral":
        return transformers.MixtralConfig(intermediate_size=48, num_local_experts=5, **common)
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=40,
                                           num_experts=6, norm_topk_prob=True, head_dim=16,
                                           **common)
    return transformers.DeepseekV3Config(  # one dense layer first, then MoE with shared experts
        intermediate_size=48, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
        n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **common)


def tiny_model(name: str, dtype: torch.dtype):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(name))
    return model.to(device=DEVICE, dtype=dtype).eval()


@pytest.fixture
def counted(monkeypatch):
    """fused_moe calls made through the backend."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return gemmtune.fused_moe(*args, **kwargs)

    monkeypatch.setattr(experts, "fused_moe", counting)
    return calls


def moe_layers(model) -> int:
    return sum(1 for m in model.modules() if hasattr(m, "gate_up_proj"))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_logits_equal_grouped_mms_with_every_moe_layer_through_fused_moe(name, dtype, counted):
    model = tiny_model(name, dtype)
    ids = torch.randint(0, 96, (2, 9), device=DEVICE, generator=torch.Generator(DEVICE)
                        .manual_seed(1))
    with torch.no_grad():
        model.set_experts_implementation("grouped_mm")
        expected = model(ids).logits
        assert gemmtune.patch_moe(model) is model
        assert model.config._experts_implementation == "gemmtune"
        got = model(ids).logits
    assert len(counted) == moe_layers(model) > 0
    assert counted[0] == (18, 64)  # every token of the batch, once per layer
    assert not torch.isnan(got).any()
    assert relative(got, expected) < TOLERANCE[dtype]


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_fp8_experts_quantised_once_per_channel(name, monkeypatch):
    model = tiny_model(name, torch.bfloat16)
    ids = torch.randint(0, 96, (2, 9), device=DEVICE, generator=torch.Generator(DEVICE)
                        .manual_seed(5))
    with torch.no_grad():
        expected = model(ids).logits
    quantised_calls = []

    def counting(*args, **kwargs):
        quantised_calls.append(kwargs.get("quant_type"))
        return gemmtune.fused_moe(*args, **kwargs)

    monkeypatch.setattr(experts, "fused_moe", counting)
    assert gemmtune.patch_moe(model, quant="fp8") is model
    layers = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    for module in layers:
        assert module.gate_up_proj.dtype == module.down_proj.dtype == torch.float8_e4m3fn
        assert module.gemmtune_gate_up_proj_scale.shape == (module.gate_up_proj.shape[0],
                                                            module.gate_up_proj.shape[1], 1)
    dense = [m for m in model.modules() if hasattr(m, "gate_proj")]
    assert all(m.gate_proj.weight.dtype == torch.bfloat16 for m in dense)  # shared experts
    with torch.no_grad():
        got = model(ids).logits
    assert quantised_calls == [QuantType.per_Token] * len(layers)
    # FP8 experts and activations against the bf16 model (measured 0.6-0.8% here: the experts
    # are a part of each layer's output); scales lost or misapplied would be O(1).
    assert relative(got, expected) < 0.03
    with pytest.raises(RuntimeError, match="only gemmtune runs them"):
        model(ids).logits.sum()  # gradients enabled: transformers' backends cannot take FP8


def test_fp8_leaves_experts_it_cannot_run_as_they_are():
    config = tiny_config("mixtral")
    config.hidden_act = "gelu_pytorch_tanh"  # an activation fused_moe lacks
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE).eval()
    gemmtune.patch_moe(model, quant="fp8")
    module = model.model.layers[0].mlp.experts
    assert module.gate_up_proj.dtype == torch.float32 and experts._fp8_scales(module) is None
    experts._warned.clear()
    with torch.no_grad(), pytest.warns(UserWarning, match="gelu_pytorch_tanh"):
        model(torch.randint(0, 96, (1, 4), device=DEVICE))


def test_generate_keeps_the_backend_for_decoding(counted):
    # transformers switches grouped_mm to batched_mm for decoding; it must leave gemmtune.
    model = gemmtune.patch_moe(tiny_model("mixtral", torch.float32))
    ids = torch.randint(0, 96, (1, 5), device=DEVICE, generator=torch.Generator(DEVICE)
                        .manual_seed(2))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    layers = moe_layers(model)
    assert out.shape == (1, 9)
    assert len(counted) == 4 * layers  # the prefill and three decode steps
    assert [shape[0] for shape in counted[layers:]] == [1] * (3 * layers)
    assert model.config._experts_implementation == "gemmtune"
    model.set_experts_implementation("grouped_mm")
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), out)


def test_gradients_take_grouped_mm_with_a_warning(counted):
    model = gemmtune.patch_moe(tiny_model("mixtral", torch.float32))
    ids = torch.randint(0, 96, (1, 6), device=DEVICE)
    experts._warned.clear()
    with pytest.warns(UserWarning, match="gradients .* run transformers' grouped_mm"):
        loss = model(ids).logits.sum()
    loss.backward()
    assert counted == [] and model.model.layers[0].mlp.experts.gate_up_proj.grad is not None


def test_an_activation_it_lacks_takes_grouped_mm_with_a_warning(counted):
    config = tiny_config("mixtral")
    config.hidden_act = "gelu_pytorch_tanh"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(DEVICE).eval()
    ids = torch.randint(0, 96, (1, 6), device=DEVICE)
    experts._warned.clear()
    with torch.no_grad():
        expected = model(ids).logits
        gemmtune.patch_moe(model)
        with pytest.warns(UserWarning, match="activation 'gelu_pytorch_tanh'"):
            got = model(ids).logits
    assert counted == [] and torch.equal(got, expected)


def test_expert_parallel_sentinels_add_nothing(counted):
    # Under expert parallelism transformers gives another rank's experts the id E.
    from transformers.distributed import DistributedConfig

    model = tiny_model("mixtral", torch.float32)
    module = model.model.layers[0].mlp.experts
    module.config.distributed_config = DistributedConfig(enable_expert_parallel=True)
    E = module.gate_up_proj.shape[0]
    g = torch.Generator(DEVICE).manual_seed(3)
    hidden = torch.randn(7, 64, device=DEVICE, generator=g)
    ids = torch.randint(0, E + 1, (7, 2), device=DEVICE, generator=g)
    ids[0] = E  # a token whose every expert is elsewhere
    weights = torch.rand(7, 2, device=DEVICE, generator=g)
    with torch.no_grad():
        got = experts.experts_forward(module, hidden, ids, weights)
        module.config._experts_implementation = "grouped_mm"
        expected = module(hidden, ids, weights)
    assert len(counted) == 1
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert relative(got, expected) < 1e-5


def test_an_experts_module_compiles_whole_with_the_backend(counted):
    # fullgraph: fused_moe is a custom op under torch.compile, nothing breaks the graph.
    module = gemmtune.patch_moe(tiny_model("mixtral", torch.float32)).model.layers[0].mlp.experts
    g = torch.Generator(DEVICE).manual_seed(4)
    hidden = torch.randn(7, 64, device=DEVICE, generator=g)
    ids = torch.randint(0, 5, (7, 2), device=DEVICE, generator=g)
    weights = torch.rand(7, 2, device=DEVICE, generator=g)
    with torch.no_grad():
        expected = module(hidden, ids, weights)
        got = torch.compile(module, fullgraph=True)(hidden, ids, weights)
    assert len(counted) >= 2  # the eager call, then the trace
    assert relative(got, expected) < 1e-6


def test_capture_records_the_fmoe_shapes_a_patched_model_runs(tmp_path, monkeypatch):
    from gemmtune.families.fmoe.op import SCHEMA
    from gemmtune.tables.capture import merge_captures
    from gemmtune.tables.store import read_table

    monkeypatch.setenv("GEMMTUNE_TUNE_GEMM", "1")
    monkeypatch.setenv("GEMMTUNE_CAPTURE_DIR", str(tmp_path / "shards"))
    gemmtune.reset()
    model = gemmtune.patch_moe(tiny_model("mixtral", torch.bfloat16))
    with torch.no_grad():
        model(torch.randint(0, 96, (3, 5), device=DEVICE))
    merge_captures(tmp_path / "shards", tmp_path / "out", {"fmoe": SCHEMA})
    rows = read_table(tmp_path / "out" / "untuned_fmoe.csv", SCHEMA, untuned=True).rows
    assert [tuple(r.key[:7]) for r in rows] == [
        (15, 64, 48, 5, 2, "ActivationType.Silu", "torch.bfloat16")]


def test_from_pretrained_takes_gemmtune_after_import_gemmtune(tmp_path):
    # A fresh process: transformers' MoE integration is loaded after gemmtune, by the model.
    model = tiny_model("qwen3_moe", torch.float32)
    model.save_pretrained(tmp_path / "tiny")
    script = textwrap.dedent(f"""
        import sys
        import torch
        import gemmtune
        assert "transformers.integrations.moe" not in sys.modules
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'tiny')!r},
                                                     experts_implementation="gemmtune")
        assert model.config._experts_implementation == "gemmtune"
        with torch.no_grad():
            print(model(torch.arange(5)[None]).logits.shape)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(gemmtune.__file__).parent.parent)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("torch.Size([1, 5, 96])")


def test_the_import_hook_survives_reloads_and_leaves_loaders_as_they_were():
    # A reload adds no second hook, and two (an older copy's) do not recurse into each other;
    # the module's loader is a registering wrapper of its own (loaders may serve several).
    script = textwrap.dedent("""
        import importlib, inspect, sys, warnings
        import gemmtune
        import gemmtune.experts
        importlib.reload(gemmtune.experts)
        importlib.reload(gemmtune)
        hooks = [f for f in sys.meta_path if getattr(f, "gemmtune_experts_hook", False)]
        assert len(hooks) == 1, hooks  # a reload adds none
        sys.meta_path.insert(1, gemmtune.experts._RegisterOnImport())  # as an older copy's
        import transformers.integrations.moe as moe
        assert "gemmtune" in moe.ALL_EXPERTS_FUNCTIONS
        assert type(moe.__loader__).__name__ == "_RegisteringLoader"
        assert "def grouped_mm_experts_forward" in inspect.getsource(moe)
        import transformers.integrations.deepgemm as sibling
        assert "exec_module" not in vars(sibling.__loader__)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            gemmtune.experts._register_into(object())  # a transformers without the interface
        assert "is not available with this transformers" in str(seen[0].message)
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(gemmtune.__file__).parent.parent)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_routing_weights_that_need_gradients_take_grouped_mm(counted):
    # A router trained with frozen experts: its weights must get their gradient.
    model = gemmtune.patch_moe(tiny_model("mixtral", torch.float32))
    module = model.model.layers[0].mlp.experts
    module.requires_grad_(False)
    hidden = torch.randn(5, 64, device=DEVICE)
    ids = torch.randint(0, 5, (5, 2), device=DEVICE)
    weights = torch.rand(5, 2, device=DEVICE, requires_grad=True)
    experts._warned.clear()
    with pytest.warns(UserWarning, match="gradients"):
        module(hidden, ids, weights).sum().backward()
    assert counted == [] and weights.grad is not None and weights.grad.abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_gpu_cuda_graph_decode_step(name, counted):
    model = gemmtune.patch_moe(tiny_model(name, torch.bfloat16))
    ids = torch.randint(0, 96, (4, 1), device="cuda")
    with torch.no_grad():
        model(ids)  # plans, compiles
        expected = model(ids).logits
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model(ids).logits
        logits.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(logits, expected)


def test_warnings_name_the_reason_once():
    experts._warned.clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        experts._fallback("a reason")
        experts._fallback("a reason")
    assert [str(w.message) for w in seen] == [
        "gemmtune experts: a reason: these calls run transformers' grouped_mm"]
