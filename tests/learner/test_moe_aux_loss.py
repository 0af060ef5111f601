"""`PolicyLossConfig.aux_loss_coef`: the router load-balancing loss of an MoE policy joins the
policy loss (c · L_aux) and trains the routers. Real DeepSpeed on CPU, one rank, in a subprocess;
the pure function's golden values are in the first tests."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from rl_algos import load_balancing_loss
from tests.learner.single_rank import single_rank_env

WORKER = pathlib.Path(__file__).resolve().parent / "_worker_moe_aux.py"
COEF = 0.5


def test_load_balancing_loss_golden_values():
    ties = torch.zeros(2, 2)  # p = 1/2 everywhere; top-1 picks expert 0 twice: f = [1, 0]
    assert float(load_balancing_loss([ties], top_k=1)) == pytest.approx(1.0)
    balanced = torch.tensor([[5.0, 0.0], [0.0, 5.0]])  # f = [1/2, 1/2], P = [1/2, 1/2]: E·Σ f·P = 1
    assert float(load_balancing_loss([balanced], top_k=1)) == pytest.approx(1.0)
    skewed = torch.tensor([[5.0, 0.0], [5.0, 0.0]])  # f = [1, 0], P ≈ [0.9933, 0.0067]
    assert float(load_balancing_loss([skewed], top_k=1)) == pytest.approx(
        2 * torch.sigmoid(torch.tensor(5.0))
    )
    # top-2 of 2 experts: f = [1, 1] whatever the logits, so L = E·Σ P = 2
    assert float(load_balancing_loss([torch.randn(5, 2), torch.randn(3, 2)], top_k=2)) == pytest.approx(2.0)


def test_load_balancing_loss_checks_its_arguments():
    with pytest.raises(ValueError, match="router_logits is empty"):
        load_balancing_loss([], top_k=1)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 2\]"):
        load_balancing_loss([torch.zeros(3, 2)], top_k=3)
    with pytest.raises(ValueError, match=r"router_logits\[1\] has 3 experts"):
        load_balancing_loss([torch.zeros(3, 2), torch.zeros(3, 3)], top_k=1)


def test_the_packed_forward_gives_the_aux_loss_of_per_sequence_forwards(tokenizer):
    import itertools

    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    sys.path.insert(0, str(WORKER.parent))
    from _helpers_core import experience

    from rl_data.tiny import build_tiny_model
    from rl_learner.models import RouterCapture, packed_logprobs

    model = build_tiny_model(tokenizer, architecture="qwen2_moe")
    batch = experience(6, seed=3)
    with torch.no_grad(), RouterCapture(model) as packed:
        packed_logprobs(model, batch)
    layers = model.config.num_hidden_layers
    with torch.no_grad(), RouterCapture(model) as single:
        for start, end in itertools.pairwise(batch.cu_seqlens.tolist()):
            model(batch.input_ids[start:end][None])
    per_layer = [torch.cat(single.logits[layer::layers]) for layer in range(layers)]
    assert [t.shape[0] for t in packed.logits] == [batch.num_tokens] * layers  # real tokens only
    ours = load_balancing_loss(packed.logits, packed.top_k)
    torch.testing.assert_close(ours, load_balancing_loss(per_layer, packed.top_k))
    # transformers' own function (no mask: every row is a real token) agrees
    torch.testing.assert_close(ours, load_balancing_loss_func(tuple(packed.logits), 4, 2).float())


def test_a_dense_model_has_no_router_to_capture(tokenizer):
    from rl_data.tiny import build_tiny_model
    from rl_learner.models import RouterCapture

    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        RouterCapture(build_tiny_model(tokenizer))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_aux")
    env = single_rank_env()
    done = subprocess.run(
        [sys.executable, str(WORKER), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_the_policy_loss_includes_coef_times_the_aux_loss(results):
    off, on = results["off"], results["on"]
    assert "aux_loss" not in off
    assert on["aux_loss"] == pytest.approx(results["expected_aux"], rel=1e-5)
    assert on["loss_aux"] == pytest.approx(COEF * results["expected_aux"], rel=1e-5)
    assert on["loss"] - off["loss"] == pytest.approx(COEF * results["expected_aux"], rel=1e-4)
    # two micro-batches: each weighted by its share of the action tokens
    assert results["split"]["loss_aux"] == pytest.approx(COEF * results["split"]["aux_loss"], rel=1e-5)


@pytest.mark.slow
def test_the_aux_gradient_reaches_the_router(results):
    assert results["on"]["router_change"] > 0
    difference = max(
        max(
            abs(a - b)
            for row_a, row_b in zip(results["on_params"][n], results["off_params"][n])
            for a, b in zip(row_a, row_b)
        )
        for n in results["on_params"]
    )
    assert difference > 1e-6  # the routers moved differently with the term


@pytest.mark.slow
def test_aux_loss_on_a_dense_policy_is_refused(results):
    assert "no mixture-of-experts router" in results["dense_error"]


@pytest.mark.slow
def test_router_replay_in_the_learner_steps_and_old_logprobs(results):
    """R3 through PolicyLearner (DeepSpeed): the policy's own routes give the step without replay
    and the plain old log-probs; other routes are used (mismatch_used 0) and change both."""
    own, other, off = results["replay_own"], results["replay_other"], results["off"]
    assert own["loss"] == off["loss"]
    assert own["moe_route_mismatch"] == 0.0
    assert results["replay_own_old_logprobs"] == results["plain_old_logprobs"]
    assert other["moe_route_mismatch"] == 1.0
    assert other["moe_route_mismatch_used"] == 0.0
    assert other["moe_routes_reported"] == 1.0
    assert off["moe_routes_reported"] == 0.0
    assert other["loss"] != off["loss"]
    assert results["replay_other_old_logprobs"] != results["plain_old_logprobs"]
    assert "moe_layer1/load_entropy" in off  # an MoE policy logs its expert load every step
