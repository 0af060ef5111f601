"""Real DeepSpeed-on-CPU learner runs (gloo), one or two processes, against a plain-torch full-batch step.

Each world size runs `_worker_learner.py` once per rank, and that world runs its configurations
one after the other (one interpreter and DeepSpeed start-up per rank, not per configuration); per
configuration the worker trains a policy and a critic for NUM_STEPS steps over its share of a
fixed batch (micro-batches from `rl_data.plan_micro_batches`, plus one empty micro-batch per
rank) and writes the parameters and metrics. The reference here trains an identical model with
torch AdamW on the whole batch at once (no micro-batches, no ranks, the aggregation's own
normaliser): the global-normaliser contract says every split must give the same weights.
"""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import sys

import pytest
import torch

from rl_algos import POLICY_LOSSES, aggregate_loss, kl_penalty, rollout_correction, value_loss
from tests.learner.single_rank import start_ranks, wait_ranks

os.environ.setdefault("DS_ACCELERATOR", "cpu")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _helpers_core import (
    LR,
    NUM_STEPS,
    TOTAL_STEPS,
    experience,
    fill_policy_slots,
    fill_value_slots,
    tiny_critic,
    tiny_policy,
)
from _worker_learner import POLICY_LOSS

WORKER = pathlib.Path(__file__).resolve().parent / "_worker_learner.py"

# Every test reads the runs of a module fixture: DeepSpeed worker processes, one and two ranks (minutes).
pytestmark = pytest.mark.slow

# (stage, world size, model dtype, extra checks). DeepSpeed's ZeRO-0 all-reduce refuses float64
# gradients, so ZeRO-0 runs in float32; so does ZeRO-3, whose parameter partitioning refuses a
# float64 model wherever the accelerator reports fp16 support (GPUs, and CPUs with AVX512-FP16 /
# AMX, such as Sapphire Rapids: `zero.Init` asserts the dtype is half, bfloat16 or float).
RUNS = [
    (0, 1, "float32", True),
    (0, 2, "float32", False),
    (2, 1, "float64", False),
    (2, 2, "float64", True),
    (3, 2, "float32", True),
]
# ZeRO keeps float32 master weights even for a float64 model, and Adam amplifies float32 rounding
# where a gradient nearly cancels between the two steps, so a handful of elements can move by a
# few % of lr. Weights must agree to 2e-5 (2% of lr = 1e-3) on 99.9% of the elements and to
# 2e-4 everywhere: a wrong weighting of micro-batches moves most elements by O(lr). Adam and
# clipping hide a global gradient scale error, so the pre-clip gradient norm and the loss are
# compared tightly as well.
WEIGHTS = {"rtol": 1e-5, "atol": 2e-5}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], pathlib.Path]:
    """Start one world per world size, both at once, each running its configurations in turn by
    stage; wait; return every configuration's output folder."""
    started = []
    folders = {}
    for world in sorted({world for _, world, _, _ in RUNS}):
        folder = tmp_path_factory.mktemp(f"world{world}")
        mine = sorted((run for run in RUNS if run[1] == world), key=lambda run: run[0])
        for stage, _, _, _ in mine:
            folders[stage, world] = folder / f"zero{stage}"
        specs = [f"{stage},{dtype}" + (",checks" if checks else "") for stage, _, dtype, checks in mine]
        started += start_ranks(WORKER, folder, world, *specs)
    wait_ranks(started)
    return folders


def _params(folder: pathlib.Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / f"{name}.safetensors"))


def _metrics(folder: pathlib.Path, rank: int = 0) -> dict:
    return json.loads((folder / f"metrics_rank{rank}.json").read_text())


# --------------------------------------------------------------------------- the full-batch reference


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, torch.Tensor]]:
    """Policy and critic parameters after NUM_STEPS plain-torch steps on the whole batch."""
    from rl_data.tiny import build_tiny_tokenizer
    from rl_learner.config import DeepSpeedConfig, OptimizerConfig, build_optimizer, build_scheduler
    from rl_learner.models import packed_logprobs, packed_values

    tokenizer = build_tiny_tokenizer()
    ds = DeepSpeedConfig(zero_stage=0, dtype="fp32")
    optim = OptimizerConfig(lr=LR, warmup_ratio=0.25, weight_decay=0.01)

    def train(model, loss_of):
        optimizer = build_optimizer(model.parameters(), optim, ds)
        scheduler = build_scheduler(optimizer, optim, TOTAL_STEPS)
        norms, losses = [], []
        for _ in range(NUM_STEPS):
            loss = loss_of(model)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)))
            losses.append(float(loss.detach()))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        params = {name: p.detach().clone() for name, p in model.named_parameters()}
        return params, torch.tensor(norms, dtype=torch.float64), torch.tensor(losses, dtype=torch.float64)

    policy = tiny_policy(tokenizer, torch.float64)
    batch = experience()
    with torch.no_grad():
        fill_policy_slots(batch, packed_logprobs(policy, batch).float())  # the learner returns float32
    view, mask = batch.response_view, batch.response_action_mask()
    options = POLICY_LOSS

    def policy_loss(model):
        logprobs, entropy = packed_logprobs(model, batch, with_entropy=True)
        logprobs, entropy = view(logprobs), view(entropy)
        old = view(batch.old_logprobs)
        per_token, _ = POLICY_LOSSES["ppo"](logprobs, old, view(batch.advantages), mask, **options["options"])
        weights, _ = rollout_correction(
            old, view(batch.rollout_logprobs), mask, method="tis", low=0.5, high=5.0
        )
        mode = options["aggregation"]
        kl = kl_penalty(logprobs, view(batch.ref_logprobs), "k3")
        distill = 0.5 * (logprobs - view(batch.teacher_logprobs)).square()  # k2 to the teacher
        return (
            aggregate_loss(per_token * weights, mask, mode)
            + options["kl_coef"] * aggregate_loss(kl, mask, mode)
            + options["distill_coef"] * aggregate_loss(distill, mask, mode)
            - options["entropy_coef"] * aggregate_loss(entropy, mask, mode)
        )

    result = {}
    result["policy"], result["policy_grad_norm"], result["policy_loss"] = train(policy, policy_loss)

    critic = tiny_critic(tokenizer, torch.float64)
    critic_batch = experience()
    with torch.no_grad():
        fill_value_slots(critic_batch, packed_values(critic, critic_batch).float())

    def critic_loss(model):
        cview = critic_batch.response_view
        values = cview(packed_values(model, critic_batch))
        cmask = critic_batch.response_action_mask()
        per_token, _ = value_loss(values, cview(critic_batch.values), cview(critic_batch.returns), cmask)
        return aggregate_loss(per_token, cmask, "token-mean")

    result["critic"], result["critic_grad_norm"], result["critic_loss"] = train(critic, critic_loss)
    return result


def _assert_params_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str
) -> None:
    assert actual.keys() == expected.keys(), what
    close, total = 0, 0
    for name in expected:
        a, b = actual[name].double(), expected[name].double()
        torch.testing.assert_close(a, b, rtol=0, atol=2e-4, msg=lambda m, n=name: f"{what} {n}: {m}")
        close += int(torch.isclose(a, b, **WEIGHTS).sum())
        total += b.numel()
    assert close >= 0.999 * total, f"{what}: only {close} of {total} weights agree within {WEIGHTS}"


CASES = [
    pytest.param(stage, world, dtype, id=f"zero{stage}-x{world}-{dtype}") for stage, world, dtype, _ in RUNS
]
CHECKED = [
    pytest.param(stage, world, id=f"zero{stage}-x{world}") for stage, world, _, checks in RUNS if checks
]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("stage", "world", "dtype"), CASES)
@pytest.mark.parametrize("model", ["policy", "critic"])
def test_train_step_equals_the_full_batch_step_for_any_split(runs, reference, model, stage, world, dtype):
    """Weights, pre-clip gradient norms and losses of 2 steps equal one plain-torch full-batch step each."""
    folder = runs[stage, world]
    _assert_params_close(_params(folder, model), reference[model], f"ZeRO-{stage} x{world} {model}")
    metrics = _metrics(folder)[f"{model}_metrics"]
    torch.testing.assert_close(
        torch.tensor([m["grad_norm"] for m in metrics], dtype=torch.float64),
        reference[f"{model}_grad_norm"],
        rtol=1e-5,
        atol=0,
    )
    torch.testing.assert_close(
        torch.tensor([m["loss"] for m in metrics], dtype=torch.float64),
        reference[f"{model}_loss"],
        rtol=1e-5,
        atol=1e-8,
    )


def test_one_rank_four_micro_batches_equals_two_ranks_two_micro_batches(runs):
    for stage in (0, 2):
        for model in ("policy", "critic"):
            _assert_params_close(
                _params(runs[stage, 2], model), _params(runs[stage, 1], model), f"ZeRO-{stage} {model}"
            )


def test_metrics_are_global_and_equal_on_every_rank(runs):
    single = _metrics(runs[2, 1])["policy_metrics"]
    for rank in range(2):
        double = _metrics(runs[2, 2], rank)["policy_metrics"]
        for step_single, step_double in zip(single, double, strict=True):
            assert step_double.keys() == step_single.keys()
            # mismatch_ess: a ratio, averaged per micro-batch; shared_tokens_frac: depends on which
            # sequences share a micro-batch
            for key in step_single.keys() - {"mismatch_ess", "shared_tokens_frac"}:
                assert step_double[key] == pytest.approx(step_single[key], rel=1e-5, abs=1e-7), key
    first = single[0]
    assert first["tokens"] == experience().num_actions
    assert first["sequences"] == 8
    assert first["skipped"] == 0
    assert 0 < first["shared_tokens_frac"] < 0.5  # groups of 4 share a prompt (`experience`)
    assert first["loss"] == pytest.approx(
        first["loss_policy"]
        + 0.05 * first["loss_kl"]
        + 0.1 * first["loss_distill"]
        - 0.01 * first["loss_entropy"]
    )
    keys = (
        "clip_fraction",
        "ppo_kl",
        "entropy",
        "kl",
        "distill_kl",
        "mismatch_abs_mean",
        "mismatch_abs_max",
        "lr",
    )
    for key in keys:
        assert key in first


def test_inference_logprobs_equal_across_stages_and_the_reference_model(runs):
    expected = torch.tensor(_metrics(runs[2, 1])["full_logprobs"])
    for stage, world, dtype, _ in RUNS:
        data = _metrics(runs[stage, world])
        tolerance = {"rtol": 0, "atol": 1e-6 if dtype == "float64" else 1e-4}
        torch.testing.assert_close(torch.tensor(data["full_logprobs"]), expected, **tolerance)
        torch.testing.assert_close(torch.tensor(data["reference_logprobs"]), expected, **tolerance)


@pytest.mark.parametrize(("stage", "world"), CHECKED)
def test_non_finite_advantages_skip_the_step_on_every_rank(runs, stage, world):
    for rank in range(world):
        result = _metrics(runs[stage, world], rank)["nan_skip"]
        assert result == {
            "skipped": 1.0,
            "identical": True,
            "optimizer_unchanged": True,
            "lr_unchanged": True,
        }


@pytest.mark.parametrize(("stage", "world"), CHECKED)
def test_non_finite_raise_names_micro_batch_rank_and_quantity(runs, stage, world):
    for rank in range(world):
        data = _metrics(runs[stage, world], rank)
        assert f"non-finite advantages in micro-batch 1 on rank {world - 1}" in data["nan_raise"]
        assert data["nan_raise_identical"]


@pytest.mark.parametrize(("stage", "world"), CHECKED)
def test_non_finite_loss_from_finite_inputs_is_skipped(runs, stage, world):
    for rank in range(world):
        assert _metrics(runs[stage, world], rank)["huge_loss"] == {
            "skipped": 1.0,
            "identical": True,
            "optimizer_unchanged": True,
        }


@pytest.mark.parametrize(("stage", "world"), CHECKED)
def test_training_lowers_the_loss_on_a_fixed_batch(runs, stage, world):
    losses = _metrics(runs[stage, world])["policy_losses"]
    assert losses[-1] < losses[0] - 0.1
    assert all(b < a for a, b in itertools.pairwise(losses))


def test_zero3_loads_a_checkpoint_sharded_and_gives_the_same_logprobs_and_values(runs, tmp_path):
    from rl_learner.models import load_value_model, packed_values

    data = _metrics(runs[3, 2])
    assert data["zero3_loaded_sharded"]
    assert data["zero3_value_sharded"]
    assert data["policy_step"] == NUM_STEPS
    torch.testing.assert_close(
        torch.tensor(data["zero3_loaded_logprobs"]), torch.tensor(data["full_logprobs"]), rtol=0, atol=1e-6
    )
    # The same value model loaded without ZeRO: the seeded new head is the same on every rank.
    unsharded = load_value_model(runs[3, 2] / "tiny", dtype=torch.float32)
    with torch.no_grad():
        expected = packed_values(unsharded, experience()).float()
    torch.testing.assert_close(torch.tensor(data["zero3_values"]), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("stage", "world"), CHECKED)
def test_usage_errors_are_raised_on_every_rank(runs, stage, world):
    for rank in range(world):
        data = _metrics(runs[stage, world], rank)
        errors = data["usage_errors"]
        if world > 1:
            assert "the ranks do not all have the same number" in errors["uneven"]
        assert f"micro_batches[0].advantages is None on rank {world - 1}" in errors["unfilled"]
        assert "optimizer=None (inference only); cannot train" in data["reference_train"]


def test_step_counts_travel_as_one_float64_tensor_in_field_order():
    from rl_learner.learner import StepCounts

    counts = StepCounts(
        normalizer=3.5,
        action_tokens=7,
        sequences=2,
        micro_batches=2,
        micro_batches_squared=4,
        tokens=11,
        shared_prefix_tokens=1,
    )
    tensor = counts.to_tensor()
    assert tensor.dtype == torch.float64
    assert tensor.tolist() == [3.5, 7.0, 2.0, 2.0, 4.0, 11.0, 1.0]
    assert StepCounts.from_tensor(tensor + tensor) == StepCounts(7.0, 14.0, 4.0, 4.0, 8.0, 22.0, 2.0)
    with pytest.raises(ValueError, match=r"shape \(8,\), not \(7,\)"):
        StepCounts.from_tensor(torch.zeros(8, dtype=torch.float64))


def test_step_counts_detect_ranks_with_different_micro_batch_counts():
    from rl_learner.learner import StepCounts

    # two ranks with 2 micro-batches each, then 1 and 3
    assert StepCounts(micro_batches=4, micro_batches_squared=8).uniform_micro_batches(world_size=2)
    assert not StepCounts(micro_batches=4, micro_batches_squared=10).uniform_micro_batches(world_size=2)
