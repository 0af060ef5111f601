"""Supervised token losses: fine-tuning on demonstrations, distillation and process reward models.

These losses score individual tokens against a target (a label token, a teacher's distribution,
a step label) rather than sequences against each other. Each takes a `[batch, seq]` 0/1 mask of
the tokens that count and returns `(loss, metrics)`: a float32 scalar to call `.backward()` on
and a dict of detached 0-d tensors worth logging.

Token-mean normalisation: the loss is Σ_tokens ℓ·m / N. With gradient accumulation or data
parallelism, pass `normalizer` = the number of loss tokens in the whole optimiser step (every
micro-batch on every rank), so that the per-micro-batch losses add up to the token mean of the
full batch and long and short micro-batches weigh tokens equally. Under DDP/FSDP, which average
gradients over ranks, that means the global count divided by the world size. Without it, N is
the local Σ m (the mean over this micro-batch), which up-weights tokens of sparse micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from ._checks import (
    check_floating,
    check_integer,
    check_ndim,
    check_positive,
    check_probability,
    check_same_shape,
    check_shape,
)
from .aggregation import resolve_normalizer

__all__ = ["distillation_loss", "prm_loss", "sft_loss"]

Normalizer = float | int | torch.Tensor | None

_CHUNK_ELEMENTS = 1 << 24
"""Rows of a `[rows, vocab]` block processed at once hold about this many logits (64 MiB in float32)."""


def _check_mask(mask: torch.Tensor, like: torch.Tensor, like_name: str) -> torch.Tensor:
    """`loss_mask` (bool, integer or float 0/1) of `like`'s shape, as float32."""
    # Not mask_as(): it casts to `like`'s dtype, and `like` may be integer labels.
    check_same_shape("loss_mask", mask, like_name, like)
    if mask.is_complex():
        raise TypeError(f"loss_mask must be a bool, integer or float tensor of 0/1, got dtype {mask.dtype}")
    return mask.float()


def sft_loss(
    logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    normalizer: Normalizer = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Supervised fine-tuning loss: token-mean negative log-likelihood of the target tokens.

      L = −Σ_{b,t} m_{b,t}·log π(y_{b,t} | x_b, y_{b,<t}) / N

    where N is `normalizer` or Σ m. The mask selects the tokens to imitate: in multi-turn data
    it covers every assistant turn and excludes the system, user and tool turns.

    Args:
      logprobs: `[batch, seq]` log π of each label token (e.g. gathered from a log-softmax of
        the logits at the shifted labels), any float dtype.
      loss_mask: `[batch, seq]` 1 (or True) on tokens that count, 0 elsewhere. Values of
        `logprobs` where the mask is 0 are ignored, even if infinite or NaN.
      normalizer: N, the number of loss tokens in the whole optimiser step (see the module
        docstring): a positive number or a one-element tensor. None: the local Σ m.

    Returns:
      (loss, metrics): loss a float32 scalar; metrics "nll" (the local token mean, whatever
      the normaliser, for logging) and "num_tokens" (local Σ m).
    """
    check_ndim("logprobs", logprobs, 2, "[batch, seq]")
    check_floating("logprobs", logprobs)
    mask = _check_mask(loss_mask, logprobs, "logprobs")

    # where rather than multiplication: padding positions may hold -inf, and -inf * 0 is NaN.
    nll = torch.where(mask > 0, -logprobs.float(), 0.0)
    total = (nll * mask).sum()
    count = mask.sum()
    loss = total / resolve_normalizer(normalizer, count)
    with torch.no_grad():
        metrics = {"nll": total.detach() / count.clamp(min=1), "num_tokens": count}
    return loss, metrics


def _distillation_rows(
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    rows: torch.Tensor,
    alpha: float,
    temperature: float,
) -> torch.Tensor:
    """Hard and soft per-token terms, `[2, len(rows)]`, at `rows` of `[n, vocab]` logits."""
    s = student.index_select(0, rows).float()
    y = labels.index_select(0, rows)
    zero = s.new_zeros(())
    hard = soft = s.new_zeros(rows.shape)
    # A term with weight 0 is skipped, not multiplied by 0: it may be infinite (a label the
    # student gives probability 0), and 0 * inf would turn the loss into NaN.
    if alpha < 1:
        log_p = torch.log_softmax(s, dim=-1)
        hard = -log_p.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    if alpha > 0:
        log_q_student = torch.log_softmax(s / temperature, dim=-1)
        p_teacher = torch.softmax(teacher.index_select(0, rows).float() / temperature, dim=-1)
        # Vocabulary entries the teacher rules out (p = 0) contribute 0 by the 0·log 0 = 0
        # convention even where the student's log-prob is -inf (e.g. masked padding logits).
        soft = -torch.where(p_teacher > 0, p_teacher * log_q_student, zero).sum(-1)
    return torch.stack([hard, soft])


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    alpha: float = 0.4,
    temperature: float = 1.0,
    normalizer: Normalizer = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Knowledge distillation: cross-entropy on the labels mixed with the teacher's soft targets.

    Per token, with p_S = softmax(s), and p_S^T, p_T^T the student's and teacher's softmax at
    temperature T,

      ℓ = (1 − α)·(−log p_S(y)) + α·(−Σ_v p_T^T(v)·log p_S^T(v)),
      L = Σ_{b,t} m_{b,t}·ℓ_{b,t} / N.

    The soft term is the cross-entropy H(p_T^T, p_S^T) = KL(p_T^T ‖ p_S^T) + H(p_T^T); the
    teacher's entropy does not depend on the student, so the gradient is that of the forward KL.
    Hinton et al. multiply the soft term by T² to keep its gradient scale independent of T; this
    function does not (at the default T = 1 the two agree), so fold T² into α if you want it.
    The teacher is a fixed target: its logits are detached.

    Memory: the vocabulary-sized work runs over chunks of rows, on the masked-in rows of each
    chunk only, with activation checkpointing (each chunk's float32 intermediates are
    recomputed in the backward pass), so float32 copies of the logits exist for one chunk at a
    time rather than for every token. Finding the masked-in rows reads the mask's values (a
    device synchronisation).

    See "Distilling the Knowledge in a Neural Network" by Hinton et al. 2015
    (https://arxiv.org/abs/1503.02531).

    Args:
      student_logits: `[batch, seq, vocab]` logits s of the model being trained, any float dtype,
        aligned with `labels` (position t predicts labels[:, t]).
      teacher_logits: `[batch, seq, vocab]` logits of the teacher at the same positions.
      labels: `[batch, seq]` integer target token ids; ignored where the mask is 0 (so -100
        padding is fine), in [0, vocab) elsewhere.
      loss_mask: `[batch, seq]` 1 (or True) on tokens that count, 0 elsewhere.
      alpha: α in [0, 1], the weight of the soft (teacher) term; 0 is plain cross-entropy.
      temperature: T > 0, the softening temperature of both distributions in the soft term.
      normalizer: N, the number of loss tokens in the whole optimiser step (see the module
        docstring). None: the local Σ m.

    Returns:
      (loss, metrics): loss a float32 scalar; metrics "ce" and "distill" (local token means of
      the hard and soft terms; a term whose weight is 0 is not computed and reads 0) and
      "num_tokens" (local Σ m).
    """
    check_probability("alpha", alpha)
    check_positive("temperature", temperature)
    check_ndim("student_logits", student_logits, 3, "[batch, seq, vocab]")
    check_floating("student_logits", student_logits)
    check_same_shape("teacher_logits", teacher_logits, "student_logits", student_logits)
    check_floating("teacher_logits", teacher_logits)
    batch, seq, vocab = student_logits.shape
    check_shape("labels", labels, (batch, seq), "[batch, seq]")
    check_integer("labels", labels)
    mask = _check_mask(loss_mask, labels, "labels")
    if vocab == 0:
        raise ValueError("student_logits has an empty vocab dimension (shape [batch, seq, 0])")

    rows_total = batch * seq
    student = student_logits.reshape(rows_total, vocab)
    teacher = teacher_logits.detach().reshape(rows_total, vocab)
    flat_labels = labels.reshape(-1).long()
    flat_mask = mask.reshape(-1)

    # The empty slice's sum is a zero that is still attached to the graph, so that a micro-batch
    # without loss tokens can still call backward() (and DDP sees a gradient for every rank).
    sums = student.new_zeros(2, dtype=torch.float32) + student[:0].float().sum()
    chunk = max(1, _CHUNK_ELEMENTS // vocab)
    rows = flat_mask.nonzero().squeeze(-1)
    if rows.numel() > 0:
        num_chunks = -(-rows_total // chunk)
        per_chunk = torch.bincount(rows // chunk, minlength=num_chunks).tolist()
        recompute = torch.is_grad_enabled() and student.requires_grad
        # torch.split rather than per-chunk indexing of the whole tensor: split's backward
        # concatenates the chunks' gradients once, where indexing would build (and add up) a
        # zero-filled gradient of the full [rows, vocab] size for every chunk.
        pieces = zip(
            range(0, rows_total, chunk),
            student.split(chunk),
            teacher.split(chunk),
            flat_labels.split(chunk),
            rows.split(per_chunk),
        )
        for start, student_part, teacher_part, label_part, chunk_rows in pieces:
            if chunk_rows.numel() == 0:
                continue
            args = (student_part, teacher_part, label_part, chunk_rows - start, alpha, temperature)
            if recompute:
                terms = checkpoint(_distillation_rows, *args, use_reentrant=False, preserve_rng_state=False)
            else:
                terms = _distillation_rows(*args)
            # Weighted by the mask rather than summed: masks may be fractional weights.
            sums = sums + (terms * flat_mask.index_select(0, chunk_rows)).sum(-1)

    count = mask.sum()
    hard_sum, soft_sum = sums[0], sums[1]
    loss = ((1 - alpha) * hard_sum + alpha * soft_sum) / resolve_normalizer(normalizer, count)
    with torch.no_grad():
        local = count.clamp(min=1)
        metrics = {"ce": hard_sum.detach() / local, "distill": soft_sum.detach() / local, "num_tokens": count}
    return loss, metrics


def prm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    placeholder_mask: torch.Tensor,
    reward_token_ids: Sequence[int] | torch.Tensor,
    *,
    normalizer: Normalizer = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Process reward model loss: classify each reasoning step with a few reward tokens.

    A step's verdict is read at a placeholder token that ends it. Only the K reward tokens
    (e.g. "+" and "-") compete there, so the classifier is the softmax over their logits:

      q_{b,t} = softmax(logits_{b,t}[reward_token_ids])          (K classes)
      hard labels:  ℓ_{b,t} = −log q_{b,t}(k)  with reward_token_ids[k] = labels_{b,t}
      soft labels:  ℓ_{b,t} = −Σ_k labels_{b,t,k}·log q_{b,t}(k)
      L = Σ_{b,t} m_{b,t}·ℓ_{b,t} / N,   m = placeholder_mask.

    The step reward at inference is then q(k_good), e.g. the probability of "+".

    See "Let's Verify Step by Step" by Lightman et al. 2023 (https://arxiv.org/abs/2305.20050).

    Args:
      logits: `[batch, seq, vocab]` logits of the language model, any float dtype, aligned with
        `labels` (position t predicts labels[:, t]).
      labels: either `[batch, seq]` integer token ids (each, at placeholder positions, one of
        `reward_token_ids`; ignored elsewhere, so -100 padding is fine), or a
        `[batch, seq, K]` float tensor of target probabilities over the reward tokens, in the
        order of `reward_token_ids` (values are not checked).
      placeholder_mask: `[batch, seq]` 1 (or True) at the step-end positions, 0 elsewhere.
      reward_token_ids: the K ≥ 2 distinct token ids of the verdicts, a sequence of ints or a
        1-D integer tensor, each in [0, vocab).
      normalizer: N, the number of placeholders in the whole optimiser step (see the module
        docstring). None: the local Σ m.

    Returns:
      (loss, metrics): loss a float32 scalar; metrics "accuracy" (fraction of placeholders
      whose most likely reward token is the label, or the label's most probable token for soft
      labels) and "num_tokens" (local number of placeholders).

    Raises:
      ValueError: a hard label at a placeholder is not one of `reward_token_ids` (this reads
        the labels' values, one device synchronisation).
    """
    check_ndim("logits", logits, 3, "[batch, seq, vocab]")
    check_floating("logits", logits)
    batch, seq, vocab = logits.shape
    if isinstance(reward_token_ids, torch.Tensor):
        check_ndim("reward_token_ids", reward_token_ids, 1, "[num_reward_tokens]")
        check_integer("reward_token_ids", reward_token_ids)
        ids = [int(i) for i in reward_token_ids.tolist()]
    else:
        ids = list(reward_token_ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TypeError(f"reward_token_ids must be integers, got {ids!r}")
    if len(ids) < 2 or len(set(ids)) != len(ids):
        raise ValueError(f"reward_token_ids must hold at least 2 distinct token ids, got {ids}")
    if any(not 0 <= i < vocab for i in ids):
        raise ValueError(f"reward_token_ids must be in [0, vocab) = [0, {vocab}), got {ids}")
    num_classes = len(ids)
    soft = isinstance(labels, torch.Tensor) and labels.is_floating_point()
    if soft:
        check_shape("labels", labels, (batch, seq, num_classes), "[batch, seq, num_reward_tokens]")
    else:
        check_shape("labels", labels, (batch, seq), "[batch, seq]")
        check_integer("labels", labels)
    check_shape("placeholder_mask", placeholder_mask, (batch, seq), "[batch, seq]")
    mask = placeholder_mask.float()

    id_tensor = torch.tensor(ids, device=logits.device, dtype=torch.long)
    at_placeholder = mask > 0
    # Gather the K columns before the float32 cast: casting the whole vocabulary would allocate
    # a float32 copy of every logit for nothing.
    reward_logits = logits.index_select(-1, id_tensor).float()
    # Zeroed off the placeholders: a NaN there would survive any masking of the loss, since the
    # log-softmax backward multiplies it by a zero gradient (NaN·0 = NaN).
    reward_logits = torch.where(at_placeholder.unsqueeze(-1), reward_logits, 0.0)
    log_q = torch.log_softmax(reward_logits, dim=-1)

    if soft:
        # Zeroed off the placeholders: padding there may be NaN, and NaN·0 in the backward pass
        # would still reach the logits.
        targets = torch.where(at_placeholder.unsqueeze(-1), labels.float(), 0.0)
        token_losses = -(targets * log_q).sum(-1)
        target_class = targets.argmax(-1)
    else:
        matches = labels.unsqueeze(-1) == id_tensor
        bad = at_placeholder & ~matches.any(-1)
        if bool(bad.any()):
            row, position = (int(i) for i in bad.nonzero()[0].tolist())
            raise ValueError(
                f"labels[{row}, {position}] = {int(labels[row, position])} at a placeholder is not one "
                f"of reward_token_ids {ids} ({int(bad.sum())} such placeholder(s))"
            )
        target_class = matches.long().argmax(-1)
        token_losses = -log_q.gather(-1, target_class.unsqueeze(-1)).squeeze(-1)

    # where rather than multiplication: non-placeholder rows may hold inf/NaN logits.
    token_losses = torch.where(at_placeholder, token_losses, 0.0)
    count = mask.sum()
    loss = (token_losses * mask).sum() / resolve_normalizer(normalizer, count)
    with torch.no_grad():
        correct = (log_q.argmax(-1) == target_class).float() * mask
        metrics = {"accuracy": correct.sum() / count.clamp(min=1), "num_tokens": count}
    return loss, metrics
