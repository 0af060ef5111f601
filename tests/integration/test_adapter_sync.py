"""LoRA adapter-only weight sync, both sides on the tiny model (no Ray, no vLLM): the learner's
sender moves the adapter factors alone, under peft's saved names, and `HFEngine` serves them on
the base weights it loaded, version by version."""

from __future__ import annotations

import pytest
import torch

from rl_data import LoraAdapter, compare_checksums
from rl_data.adapters import adapter_live_name, adapter_wire_name, check_adapter_shapes, write_peft_adapter
from rl_data.sync import WeightSyncSpec
from rl_learner import LoraOptions, adapter_layout, apply_lora, lora_adapter, make_sender, sync_layout
from rl_learner.adapter_sync import adapter_tensors
from rl_rollout.engines import HFEngine
from rl_rollout.engines.vllm import _samples
from rl_rollout.protocol import EngineError, SamplingParams

pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [7, 8, 9]]
# the tiny model's adapted layers, [out, in] each, per layer (2 layers): q o [128, 128],
# k v [64, 128], gate up [256, 128], down [128, 256]: Σ (in + out) = 2048 per layer
TINY_RANK4_ADAPTER_BYTES = 2 * 4 * 2048 * 4  # layers · r · Σ(in + out) · fp32


@pytest.fixture
def policy(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    return apply_lora(model, LoraOptions(rank=4, alpha=8.0)).eval()


def train(policy, seed: int) -> None:
    """A stand-in for a training step: new LoRA factors."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.4)


def peft_greedy(policy, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = policy.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def test_the_adapter_layout_holds_only_the_lora_factors_under_peft_saved_names(policy):
    from peft import get_peft_model_state_dict

    layout = adapter_layout(policy)
    assert set(layout.names()) == set(get_peft_model_state_dict(policy))  # adapter_model.safetensors keys
    for name in layout.names():
        shape = layout.param(name).shape
        assert (shape[0] == 4) if ".lora_A." in name else (shape[1] == 4), name
    assert layout.total_bytes == TINY_RANK4_ADAPTER_BYTES == 65536
    assert sync_layout(policy).total_bytes >= 20 * layout.total_bytes  # the merged model: 1680896 bytes
    assert adapter_layout(policy, dtype=torch.bfloat16).total_bytes == TINY_RANK4_ADAPTER_BYTES // 2
    adapter = lora_adapter(policy)
    assert (adapter.rank, adapter.peft_config["lora_alpha"], adapter.peft_config["peft_type"]) == (
        4,
        8.0,
        "LORA",
    )


def test_wire_names_round_trip_and_other_names_are_refused():
    live = "base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight"
    wire = adapter_wire_name(live, "default")
    assert wire == "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    assert adapter_live_name(wire, "default") == live
    assert (
        adapter_wire_name("base_model.model.model.layers.0.mlp.up_proj.base_layer.weight", "default") is None
    )
    with pytest.raises(ValueError, match=r"not a peft LoRA factor"):
        adapter_live_name("model.layers.0.mlp.up_proj.weight", "default")


def test_adapter_sync_refuses_what_it_cannot_serve(tiny_checkpoint):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    with pytest.raises(ValueError, match=r"needs a LoRA policy.*model.lora_sync merged"):
        adapter_layout(plain)
    dora = get_peft_model(plain, LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match=r"use_dora.*model.lora_sync merged"):
        adapter_tensors(dora)
    with pytest.raises(ValueError, match=r"use_dora is set"):
        LoraAdapter(peft_config={"peft_type": "LORA", "r": 2, "lora_alpha": 4, "use_dora": True})


def test_an_adapter_layout_that_does_not_fit_the_base_model_is_refused_naming_the_module(policy):
    layout, adapter = adapter_layout(policy), lora_adapter(policy)
    base = {name: tuple(t.shape) for name, t in policy.get_base_model().state_dict().items()}
    base = {name.replace(".base_layer", ""): shape for name, shape in base.items()}
    check_adapter_shapes(layout, base, adapter, where="test")
    base["model.layers.1.mlp.down_proj.weight"] = (128, 512)
    with pytest.raises(ValueError, match=r"test: .*'model.layers.1.mlp.down_proj': lora_A \[4, 256\]"):
        check_adapter_shapes(layout, base, adapter, where="test")
    del base["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(
        ValueError, match=r"'model.layers.0.self_attn.q_proj' has no weight in the base model"
    ):
        check_adapter_shapes(layout, base, adapter, where="test")


def test_hf_engine_serves_each_synced_adapter_version_and_a_second_sync_replaces_the_first(
    policy, tiny_checkpoint, tmp_path
):
    spec = WeightSyncSpec(
        transport="file", layout=adapter_layout(policy), directory=str(tmp_path), adapter=lora_adapter(policy)
    )
    engine = HFEngine(tiny_checkpoint, dtype="float32", seed=0)
    base = [g[0].token_ids for g in engine.generate(PROMPTS, GREEDY)]
    engine.init_weight_sync(spec, 1)
    # version 0: the injected adapter is the untrained one (B = 0), the base model
    assert [g[0].token_ids for g in engine.generate(PROMPTS, GREEDY)] == base
    sender = make_sender(spec, policy)
    outputs = []
    for version in (1, 2):
        train(policy, seed=version)
        sent = sender.send(version)
        assert sent.num_bytes == TINY_RANK4_ADAPTER_BYTES
        received = engine.receive_weights(version)
        assert compare_checksums(sent, received) == []
        results = [g[0] for g in engine.generate(PROMPTS, GREEDY)]
        assert [g.policy_version for g in results] == [version, version]
        assert [g.token_ids for g in results] == [peft_greedy(policy, p) for p in PROMPTS], version
        outputs.append([g.token_ids for g in results])
    assert outputs[0] != base
    assert outputs[1] != outputs[0]
    # the base weights are as loaded: only the factors changed
    base_weight = engine.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert torch.equal(
        base_weight, policy.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    )
    with pytest.raises(EngineError, match=r"serves a LoRA adapter.*full-weight spec"):
        engine.init_weight_sync(
            WeightSyncSpec(transport="file", layout=sync_layout(policy), directory=str(tmp_path)), 1
        )
    engine.close()


def test_hf_engine_refuses_an_adapter_for_another_model(policy, tiny_checkpoint, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config.from_pretrained(tiny_checkpoint)
    config.intermediate_size = 192
    other = get_peft_model(
        AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules="all-linear")
    )
    spec = WeightSyncSpec(
        transport="file", layout=adapter_layout(other), directory=str(tmp_path), adapter=lora_adapter(other)
    )
    engine = HFEngine(tiny_checkpoint, dtype="float32", seed=0)
    with pytest.raises(
        EngineError,
        match=r"does not fit the engine's base model: 'model.layers.0.mlp.gate_proj': lora_A \[4, 128\] and lora_B \[192, 4\]",
    ):
        engine.init_weight_sync(spec, 1)


def test_a_peft_folder_written_from_the_wire_loads_in_peft_as_the_policy(policy, tiny_checkpoint, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    train(policy, seed=3)
    tensors = {t.name: t.value() for t in adapter_tensors(policy)}
    folder = write_peft_adapter(tmp_path / "v3", tensors, lora_adapter(policy))
    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, folder).eval()
    assert peft_greedy(loaded, PROMPTS[0]) == peft_greedy(policy, PROMPTS[0])


class _Completion:
    def __init__(self) -> None:
        self.index, self.token_ids, self.logprobs, self.finish_reason = 0, [5, 6], None, "length"
        self.weight_versions = []  # vLLM's labels stay at the start's in an adapter sync


class _Lora:
    lora_int_id = 4  # version 3


class _Output:
    def __init__(self, lora_request) -> None:
        self.outputs, self.lora_request = [_Completion()], lora_request


def test_vllm_tokens_carry_the_version_of_their_requests_adapter():
    params = SamplingParams(temperature=1.0, max_new_tokens=2, logprobs=False)
    [sample] = _samples(_Output(_Lora()), params, version=7, adapter=True)
    assert (sample.policy_version, sample.token_versions) == (3, None)
    # a request added before the first sync: the base model
    [sample] = _samples(_Output(None), params, version=7, adapter=True)
    assert sample.policy_version == 0
