"""Routing replay (R3) and the MoE metrics: the pure functions' golden values, the replay hook on a
tiny Qwen3-MoE (its own routes reproduce its log-probs bit for bit, other routes change them), and
the engine-to-learner path on a model whose routing is near-tied (without replay the learner
routes some tokens elsewhere than the HF engine did; with replay, never)."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from rl_algos import expert_load_metrics, replayed_gate_weights, route_mismatch
from rl_data import Trajectory, build_experience
from rl_data.tiny import build_tiny_model
from rl_learner.models import packed_logprobs
from rl_learner.routing import MoERouting, routing_metric_keys, routing_metrics, row_routes


def test_replayed_gate_weights_golden_values():
    logits = torch.tensor([[0.0, math.log(3.0), 0.0]])  # p = [0.2, 0.6, 0.2]
    experts = torch.tensor([[1, 0]])
    torch.testing.assert_close(replayed_gate_weights(logits, experts), torch.tensor([[0.75, 0.25]]))
    torch.testing.assert_close(
        replayed_gate_weights(logits, experts, normalize=False), torch.tensor([[0.6, 0.2]])
    )
    with pytest.raises(ValueError, match="expert_indices has 2 tokens"):
        replayed_gate_weights(logits, torch.zeros(2, 2, dtype=torch.long))


def test_expert_load_metrics_golden_values():
    balanced = torch.tensor([[0, 1], [2, 3]])  # 4 experts, one token each
    skewed = torch.tensor([[0, 1], [0, 1], [-1, -1]])  # the -1 row is skipped
    metrics = expert_load_metrics([balanced, skewed], num_experts=4)
    assert float(metrics["layer0/load_max_over_mean"]) == pytest.approx(1.0)
    assert float(metrics["layer0/load_entropy"]) == pytest.approx(math.log(4))
    assert float(metrics["layer1/load_max_over_mean"]) == pytest.approx(2.0)  # E/K
    assert float(metrics["layer1/load_entropy"]) == pytest.approx(math.log(2))
    assert float(metrics["load_max_over_mean"]) == pytest.approx(1.5)


def test_route_mismatch_compares_sets_of_reported_tokens():
    engine = torch.tensor([[[0, 1]], [[2, 3]], [[-1, -1]]])
    learner = torch.tensor([[[1, 0]], [[2, 0]], [[5, 6]]])  # same set, other set, unreported
    mismatched, compared = route_mismatch(learner, engine)
    assert (float(mismatched), float(compared)) == (1.0, 2.0)


def test_row_routes_follow_the_row_and_mark_filler():
    routes = torch.arange(12, dtype=torch.int16).reshape(6, 1, 2)
    out = row_routes(routes, torch.tensor([0, 3, -1]))
    assert out.tolist() == [[[0, 1]], [[6, 7]], [[-1, -1]]]


@pytest.fixture(scope="module")
def moe(tokenizer):
    return build_tiny_model(
        tokenizer, architecture="qwen3_moe", hidden_size=64, num_heads=2, num_kv_heads=1
    ).eval()


def _batch(routes_of=None, lengths=((3, 5), (4, 6), (3, 4))):
    generator = torch.Generator().manual_seed(0)
    records = []
    for prompt, response in lengths:
        ids = torch.randint(3, 400, (prompt + response,), generator=generator)
        records.append(Trajectory(prompt_ids=ids[:prompt], response_ids=ids[prompt:]))
    return build_experience(records)


def _own_routes(model, batch):
    with torch.no_grad(), MoERouting(model, replay=False) as routing:
        packed_logprobs(model, batch, routing=routing)
        return torch.stack(routing.own, dim=1).to(torch.int16)


def test_replaying_the_models_own_routes_reproduces_its_logprobs_exactly(moe):
    batch = _batch()
    batch.routed_experts = _own_routes(moe, batch)
    with torch.no_grad():
        plain = packed_logprobs(moe, batch)
        with MoERouting(moe, replay=True) as routing:
            replayed = packed_logprobs(moe, batch, routing=routing)
            metrics = routing_metrics(routing)
        assert torch.equal(plain, replayed)
        assert sorted(metrics) == sorted(routing_metric_keys(2))
        assert float(metrics["moe_route_mismatch"]) == 0.0
        assert float(metrics["moe_routes_reported"]) == 1.0


def test_replaying_other_routes_changes_the_logprobs_and_the_learner_uses_them(moe):
    batch = _batch()
    own = _own_routes(moe, batch)
    other = msgspec.structs.replace(batch, routed_experts=(own + 1) % moe.config.num_experts)
    with torch.no_grad():
        plain = packed_logprobs(moe, batch)
        with MoERouting(moe, replay=True) as routing:
            replayed = packed_logprobs(moe, other, routing=routing, only_actions=True, share_prefix=True)
            metrics = routing_metrics(routing)
    assert float((replayed - plain * batch.action_mask).abs().max()) > 1e-4
    assert float(metrics["moe_route_mismatch"]) > 0.5  # the routers' own choice is elsewhere
    assert float(metrics["moe_route_mismatch_used"]) == 0.0  # the replayed experts ran


def test_unreported_tokens_route_freely_and_wrong_shapes_are_refused(moe):
    batch = _batch()
    free = msgspec.structs.replace(
        batch, routed_experts=torch.full((batch.num_tokens, 2, 2), -1, dtype=torch.int16)
    )
    with torch.no_grad(), MoERouting(moe, replay=True) as routing:
        assert torch.equal(packed_logprobs(moe, free, routing=routing), packed_logprobs(moe, batch))
        wrong = msgspec.structs.replace(
            batch, routed_experts=torch.zeros((batch.num_tokens, 3, 2), dtype=torch.int16)
        )
        with pytest.raises(ValueError, match="the model has 2 MoE layers"):
            packed_logprobs(moe, wrong, routing=routing)
        with pytest.raises(ValueError, match="the batch has no routed_experts"):
            packed_logprobs(moe, batch, routing=routing)


def test_a_dense_model_cannot_replay(tokenizer):
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        MoERouting(build_tiny_model(tokenizer), replay=True)


def test_replay_makes_the_learner_route_as_the_hf_engine_on_a_near_tied_router(tokenizer):
    """Router rows equal up to 1e-7: the engine's KV-cache decode and the learner's packed forward
    differ by float noise, enough to flip near-tied top-k choices (4% of (token, layer) pairs
    measured) and move log-probs by up to ~1e-2; with replay no token is routed elsewhere and the
    log-probs agree to float noise."""
    from rl_rollout import SamplingParams
    from rl_rollout.engines import HFEngine

    model = build_tiny_model(tokenizer, architecture="qwen3_moe", hidden_size=64, num_heads=2, num_kv_heads=1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate.copy_(gate[:1].expand_as(gate) + 1e-7 * torch.randn(gate.shape, generator=generator))
    engine = HFEngine(model, tokenizer, device="cpu", return_routed_experts=True, seed=0)
    assert engine.supports("routed_experts")
    prompts = [[1, 2, 3, 9, 10, 11], [4, 5, 6, 7, 8]]
    outputs = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=1))
    records = [
        Trajectory(
            prompt_ids=p,
            response_ids=g.token_ids,
            rollout_logprobs=g.logprobs,
            routed_experts=g.routed_experts,
        )
        for p, generations in zip(prompts, outputs, strict=True)
        for g in generations
    ]
    assert all(r.routed_experts.shape == (r.num_tokens, 2, 2) for r in records)
    assert all((r.routed_experts[-1] == -1).all() for r in records)  # the last token never ran
    batch = build_experience(records)
    gaps = {}
    with torch.no_grad():
        for replay in (False, True):
            with MoERouting(model, replay=replay) as routing:
                logprobs = packed_logprobs(model, batch, routing=routing)
                metrics = routing_metrics(routing)
            gaps[replay] = float(((logprobs - batch.rollout_logprobs).abs() * batch.action_mask).max())
            used = float(metrics["moe_route_mismatch_used"])
            assert (used == 0.0) if replay else (used > 0.0), (replay, used)
    assert gaps[True] < 1e-5 < gaps[False], gaps
