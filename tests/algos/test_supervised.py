"""Tests for rl_algos.supervised: SFT, distillation and process-reward-model losses."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import rl_algos.supervised as supervised
from rl_algos.supervised import distillation_loss, prm_loss, sft_loss

FAST = settings(max_examples=25, deadline=None)


def random_batch(batch: int, seq: int, seed: int, density: float = 0.6) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logprobs = -5 * torch.rand(batch, seq, generator=generator)
    mask = torch.rand(batch, seq, generator=generator) < density
    mask[0, 0] = True  # at least one loss token
    return logprobs, mask


def random_logits(
    batch: int, seq: int, vocab: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    student = 3 * torch.randn(batch, seq, vocab, generator=generator)
    teacher = 3 * torch.randn(batch, seq, vocab, generator=generator)
    labels = torch.randint(0, vocab, (batch, seq), generator=generator)
    return student, teacher, labels


# ----------------------------------------------------------------------------------------- SFT


def test_sft_loss_golden_value_is_token_mean_nll() -> None:
    # unmasked log-probs -1, -2 (row 0) and -0.5 (row 1): (1 + 2 + 0.5) / 3 = 1.1666666667
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, metrics = sft_loss(logprobs, mask)
    assert loss.dim() == 0
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, torch.tensor(3.5 / 3))
    torch.testing.assert_close(metrics["nll"], torch.tensor(3.5 / 3))
    torch.testing.assert_close(metrics["num_tokens"], torch.tensor(3.0))


def test_sft_loss_with_normalizer_divides_by_it() -> None:
    # same sum 3.5, divided by the given global count 7 -> 0.5; the logged nll stays the local mean
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -9.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, metrics = sft_loss(logprobs, mask, normalizer=7)
    torch.testing.assert_close(loss, torch.tensor(0.5))
    torch.testing.assert_close(metrics["nll"], torch.tensor(3.5 / 3))
    loss_tensor_norm, _ = sft_loss(logprobs, mask, normalizer=torch.tensor(7))
    torch.testing.assert_close(loss_tensor_norm, torch.tensor(0.5))


@FAST
@given(
    seed=st.integers(0, 2**16),
    cuts=st.lists(st.integers(1, 7), max_size=4, unique=True),
)
def test_sft_loss_micro_batches_with_global_normalizer_sum_to_full_batch(seed: int, cuts: list[int]) -> None:
    logprobs, mask = random_batch(batch=8, seq=6, seed=seed)
    full_input = logprobs.clone().requires_grad_()
    full, _ = sft_loss(full_input, mask)
    full.backward()

    split_input = logprobs.clone().requires_grad_()
    global_count = int(mask.sum())
    bounds = [0, *sorted(cuts), 8]
    total = torch.zeros(())
    for start, stop in itertools.pairwise(bounds):
        micro, _ = sft_loss(split_input[start:stop], mask[start:stop], normalizer=global_count)
        micro.backward()  # gradient accumulation, as a training loop would do it
        total = total + micro.detach()

    torch.testing.assert_close(total, full.detach())
    torch.testing.assert_close(split_input.grad, full_input.grad)


def test_sft_loss_masked_tokens_get_zero_gradient_even_if_infinite() -> None:
    logprobs = torch.tensor([[-1.0, -math.inf, -2.0], [float("nan"), -0.5, -1.0]], requires_grad=True)
    mask = torch.tensor([[1, 0, 1], [0, 1, 1]])
    loss, _ = sft_loss(logprobs, mask)
    loss.backward()
    # (1 + 2 + 0.5 + 1) / 4 = 1.125, each unmasked token's gradient is -1/4
    torch.testing.assert_close(loss, torch.tensor(1.125))
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.25, 0.0, -0.25], [0.0, -0.25, -0.25]]))


def test_sft_loss_all_masked_micro_batch_is_zero_and_backpropagates() -> None:
    logprobs = torch.full((2, 3), -1.0, requires_grad=True)
    loss, metrics = sft_loss(logprobs, torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0
    assert metrics["num_tokens"].item() == 0.0
    assert torch.equal(logprobs.grad, torch.zeros(2, 3))


def test_sft_loss_bf16_inputs_give_float32_close_to_fp32() -> None:
    logprobs, mask = random_batch(batch=4, seq=16, seed=5)
    loss, _ = sft_loss(logprobs.bfloat16(), mask)
    assert loss.dtype == torch.float32
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, sft_loss(logprobs.bfloat16().float(), mask)[0])
    torch.testing.assert_close(loss, sft_loss(logprobs, mask)[0], rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (
            (torch.zeros(2, 3), torch.ones(2, 4)),
            {},
            ValueError,
            r"loss_mask has shape \(2, 4\) but logprobs has shape \(2, 3\)",
        ),
        ((torch.zeros(6), torch.ones(6)), {}, ValueError, r"logprobs must have shape \[batch, seq\]"),
        (
            (torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3)),
            {},
            TypeError,
            r"logprobs must be a floating-point",
        ),
        ((torch.zeros(2, 3), torch.ones(2, 3)), {"normalizer": 0}, ValueError, r"normalizer must be > 0"),
        (
            (torch.zeros(2, 3), torch.ones(2, 3)),
            {"normalizer": "all"},
            TypeError,
            r"normalizer must be a number",
        ),
        (
            (torch.zeros(2, 3), torch.ones(2, 3)),
            {"normalizer": torch.ones(2)},
            ValueError,
            r"normalizer must be .* one-element",
        ),
    ],
)
def test_sft_loss_rejects_bad_inputs(args: tuple, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        sft_loss(*args, **kwargs)


# -------------------------------------------------------------------------------- distillation


def test_distillation_loss_golden_value() -> None:
    # student p = softmax(0, ln 3) = (0.25, 0.75), teacher p = (0.5, 0.5), label 0
    # CE = -ln 0.25 = 1.3862943611
    # soft = -(0.5·ln 0.25 + 0.5·ln 0.75) = 0.5·(1.3862943611 + 0.2876820725) = 0.8369882168
    # α = 0.4: 0.6·1.3862943611 + 0.4·0.8369882168 = 0.8317766167 + 0.3347952867 = 1.1665719034
    student = torch.tensor([[[0.0, math.log(3.0)]]], requires_grad=True)
    teacher = torch.zeros(1, 1, 2)
    loss, metrics = distillation_loss(student, teacher, torch.tensor([[0]]), torch.tensor([[1]]))
    torch.testing.assert_close(loss, torch.tensor(1.1665719034))
    torch.testing.assert_close(metrics["ce"], torch.tensor(1.3862943611))
    torch.testing.assert_close(metrics["distill"], torch.tensor(0.8369882168))
    loss.backward()
    # d/ds = 0.6·(p - onehot) + 0.4·(p - p_teacher) = 0.6·(-0.75, 0.75) + 0.4·(-0.25, 0.25) = (-0.55, 0.55)
    torch.testing.assert_close(student.grad, torch.tensor([[[-0.55, 0.55]]]))


def test_distillation_loss_temperature_softens_only_the_soft_term() -> None:
    # student logits (0, 2 ln 3): at T = 1 p = (0.1, 0.9), CE(label 0) = ln 10 = 2.302585093
    # at T = 2 both logits are halved: student (0.25, 0.75), teacher (0.5, 0.5) -> soft 0.8369882168
    # α = 0.5: 0.5·2.302585093 + 0.5·0.8369882168 = 1.5697866549
    student = torch.tensor([[[0.0, 2 * math.log(3.0)]]])
    loss, metrics = distillation_loss(
        student, torch.zeros(1, 1, 2), torch.tensor([[0]]), torch.ones(1, 1), alpha=0.5, temperature=2.0
    )
    torch.testing.assert_close(metrics["ce"], torch.tensor(2.302585093))
    torch.testing.assert_close(metrics["distill"], torch.tensor(0.8369882168))
    torch.testing.assert_close(loss, torch.tensor(1.5697866549))


def test_distillation_loss_fractional_mask_weights_tokens() -> None:
    # the golden token (loss 1.1665719034) weighted 0.5, divided by normalizer 1 -> 0.5832859517
    student = torch.tensor([[[0.0, math.log(3.0)]]])
    loss, _ = distillation_loss(
        student, torch.zeros(1, 1, 2), torch.tensor([[0]]), torch.tensor([[0.5]]), normalizer=1
    )
    torch.testing.assert_close(loss, torch.tensor(0.5832859517))


def test_distillation_loss_with_alpha_zero_equals_cross_entropy() -> None:
    student, teacher, labels = random_logits(batch=3, seq=5, vocab=11, seed=0)
    _, mask = random_batch(batch=3, seq=5, seed=1)
    loss, _ = distillation_loss(student, teacher, labels, mask, alpha=0.0)
    expected = F.cross_entropy(student[mask], labels[mask])
    torch.testing.assert_close(loss, expected)


def test_distillation_loss_with_teacher_equal_student_and_alpha_one_is_entropy() -> None:
    student, _, labels = random_logits(batch=2, seq=4, vocab=7, seed=2)
    mask = torch.ones(2, 4)
    loss, _ = distillation_loss(student, student.clone(), labels, mask, alpha=1.0)
    p = torch.softmax(student, dim=-1)
    entropy = -(p * torch.log(p)).sum(-1).mean()
    torch.testing.assert_close(loss, entropy)


def test_distillation_loss_masked_tokens_get_zero_gradient() -> None:
    student, teacher, labels = random_logits(batch=2, seq=3, vocab=5, seed=3)
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    student[0, 1] = float("nan")  # garbage at a masked position must not leak
    labels[1, 0] = -100
    student.requires_grad_()
    loss, _ = distillation_loss(student, teacher, labels, mask)
    loss.backward()
    assert torch.isfinite(loss)
    masked = mask == 0
    assert torch.equal(student.grad[masked], torch.zeros(3, 5))
    assert (student.grad[~masked].abs().sum(-1) > 0).all()


def test_distillation_loss_teacher_gets_no_gradient() -> None:
    student, teacher, labels = random_logits(batch=1, seq=2, vocab=4, seed=4)
    student.requires_grad_()
    teacher.requires_grad_()
    distillation_loss(student, teacher, labels, torch.ones(1, 2))[0].backward()
    assert teacher.grad is None
    assert student.grad is not None


@pytest.mark.parametrize("rows_per_chunk", [1, 5])
def test_distillation_loss_chunked_rows_match_single_chunk(
    monkeypatch: pytest.MonkeyPatch, rows_per_chunk: int
) -> None:
    student, teacher, labels = random_logits(batch=3, seq=4, vocab=6, seed=5)
    _, mask = random_batch(batch=3, seq=4, seed=6)
    whole_input = student.clone().requires_grad_()
    whole, whole_metrics = distillation_loss(whole_input, teacher, labels, mask, temperature=1.5)
    whole.backward()

    # 12 rows in chunks of 1 or 5 (the last one short), some chunks without a loss token.
    monkeypatch.setattr(supervised, "_CHUNK_ELEMENTS", rows_per_chunk * 6)
    chunked_input = student.clone().requires_grad_()
    chunked, chunked_metrics = distillation_loss(chunked_input, teacher, labels, mask, temperature=1.5)
    chunked.backward()
    torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(chunked_input.grad, whole_input.grad)
    torch.testing.assert_close(chunked_metrics["distill"], whole_metrics["distill"])
    with torch.no_grad():  # the path without activation checkpointing
        torch.testing.assert_close(
            distillation_loss(student, teacher, labels, mask, temperature=1.5)[0], whole.detach()
        )


def test_distillation_loss_all_masked_micro_batch_is_zero_and_backpropagates() -> None:
    student, teacher, labels = random_logits(batch=2, seq=2, vocab=4, seed=14)
    student.requires_grad_()
    loss, metrics = distillation_loss(student, teacher, labels, torch.zeros(2, 2), normalizer=10)
    loss.backward()
    assert loss.item() == 0.0
    assert metrics["num_tokens"].item() == 0.0
    assert torch.equal(student.grad, torch.zeros(2, 2, 4))


def test_distillation_loss_micro_batches_with_global_normalizer_sum_to_full_batch() -> None:
    student, teacher, labels = random_logits(batch=4, seq=3, vocab=5, seed=7)
    _, mask = random_batch(batch=4, seq=3, seed=8)
    full, _ = distillation_loss(student, teacher, labels, mask)
    count = mask.sum()
    parts = [
        distillation_loss(student[s], teacher[s], labels[s], mask[s], normalizer=count)[0]
        for s in (slice(0, 1), slice(1, 4))
    ]
    torch.testing.assert_close(parts[0] + parts[1], full)


def test_distillation_loss_ignores_vocab_entries_the_teacher_rules_out() -> None:
    # -inf in both at entry 2 (e.g. padded vocabulary): 0·log 0 counts as 0, not NaN
    student = torch.tensor([[[0.0, math.log(3.0), -math.inf]]], requires_grad=True)
    teacher = torch.tensor([[[0.0, 0.0, -math.inf]]])
    loss, metrics = distillation_loss(student, teacher, torch.tensor([[0]]), torch.ones(1, 1), alpha=1.0)
    torch.testing.assert_close(metrics["distill"], torch.tensor(0.8369882168))
    loss.backward()
    assert torch.isfinite(student.grad).all()


def test_distillation_loss_bf16_inputs_give_float32_close_to_fp32() -> None:
    student, teacher, labels = random_logits(batch=2, seq=6, vocab=32, seed=9)
    _, mask = random_batch(batch=2, seq=6, seed=10)
    loss, _ = distillation_loss(student.bfloat16(), teacher.bfloat16(), labels, mask, temperature=2.0)
    assert loss.dtype == torch.float32
    assert torch.isfinite(loss)
    rounded, _ = distillation_loss(
        student.bfloat16().float(), teacher.bfloat16().float(), labels, mask, temperature=2.0
    )
    torch.testing.assert_close(loss, rounded)
    exact, _ = distillation_loss(student, teacher, labels, mask, temperature=2.0)
    torch.testing.assert_close(loss, exact, rtol=2e-2, atol=2e-2)


def test_distillation_loss_bf16_gradient_has_input_dtype() -> None:
    student, teacher, labels = random_logits(batch=1, seq=3, vocab=8, seed=11)
    low = student.bfloat16().requires_grad_()
    distillation_loss(low, teacher.bfloat16(), labels, torch.ones(1, 3))[0].backward()
    assert low.grad.dtype == torch.bfloat16
    assert torch.isfinite(low.grad).all()


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"alpha": 1.5}, ValueError, r"alpha must be in \[0, 1\]"),
        ({"alpha": -0.1}, ValueError, r"alpha must be in \[0, 1\]"),
        ({"temperature": 0.0}, ValueError, r"temperature must be > 0"),
        (
            {"teacher_logits": torch.zeros(2, 3, 4)},
            ValueError,
            r"teacher_logits has shape \(2, 3, 4\) but student_logits has shape \(2, 3, 5\)",
        ),
        (
            {"student_logits": torch.zeros(6, 5)},
            ValueError,
            r"student_logits must have shape \[batch, seq, vocab\]",
        ),
        (
            {"labels": torch.zeros(2, 4, dtype=torch.long)},
            ValueError,
            r"labels must have shape \[batch, seq\] = \(2, 3\), got \(2, 4\)",
        ),
        ({"labels": torch.zeros(2, 3)}, TypeError, r"labels must be an integer tensor"),
        (
            {"loss_mask": torch.ones(3, 2)},
            ValueError,
            r"loss_mask has shape \(3, 2\) but labels has shape \(2, 3\)",
        ),
        ({"normalizer": -3.0}, ValueError, r"normalizer must be > 0"),
    ],
)
def test_distillation_loss_rejects_bad_inputs(change: dict, error: type, match: str) -> None:
    args = {
        "student_logits": torch.zeros(2, 3, 5),
        "teacher_logits": torch.zeros(2, 3, 5),
        "labels": torch.zeros(2, 3, dtype=torch.long),
        "loss_mask": torch.ones(2, 3),
    }
    args.update(change)
    with pytest.raises(error, match=match):
        distillation_loss(**args)


# ----------------------------------------------------------------------------------------- PRM

REWARD_IDS = [3, 1]


def prm_logits() -> torch.Tensor:
    # vocab 5, reward tokens (3, 1); position 0: logits (ln 3, 0) -> q = (0.75, 0.25);
    # position 2: logits (0, ln 2) -> q = (1/3, 2/3). Token 0 is the most likely token of the
    # whole vocabulary everywhere, which must not matter.
    logits = torch.zeros(1, 3, 5)
    logits[..., 0] = 10.0
    logits[0, 0, 3] = math.log(3.0)
    logits[0, 2, 1] = math.log(2.0)
    return logits


def test_prm_loss_golden_value_with_hard_labels() -> None:
    # both placeholders labelled token 3 (class 0):
    # position 0: -ln 0.75 = 0.2876820725 (argmax class 0: correct)
    # position 2: -ln (1/3) = 1.0986122887 (argmax class 1: wrong)
    # mean (0.2876820725 + 1.0986122887) / 2 = 0.6931471806, accuracy 0.5
    labels = torch.tensor([[3, -100, 3]])
    mask = torch.tensor([[1, 0, 1]])
    loss, metrics = prm_loss(prm_logits(), labels, mask, REWARD_IDS)
    torch.testing.assert_close(loss, torch.tensor(0.6931471806))
    torch.testing.assert_close(metrics["accuracy"], torch.tensor(0.5))
    torch.testing.assert_close(metrics["num_tokens"], torch.tensor(2.0))


def test_prm_loss_golden_value_with_soft_labels() -> None:
    # targets over (token 3, token 1): position 0 (0.25, 0.75), position 2 (0.2, 0.8)
    # position 0: -(0.25·ln 0.75 + 0.75·ln 0.25) = 0.0719205181 + 1.0397207708 = 1.1116412889
    # position 2: -(0.2·ln(1/3) + 0.8·ln(2/3)) = 0.2197224577 + 0.3243720865 = 0.5440945442
    # mean 0.8278679166; accuracy: position 0 wrong (0 vs 1), position 2 right (1 vs 1) -> 0.5
    labels = torch.tensor([[[0.25, 0.75], [float("nan"), float("nan")], [0.2, 0.8]]])
    logits = prm_logits().requires_grad_()
    loss, metrics = prm_loss(logits, labels, torch.tensor([[True, False, True]]), torch.tensor(REWARD_IDS))
    torch.testing.assert_close(loss, torch.tensor(0.8278679166))
    torch.testing.assert_close(metrics["accuracy"], torch.tensor(0.5))
    loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_prm_loss_one_hot_soft_labels_equal_hard_labels() -> None:
    hard = torch.tensor([[1, 0, 3]])
    soft = torch.tensor([[[0.0, 1.0], [0.5, 0.5], [1.0, 0.0]]])
    mask = torch.tensor([[1, 0, 1]])
    torch.testing.assert_close(
        prm_loss(prm_logits(), soft, mask, REWARD_IDS)[0], prm_loss(prm_logits(), hard, mask, REWARD_IDS)[0]
    )


def test_prm_loss_gradient_only_reaches_reward_tokens_at_placeholders() -> None:
    logits = prm_logits()
    logits[0, 1] = float("nan")  # garbage off the placeholders must not leak
    logits.requires_grad_()
    loss, _ = prm_loss(logits, torch.tensor([[1, 7, 3]]), torch.tensor([[1, 0, 1]]), REWARD_IDS)
    loss.backward()
    assert torch.isfinite(loss)
    grad = logits.grad[0]
    assert torch.equal(grad[1], torch.zeros(5))
    assert torch.equal(grad[:, [0, 2, 4]], torch.zeros(3, 3))
    # position 0, label token 1 (class 1), q = (0.75, 0.25): d/dlogit = (q - onehot) / 2 = (0.375, -0.375)
    torch.testing.assert_close(grad[0, [3, 1]], torch.tensor([0.375, -0.375]))


def test_prm_loss_label_outside_reward_tokens_names_position_and_ids() -> None:
    labels = torch.tensor([[3, 4, 2]])
    with pytest.raises(
        ValueError, match=r"labels\[0, 2\] = 2 at a placeholder is not one of reward_token_ids \[3, 1\]"
    ):
        prm_loss(prm_logits(), labels, torch.tensor([[1, 0, 1]]), REWARD_IDS)


def test_prm_loss_bf16_logits_give_float32_close_to_fp32() -> None:
    logits = prm_logits() + torch.randn(1, 3, 5, generator=torch.Generator().manual_seed(0))
    labels, mask = torch.tensor([[1, 0, 3]]), torch.tensor([[1, 0, 1]])
    loss, _ = prm_loss(logits.bfloat16(), labels, mask, REWARD_IDS)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, prm_loss(logits.bfloat16().float(), labels, mask, REWARD_IDS)[0])
    torch.testing.assert_close(loss, prm_loss(logits, labels, mask, REWARD_IDS)[0], rtol=2e-2, atol=2e-2)


def test_prm_loss_with_global_normalizer() -> None:
    # sum 0.6931471806·2 = 1.3862943611 over a global count of 4 -> 0.3465735903
    loss, _ = prm_loss(
        prm_logits(), torch.tensor([[3, -100, 3]]), torch.tensor([[1, 0, 1]]), REWARD_IDS, normalizer=4
    )
    torch.testing.assert_close(loss, torch.tensor(0.3465735903))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"reward_token_ids": [3]}, ValueError, r"reward_token_ids must hold at least 2 distinct"),
        ({"reward_token_ids": [3, 3]}, ValueError, r"reward_token_ids must hold at least 2 distinct"),
        ({"reward_token_ids": [3, 5]}, ValueError, r"reward_token_ids must be in \[0, vocab\) = \[0, 5\)"),
        ({"reward_token_ids": [3, 1.0]}, TypeError, r"reward_token_ids must be integers"),
        (
            {"reward_token_ids": torch.tensor([3.0, 1.0])},
            TypeError,
            r"reward_token_ids must be an integer tensor",
        ),
        (
            {"labels": torch.zeros(1, 3, 3)},
            ValueError,
            r"labels must have shape \[batch, seq, num_reward_tokens\] = \(1, 3, 2\)",
        ),
        (
            {"labels": torch.zeros(1, 4, dtype=torch.long)},
            ValueError,
            r"labels must have shape \[batch, seq\] = \(1, 3\)",
        ),
        ({"placeholder_mask": torch.ones(3)}, ValueError, r"placeholder_mask must have shape \[batch, seq\]"),
        ({"logits": torch.zeros(3, 5)}, ValueError, r"logits must have shape \[batch, seq, vocab\]"),
    ],
)
def test_prm_loss_rejects_bad_inputs(change: dict, error: type, match: str) -> None:
    args = {
        "logits": prm_logits(),
        "labels": torch.tensor([[3, 0, 1]]),
        "placeholder_mask": torch.tensor([[1, 0, 1]]),
        "reward_token_ids": REWARD_IDS,
    }
    args.update(change)
    with pytest.raises(error, match=match):
        prm_loss(**args)


@pytest.mark.gpu
def test_supervised_losses_on_cuda_match_cpu() -> None:
    student, teacher, labels = random_logits(batch=2, seq=5, vocab=16, seed=12)
    logprobs, mask = random_batch(batch=2, seq=5, seed=13)
    cuda = torch.device("cuda")
    sft_cuda, _ = sft_loss(logprobs.to(cuda).bfloat16(), mask.to(cuda))
    assert sft_cuda.is_cuda
    torch.testing.assert_close(sft_cuda.cpu(), sft_loss(logprobs.bfloat16(), mask)[0])
    student_cuda = student.to(cuda).bfloat16().requires_grad_()
    kd, _ = distillation_loss(student_cuda, teacher.to(cuda).bfloat16(), labels.to(cuda), mask.to(cuda))
    kd.backward()
    torch.testing.assert_close(
        kd.cpu(), distillation_loss(student.bfloat16(), teacher.bfloat16(), labels, mask)[0]
    )
    assert torch.isfinite(student_cuda.grad).all()
    prm, _ = prm_loss(student.to(cuda), labels.to(cuda) % 2, mask.to(cuda), [0, 1])
    torch.testing.assert_close(prm.cpu(), prm_loss(student, labels % 2, mask, [0, 1])[0])
