"""Ulysses sequence parallelism (`rl_learner.sequence_parallel`): with two gloo ranks sharing each
packed micro-batch, log-probs, entropies, values, scores and every parameter gradient equal the
unsplit forward's to float32 rounding (`_worker_sequence_parallel.py`), and a PolicyLearner /
ValueLearner with `sequence_parallel_size` 2 under ZeRO 0, 2 and 3 trains to the same loss, gradient
norm and weights as one rank without it, its reference (PolicyLearner without optimizer) and reward
model (ValueLearner without optimizer) give the same log-probs and scores, and the supervised
learners (SFT, DPO, reward model; ZeRO-0) give the same values, loss, metrics and every parameter
gradient (`_worker_sequence_parallel_learner.py`). Ranks run in subprocesses: the SP = 2 learner
world runs the unsplit-forward comparisons first (one two-rank world for both), beside the
one-rank reference."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from tests.learner.single_rank import start_ranks, wait_ranks

pytestmark = pytest.mark.slow  # DeepSpeed / gloo worker processes

HERE = pathlib.Path(__file__).resolve().parent
TOLERANCE = 1e-5  # float32; gradients: relative to the largest gradient element when that exceeds 1


@pytest.fixture(scope="module")
def diffs(learner_runs) -> list[dict]:
    folder = learner_runs["zero0"].parent  # `learner_runs`' SP = 2 world wrote them first
    return [json.loads((folder / f"diffs{rank}.json").read_text()) for rank in range(2)]


def test_the_batch_has_a_sequence_longer_than_a_ranks_share(diffs):
    start, end = diffs[0]["local_range"]
    assert diffs[0]["longest"] > end - start
    assert diffs[0]["odd_num_tokens"] % 2 == 1  # the padded case is covered too


@pytest.mark.parametrize("rank", [0, 1])
def test_sequence_parallel_outputs_and_gradients_equal_the_unsplit_forward(diffs, rank):
    cases = {key: value for key, value in diffs[rank].items() if key.startswith(("policy/", "critic/"))}
    assert len(cases) == 15  # 2 attentions × (4 policy + 2 critic) + odd length + checkpointing + empty
    for key, case in cases.items():
        for quantity in ("logprobs", "entropy", "values", "scores"):
            if quantity in case:
                assert case[quantity] <= TOLERANCE, (key, quantity, case[quantity])
        assert case["gradients"] <= TOLERANCE * max(1.0, case["gradient_scale"]), (key, case)
    assert diffs[rank]["policy/sdpa/share=False/only_actions=False"]["nonzero_logprobs"] > 0


def test_heads_that_do_not_divide_by_sp_are_refused_by_name(diffs):
    assert "num_key_value_heads = 2, which is not divisible by 4" in diffs[0]["heads_error"]


# ----------------------------------------------------------------------------- learners

LEARNER_WORKER = HERE / "_worker_sequence_parallel_learner.py"
SP_STAGES = (0, 2, 3)


@pytest.fixture(scope="module")
def learner_runs(tmp_path_factory) -> dict[str, pathlib.Path]:
    """The one-rank reference (ZeRO-0, SP 1) beside SP = 2 × DP = 1 under each ZeRO stage in turn
    (after the unsplit-forward comparisons of `diffs`)."""
    reference, split = tmp_path_factory.mktemp("sp1"), tmp_path_factory.mktemp("sp2")
    started = start_ranks(LEARNER_WORKER, reference, 1, "0", "1")
    started += start_ranks(LEARNER_WORKER, split, 2, ",".join(map(str, SP_STAGES)), "2", "--diffs")
    wait_ranks(started)
    return {
        "reference": reference / "zero0",
        **{f"zero{stage}": split / f"zero{stage}" for stage in SP_STAGES},
    }


def _load(folder: pathlib.Path) -> tuple[dict, dict, dict]:
    from safetensors.torch import load_file

    metrics = json.loads((folder / "metrics.json").read_text())
    return (
        metrics,
        load_file(str(folder / "policy.safetensors")),
        load_file(str(folder / "critic.safetensors")),
    )


@pytest.mark.parametrize("stage", SP_STAGES)
def test_learners_with_sequence_parallel_train_like_one_rank(learner_runs, stage):
    reference, ref_policy, ref_critic = _load(learner_runs["reference"])
    split, policy, critic = _load(learner_runs[f"zero{stage}"])
    for key in ("logprobs", "entropy", "logprobs_after", "values", "reference_logprobs", "reward_scores"):
        torch.testing.assert_close(
            torch.tensor(split[key]), torch.tensor(reference[key]), rtol=0, atol=TOLERANCE
        )
    for role in ("policy_metrics", "critic_metrics"):
        for ours, theirs in zip(split[role], reference[role], strict=True):
            assert ours.keys() == theirs.keys()
            for key, value in theirs.items():
                # a clip fraction counts tokens: one value at its clip boundary may flip (1/82 tokens)
                atol = 0.02 if key.endswith("clip_fraction") else TOLERANCE
                assert ours[key] == pytest.approx(value, rel=TOLERANCE, abs=atol), (role, key)
    for ours, theirs in ((policy, ref_policy), (critic, ref_critic)):
        assert ours.keys() == theirs.keys()
        for name in theirs:
            torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=TOLERANCE, msg=name)


def _assert_gradients_close(ours: dict, theirs: dict, prefix: str) -> None:
    """Every gradient under `prefix` within TOLERANCE × max(1, the largest element of the reference's)."""
    names = sorted(name for name in theirs if name.startswith(prefix))
    assert names
    assert names == sorted(name for name in ours if name.startswith(prefix))
    scale = max(float(theirs[name].abs().max()) for name in names)
    assert scale > 0
    for name in names:
        torch.testing.assert_close(
            ours[name], theirs[name], rtol=0, atol=TOLERANCE * max(1.0, scale), msg=name
        )


def test_learner_gradients_with_sequence_parallel_equal_one_ranks(learner_runs):
    """ZeRO-0: what the optimizer receives in each step, DeepSpeed's all-reduce over the group included."""
    from safetensors.torch import load_file

    reference = load_file(str(learner_runs["reference"] / "grads.safetensors"))
    split = load_file(str(learner_runs["zero0"] / "grads.safetensors"))
    steps = len(json.loads((learner_runs["reference"] / "metrics.json").read_text())["policy_metrics"])
    for role in ("policy", "critic"):
        for step in range(steps):
            _assert_gradients_close(split, reference, f"{role}/{step}/")


def test_ranks_of_a_group_given_different_micro_batches_are_refused(learner_runs):
    metrics = json.loads((learner_runs["zero0"] / "metrics.json").read_text())
    assert "rank 0's sequence-parallel group were given different micro-batches" in metrics["mismatch_error"]


# ----------------------------------------------------------------------------- supervised learners

SUPERVISED = ("sft", "dpo", "rm")


def _supervised(folder: pathlib.Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return (
        json.loads((folder / "supervised.json").read_text()),
        load_file(str(folder / "supervised_grads.safetensors")),
    )


def test_the_supervised_micro_batches_have_a_sequence_longer_than_a_ranks_share(learner_runs):
    split, _ = _supervised(learner_runs["zero0"])
    for kind in ("sft", "pairs"):
        assert split[f"{kind}_longest"] > split[f"{kind}_num_tokens"] / 2, kind


@pytest.mark.parametrize("kind", SUPERVISED)
def test_supervised_learners_with_sequence_parallel_equal_one_rank(learner_runs, kind):
    reference, reference_grads = _supervised(learner_runs["reference"])
    split, split_grads = _supervised(learner_runs["zero0"])
    # per-token log-probs (SFT; DPO: the reference's, then the policy's) or per-sequence scores (RM)
    for ours, theirs in zip(split[kind]["values"], reference[kind]["values"], strict=True):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=0, atol=TOLERANCE)
    assert any(len(values) for values in reference[kind]["values"])
    ours, theirs = split[kind]["metrics"], reference[kind]["metrics"]
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():  # loss, pairs, accuracy, margins, grad_norm, tokens...
        assert ours[key] == pytest.approx(value, rel=TOLERANCE, abs=TOLERANCE), (kind, key)
    _assert_gradients_close(split_grads, reference_grads, f"{kind}/")
