"""Supervised learners: fine-tuning on demonstrations (SFT), reward models, DPO and KTO.

These reuse `Learner`'s optimizer step (`Learner._train_step`: DeepSpeed engine, micro-batches
with gradient accumulation, one global normaliser per step, non-finite checks) with the
supervised losses of `rl_algos`. A micro-batch is an `rl_data.ExperienceBatch`, built here from
dataset items:

- `pack_sequences`: SFT samples (token ids and a loss mask per sequence). The loss mask becomes
  the `action_mask`; the tokens before its first True are the "prompt".
- `pack_pairs`: preference pairs, the P chosen sequences first, then the P rejected ones in the
  same order (sequence i and i + P are one pair). Each pair's margin rides in `rewards[i]`.
- `pack_unpaired`: KTO's labelled completions; each label (1 desirable, 0 undesirable) rides in
  `rewards[i]`.

The losses and their normalisers (n counted over every micro-batch of the step on every rank):

    SFT  L = −Σ_t m_t·log π(y_t | y_<t) / n_tokens                         (rl_algos.sft_loss)
    RM   L = Σ_pairs −log σ(r_w − r_l − margin) / n_pairs            (rl_algos.reward_model_loss)
    DPO  L = Σ_pairs ℓ(z) / n_pairs,  z = (log π_w − log π_l) − (log π_ref,w − log π_ref,l)
         ℓ: sigmoid (DPO), sigmoid with label smoothing (cDPO) or IPO  (rl_algos.dpo_loss)
    KTO  L = Σ_i λ_i·(1 − σ(±β·(ρ_i − z_ref))) / n_sequences,  ρ = log π − log π_ref  (rl_algos.kto_loss)
         z_ref = max(0, mean over the step's mismatched KL pairs of log π − log π_ref), no gradient,
         one value for the whole step on every rank (`KTOLearner.reference_point`)

where log π_w is the summed log-probability of the chosen response tokens. n_pairs is half the
step's sequence count (`loss_normalizer` in a sequence mode), exact because `pack_pairs` keeps
both sides of a pair in one micro-batch and each side has at least one response token.

With `aux_loss_coef` c > 0 (an MoE model: Mixtral, Qwen2-MoE, ...), SFT, RM and DPO add the
load-balancing loss of the routers as the policy learner does (`rl_algos.load_balancing_loss`
over each micro-batch's routed tokens): L += c · Σ_j (A_j / A) · L_aux,j, A_j the target tokens
of micro-batch j and A those of the whole step on every rank (`_LoadBalancing`).

Pair metrics (accuracy, margins) are means over the step's pairs: each micro-batch adds its
sums, reduced over ranks once after the update, then divided by the global pair count.

Sequence parallelism (`DeepSpeedConfig.sequence_parallel_size` > 1, `rl_learner.sequence_parallel`):
as in the RL learners, the ranks of a group share each micro-batch, every rank gets the full
per-token log-probs (or per-position scores) and computes the same loss from them, so the NLL, the
summed response log-probs and the last-token scores are exact; counts and pair metrics come from
the group's first rank only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from rl_algos import aggregate_loss, dpo_loss, kto_loss, load_balancing_loss, reward_model_loss, sft_loss
from rl_algos.preference import DPO_LOSS_TYPES
from rl_data import ExperienceBatch
from rl_data.packing import cu_seqlens_from_lengths, position_ids_from_cu_seqlens

from .learner import PolicyLearner, ValueLearner
from .models import RouterCapture, packed_logprobs, packed_scores

__all__ = [
    "SFT_AGGREGATIONS",
    "DPOLearner",
    "DPOLossConfig",
    "KTOLearner",
    "KTOLossConfig",
    "RewardModelLearner",
    "SFTLearner",
    "group_by_tokens",
    "pack_pairs",
    "pack_sequences",
    "pack_unpaired",
    "sequence_logprobs",
]

SFT_AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean")
"""How `SFTLearner.sft_step` averages the NLL: over all response tokens of the step (OpenRLHF's
SFT) or per sequence first (short answers weigh as much as long ones)."""

_PAIR_SEQUENCE_MODE = "seq-mean-token-mean"  # loss_normalizer counts sequences in this mode


def _as_ids(value: Any, name: str) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if tensor.dim() != 1:
        raise ValueError(f"{name}: expected a 1-d sequence, got shape {tuple(tensor.shape)}")
    return tensor


def pack_sequences(
    sequences: Sequence[tuple[Any, Any]], *, margins: Sequence[float] | None = None
) -> ExperienceBatch:
    """S sequences, each (input_ids [L], loss_mask [L]), packed into one `ExperienceBatch`.

    `loss_mask[t]` True means token t is a target (its log-prob log π(x_t | x_<t) counts), the
    `rl_data` SFT/preference convention. The first token never has a log-prob, so it is never a
    target. `margins` ([S] floats) go to `rewards`; zeros without.

    Raises:
        ValueError: a sequence with mismatched lengths or without any target token after the
            first (names its index).
    """
    if not sequences:
        return ExperienceBatch.empty()
    ids_list, masks, prompt_lengths = [], [], []
    for index, (ids, mask) in enumerate(sequences):
        ids = _as_ids(ids, f"sequences[{index}].input_ids").to(torch.int64)
        mask = _as_ids(mask, f"sequences[{index}].loss_mask").to(torch.bool).clone()
        if mask.numel() != ids.numel():
            raise ValueError(
                f"sequences[{index}]: loss_mask has {mask.numel()} entries, input_ids {ids.numel()}"
            )
        mask[:1] = False
        targets = torch.nonzero(mask, as_tuple=True)[0]
        if targets.numel() == 0:
            raise ValueError(f"sequences[{index}]: no target token after the first (loss_mask is empty)")
        ids_list.append(ids)
        masks.append(mask)
        prompt_lengths.append(int(targets[0]))
    lengths = torch.tensor([ids.numel() for ids in ids_list], dtype=torch.int64)
    cu_seqlens = cu_seqlens_from_lengths(lengths)
    count = len(ids_list)
    prompt = torch.tensor(prompt_lengths, dtype=torch.int64)
    rewards = torch.zeros(count) if margins is None else torch.as_tensor(margins, dtype=torch.float32)
    if rewards.shape != (count,):
        raise ValueError(f"margins: expected {count} values, got shape {tuple(rewards.shape)}")
    return ExperienceBatch(
        input_ids=torch.cat(ids_list),
        position_ids=position_ids_from_cu_seqlens(cu_seqlens),
        cu_seqlens=cu_seqlens,
        prompt_lengths=prompt,
        response_lengths=lengths - prompt,
        action_mask=torch.cat(masks),
        rewards=rewards,
        scores=torch.zeros(count),
        group_ids=torch.arange(count, dtype=torch.int64),
        policy_versions=torch.zeros(count, dtype=torch.int64),
        finish_reasons=["stop"] * count,
        indices=torch.arange(count, dtype=torch.int64),
    )


def pack_pairs(pairs: Sequence[Any]) -> ExperienceBatch:
    """P preference pairs (`rl_data.datasets.PreferencePair`) as 2P sequences: chosen 0..P−1,
    rejected P..2P−1; `rewards[i]` holds pair i's margin (0 for the rejected rows)."""
    chosen = [(pair.chosen_ids, pair.chosen_mask) for pair in pairs]
    rejected = [(pair.rejected_ids, pair.rejected_mask) for pair in pairs]
    margins = [float(pair.margin) for pair in pairs] + [0.0] * len(pairs)
    return pack_sequences(chosen + rejected, margins=margins)


def pack_unpaired(samples: Sequence[Any]) -> ExperienceBatch:
    """S labelled completions (`rl_data.datasets.UnpairedSample`) as S sequences; `rewards[i]`
    holds sample i's label (1.0 desirable, 0.0 undesirable)."""
    return pack_sequences(
        [(sample.input_ids, sample.loss_mask) for sample in samples],
        margins=[float(sample.desirable) for sample in samples],
    )


def group_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive positions grouped so that each group's Σ lengths ≤ `budget` (an item longer
    than the budget forms a group of its own). Order is kept: [[0, 1], [2], [3, 4, 5]]."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget: {budget!r} is not an integer >= 1")
    groups: list[list[int]] = []
    used = 0
    for index, length in enumerate(lengths):
        if groups and used + length <= budget:
            groups[-1].append(index)
            used += length
        else:
            groups.append([index])
            used = length
    return groups


def sequence_logprobs(batch: ExperienceBatch, logprobs: torch.Tensor) -> torch.Tensor:
    """[S] Σ over each sequence's target tokens of the token log-probs [N] (gradients flow)."""
    view = batch.response_view(logprobs)
    return torch.where(batch.response_action_mask(), view, 0.0).sum(-1)


def _pair_count(batch: ExperienceBatch) -> int:
    if batch.num_sequences % 2:
        raise ValueError(
            f"a pair micro-batch needs an even number of sequences (chosen then rejected), got "
            f"{batch.num_sequences}; build it with pack_pairs"
        )
    return batch.num_sequences // 2


def _action_logprobs(learner: Any, batch: ExperienceBatch) -> torch.Tensor:
    """The policy's log-probs at the action tokens of a packed micro-batch (SFT, DPO and KTO)."""
    return packed_logprobs(
        learner.engine,
        batch,
        only_actions=True,
        share_prefix=learner.ds.shares_prefix,
        sequence_parallel=learner.sequence_parallel,
    )


class _PairMetrics:
    """Per-pair metric sums of this rank's micro-batches, reduced over ranks after the step."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = tuple(keys)
        self.sums = dict.fromkeys(self.keys, 0.0)
        self.pairs = 0.0

    def add(self, means: dict[str, torch.Tensor], pairs: int) -> None:
        for key in self.keys:
            self.sums[key] += float(means[key]) * pairs
        self.pairs += pairs

    def reduce(self, learner: Any, out: dict[str, float]) -> dict[str, float]:
        values = torch.tensor([self.pairs, *(self.sums[k] for k in self.keys)], dtype=torch.float64)
        total = learner._agree(values).cpu().tolist()
        out = dict(out)
        out["pairs"] = total[0]
        for key, value in zip(self.keys, total[1:], strict=True):
            out[key] = value / total[0] if total[0] > 0 else float("nan")
        return out


class _LoadBalancing:
    """The MoE load-balancing term of one supervised step (module docstring): router logits
    captured during each micro-batch's forward, c · (A_j / A) · L_aux,j added to its loss, logged
    as aux_loss (L_aux) and loss_aux (the term). Inactive (adds nothing) when c is 0.

    Raises ValueError for c < 0, for sequence parallelism (each rank's routers see only its slice
    of the tokens) and, through `RouterCapture`, for a model without MoE routers."""

    def __init__(self, learner: Any, micro_batches: Sequence[ExperienceBatch], coef: float) -> None:
        if not coef >= 0:
            raise ValueError(f"aux_loss_coef must be >= 0, got {coef!r}")
        self.coef, self.routers, self.total = float(coef), None, 1.0
        if self.coef == 0:
            return
        if learner.sequence_parallel is not None:
            raise ValueError(
                "aux_loss_coef: the MoE load-balancing loss is not supported with sequence_parallel_size "
                f"{learner.sequence_parallel.size} (each rank's routers see only its slice of the tokens); "
                "set aux_loss_coef 0 or sequence_parallel_size 1"
            )
        self.routers = RouterCapture(learner.engine)
        local = torch.tensor([sum(float(batch.num_actions) for batch in micro_batches)], dtype=torch.float64)
        self.total = max(float(learner._agree(local)[0]), 1.0)

    def capture(self) -> Any:
        """Around a micro-batch's forward: records the routers' logits."""
        return self.routers if self.routers is not None else contextlib.nullcontext()

    def add(
        self, batch: ExperienceBatch, total: torch.Tensor, metrics: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The micro-batch's loss and metrics with the term added (unchanged when inactive)."""
        if self.routers is None:
            return total, metrics
        aux = load_balancing_loss(self.routers.logits, self.routers.top_k)
        term = self.coef * aux * (float(batch.num_actions) / self.total)
        metrics = {**metrics, "aux_loss": aux.detach(), "loss_aux": term.detach()}
        metrics["loss"] = metrics["loss"] + term.detach()  # the full loss, as minimised
        return total + term.to(total.dtype), metrics

    def dummy(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The metric keys of `add` for a rank without a micro-batch (the same keys on every rank)."""
        if self.routers is None:
            return metrics
        return {**metrics, "aux_loss": torch.zeros(()), "loss_aux": torch.zeros(())}


# --------------------------------------------------------------------------- SFT


class SFTLearner(PolicyLearner):
    """A causal LM trained on demonstrations (micro-batches from `pack_sequences`)."""

    def sft_step(
        self,
        micro_batches: Sequence[ExperienceBatch],
        *,
        aggregation: str = "token-mean",
        aux_loss_coef: float = 0.0,
    ) -> dict[str, float]:
        """One optimizer step minimising the NLL of the target tokens (module docstring), plus
        the MoE load-balancing term when `aux_loss_coef` > 0.

        Returns metrics, equal on every rank: loss (the full-batch loss), nll (token-mean NLL of
        the step, whatever the aggregation), aux_loss and loss_aux (with aux_loss_coef > 0),
        grad_norm, lr, tokens (target tokens), sequences, skipped.
        """
        if aggregation not in SFT_AGGREGATIONS:
            raise ValueError(f"aggregation: {aggregation!r} is not one of {', '.join(SFT_AGGREGATIONS)}")
        balance = _LoadBalancing(self, micro_batches, aux_loss_coef)

        def forward_loss(batch: ExperienceBatch, normalizer: torch.Tensor):
            with balance.capture():
                logprobs = _action_logprobs(self, batch)
            view, mask = batch.response_view(logprobs), batch.response_action_mask()
            if aggregation == "token-mean":
                total, metrics = sft_loss(view, mask, normalizer=normalizer)
                nll = metrics["nll"]
            else:
                total = aggregate_loss(-view, mask, aggregation, normalizer=normalizer)
                nll = -torch.where(mask, view, 0.0).sum().detach() / mask.sum().clamp(min=1)
            return balance.add(batch, total, {"loss": total.detach(), "nll": nll})

        def dummy_loss():
            logits = self._empty_batch_logits()
            return logits.float().sum() * 0.0, balance.dummy(
                {"loss": torch.zeros(()), "nll": torch.zeros(())}
            )

        return self._train_step(
            micro_batches, mode=aggregation, inputs=[], forward_loss=forward_loss, dummy_loss=dummy_loss
        )


# --------------------------------------------------------------------------- DPO


class DPOLossConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What `DPOLearner.dpo_step` minimises (`rl_algos.dpo_loss`)."""

    beta: float = 0.1
    """β > 0: implicit reward scale, the strength of the pull towards the reference."""
    label_smoothing: float = 0.0
    """ε in [0, 0.5): cDPO's assumed label-flip probability; 0 is plain DPO (sigmoid only)."""
    loss_type: str = "sigmoid"
    """"sigmoid" (DPO, cDPO with label_smoothing > 0) or "ipo"."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(
                f"{owner}.loss_type: {self.loss_type!r} is not one of {', '.join(DPO_LOSS_TYPES)}"
            )
        zero = torch.zeros(1)
        try:
            dpo_loss(
                zero,
                zero,
                zero,
                zero,
                beta=self.beta,
                label_smoothing=self.label_smoothing,
                loss_type=self.loss_type,
            )
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{owner}: beta={self.beta!r}, label_smoothing={self.label_smoothing!r}, "
                f"loss_type={self.loss_type!r}: {error}"
            ) from None


_DPO_METRICS = (
    "chosen_rewards",
    "rejected_rewards",
    "reward_margin",
    "reward_accuracy",
    "chosen_logps",
    "rejected_logps",
)


class DPOLearner(PolicyLearner):
    """The policy of DPO / cDPO / IPO; its frozen reference is a `PolicyLearner(optimizer=None)`."""

    def dpo_step(
        self, micro_batches: Sequence[ExperienceBatch], loss: DPOLossConfig, *, aux_loss_coef: float = 0.0
    ) -> dict[str, float]:
        """One optimizer step of the DPO loss over pair micro-batches (`pack_pairs`), plus the
        MoE load-balancing term when `aux_loss_coef` > 0 (aux_loss and loss_aux in the metrics).

        Each micro-batch needs `ref_logprobs`: the reference's token log-probs
        (`reference.logprobs(micro_batches, only_actions=True)`).

        Returns metrics, equal on every rank: loss; per-pair means chosen_rewards and
        rejected_rewards (β·log π/π_ref of each side), reward_margin, reward_accuracy (chosen
        reward strictly larger), chosen_logps / rejected_logps (summed policy log-probs); pairs,
        grad_norm, lr, tokens, sequences, skipped.
        """
        if not isinstance(loss, DPOLossConfig):
            raise TypeError(f"loss must be a DPOLossConfig, got {type(loss).__name__}")
        pair_metrics = _PairMetrics(_DPO_METRICS)
        balance = _LoadBalancing(self, micro_batches, aux_loss_coef)

        def forward_loss(batch: ExperienceBatch, normalizer: torch.Tensor):
            pairs = _pair_count(batch)
            with balance.capture():
                logprobs = _action_logprobs(self, batch)
            policy = sequence_logprobs(batch, logprobs)
            reference = sequence_logprobs(batch, batch.ref_logprobs.to(policy.dtype))
            losses, metrics = dpo_loss(
                policy[:pairs],
                policy[pairs:],
                reference[:pairs],
                reference[pairs:],
                beta=loss.beta,
                label_smoothing=loss.label_smoothing,
                loss_type=loss.loss_type,
            )
            total = losses.sum() / (normalizer / 2)
            with torch.no_grad():
                metrics["chosen_logps"] = policy[:pairs].float().mean()
                metrics["rejected_logps"] = policy[pairs:].float().mean()
            if self.counts_for_group:  # an SP group's ranks hold the same pairs: count them once
                pair_metrics.add(metrics, pairs)
            return balance.add(batch, total, {"loss": total.detach()})

        def dummy_loss():
            logits = self._empty_batch_logits()
            return logits.float().sum() * 0.0, balance.dummy({"loss": torch.zeros(())})

        out = self._train_step(
            micro_batches,
            mode=_PAIR_SEQUENCE_MODE,
            inputs=["ref_logprobs"],
            forward_loss=forward_loss,
            dummy_loss=dummy_loss,
        )
        return pair_metrics.reduce(self, out)


# --------------------------------------------------------------------------- KTO


class KTOLossConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What `KTOLearner.kto_step` minimises (`rl_algos.kto_loss`)."""

    beta: float = 0.1
    """β > 0: the scale of the implicit reward β·ρ."""
    desirable_weight: float = 1.0
    """λ_D ≥ 0: weight of a desirable completion's loss."""
    undesirable_weight: float = 1.0
    """λ_U ≥ 0: weight of an undesirable completion's loss."""

    def __post_init__(self) -> None:
        zero, no = torch.zeros(1), torch.zeros(1, dtype=torch.bool)
        try:
            kto_loss(
                zero,
                zero,
                no,
                zero,
                zero,
                beta=self.beta,
                desirable_weight=self.desirable_weight,
                undesirable_weight=self.undesirable_weight,
            )
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{type(self).__name__}: beta={self.beta!r}, desirable_weight={self.desirable_weight!r}, "
                f"undesirable_weight={self.undesirable_weight!r}: {error}"
            ) from None


class KTOLearner(PolicyLearner):
    """The policy of KTO; its frozen reference is a `PolicyLearner(optimizer=None)`."""

    def reference_point(self, kl_batches: Sequence[ExperienceBatch]) -> float:
        """z_ref = max(0, mean_j [log π(y'_j|x_j) − log π_ref(y'_j|x_j)]) over the step's KL pairs
        on every rank (summed response log-probs; no gradient). Each batch needs `ref_logprobs`;
        every rank calls this with the same number of batches (some possibly empty)."""
        sums = torch.zeros(2, dtype=torch.float64)
        for batch, logprobs in zip(kl_batches, self.logprobs(kl_batches, only_actions=True), strict=True):
            if batch.num_sequences == 0 or not self.counts_for_group:
                continue
            policy = sequence_logprobs(batch, logprobs)
            reference = sequence_logprobs(batch, batch.ref_logprobs.to(policy.device, policy.dtype))
            sums += torch.tensor(
                [float((policy - reference).sum()), float(batch.num_sequences)], dtype=torch.float64
            )
        total = self._agree(sums).cpu()
        return max(0.0, float(total[0] / total[1])) if total[1] > 0 else 0.0

    def kto_step(
        self, micro_batches: Sequence[ExperienceBatch], loss: KTOLossConfig, *, reference_point: float
    ) -> dict[str, float]:
        """One optimizer step of the KTO loss over `pack_unpaired` micro-batches, each with
        `ref_logprobs`; `reference_point` is the step's z_ref (`reference_point`).

        Returns metrics, equal on every rank: loss; kl (z_ref); desirable_rewards and
        undesirable_rewards (means of β·ρ over each kind in the step, NaN for a kind the step
        lacks), desirable and undesirable (counts), grad_norm, lr, tokens, sequences, skipped.
        """
        if not isinstance(loss, KTOLossConfig):
            raise TypeError(f"loss must be a KTOLossConfig, got {type(loss).__name__}")
        # [reward sum, count] of desirable then undesirable completions, this rank's share
        sums = torch.zeros(4, dtype=torch.float64)

        def forward_loss(batch: ExperienceBatch, normalizer: torch.Tensor):
            logprobs = _action_logprobs(self, batch)
            policy = sequence_logprobs(batch, logprobs)
            reference = sequence_logprobs(batch, batch.ref_logprobs.to(policy.dtype))
            desirable = batch.rewards.to(policy.device) > 0.5
            # z_ref is the step's, already reduced: one KL "pair" holding it makes kto_loss use it as is
            point = policy.new_tensor([reference_point], dtype=torch.float32)
            losses, _ = kto_loss(
                policy,
                reference,
                desirable,
                point,
                torch.zeros_like(point),
                beta=loss.beta,
                desirable_weight=loss.desirable_weight,
                undesirable_weight=loss.undesirable_weight,
            )
            total = losses.sum() / normalizer
            if self.counts_for_group:  # an SP group's ranks hold the same completions: count them once
                with torch.no_grad():
                    rewards = (loss.beta * (policy - reference)).double().cpu()
                    kind = desirable.cpu()
                    sums.add_(
                        torch.stack(
                            [
                                rewards[kind].sum(),
                                kind.sum().double(),
                                rewards[~kind].sum(),
                                (~kind).sum().double(),
                            ]
                        )
                    )
            return total, {"loss": total.detach()}

        def dummy_loss():
            logits = self._empty_batch_logits()
            return logits.float().sum() * 0.0, {"loss": torch.zeros(())}

        out = self._train_step(
            micro_batches,
            mode=_PAIR_SEQUENCE_MODE,
            inputs=["ref_logprobs"],
            forward_loss=forward_loss,
            dummy_loss=dummy_loss,
        )
        total = self._agree(sums).cpu().tolist()
        out = dict(out)
        out["kl"] = reference_point
        out["desirable"], out["undesirable"] = total[1], total[3]
        out["desirable_rewards"] = total[0] / total[1] if total[1] > 0 else float("nan")
        out["undesirable_rewards"] = total[2] / total[3] if total[3] > 0 else float("nan")
        return out


# --------------------------------------------------------------------------- reward model


_RM_METRICS = ("accuracy", "chosen_reward", "rejected_reward", "reward_margin")


class RewardModelLearner(ValueLearner):
    """A reward model (`load_value_model`: causal-LM backbone + scalar `score` head) trained on pairs."""

    def reward_step(
        self,
        micro_batches: Sequence[ExperienceBatch],
        *,
        use_margin: bool = False,
        aux_loss_coef: float = 0.0,
    ) -> dict[str, float]:
        """One optimizer step of the Bradley–Terry loss over pair micro-batches (`pack_pairs`);
        the score of a sequence is the head at its last token (`packed_scores`). With
        `use_margin`, each pair's margin (`rewards[i]`) is subtracted inside the sigmoid; with
        `aux_loss_coef` > 0 the MoE load-balancing term is added (aux_loss, loss_aux).

        Returns metrics, equal on every rank: loss; per-pair means accuracy (r_w > r_l),
        chosen_reward, rejected_reward, reward_margin (r_w − r_l); pairs, grad_norm, lr, tokens,
        sequences, skipped.
        """
        pair_metrics = _PairMetrics(_RM_METRICS)
        balance = _LoadBalancing(self, micro_batches, aux_loss_coef)

        def forward_loss(batch: ExperienceBatch, normalizer: torch.Tensor):
            pairs = _pair_count(batch)
            with balance.capture():
                scores = packed_scores(
                    self.engine,
                    batch,
                    share_prefix=self.ds.shares_prefix,
                    sequence_parallel=self.sequence_parallel,
                )
            margin = batch.rewards[:pairs].to(scores.device) if use_margin else None
            losses, metrics = reward_model_loss(scores[:pairs], scores[pairs:], margin=margin)
            total = losses.sum() / (normalizer / 2)
            if self.counts_for_group:  # an SP group's ranks hold the same pairs: count them once
                pair_metrics.add(metrics, pairs)
            return balance.add(batch, total, {"loss": total.detach()})

        def dummy_loss():
            scores = packed_scores(
                self.engine, ExperienceBatch.empty(), sequence_parallel=self.sequence_parallel
            )
            return scores.sum() * 0.0, balance.dummy({"loss": torch.zeros(())})

        out = self._train_step(
            micro_batches,
            mode=_PAIR_SEQUENCE_MODE,
            inputs=[],
            forward_loss=forward_loss,
            dummy_loss=dummy_loss,
        )
        return pair_metrics.reduce(self, out)
