"""The experience batch a learner consumes: S trajectories packed into one row of N tokens.

`build_experience` concatenates prompt + response of every `Trajectory` into `input_ids` ([N],
padding-free, see `rl_data.packing`), with `cu_seqlens` / `position_ids` for varlen attention
and every per-token tensor aligned with `input_ids`. Per-sequence values ([S]) keep the order
of the records. Slots such as `old_logprobs` and `advantages` are filled by the learners as
the PPO step goes on (same [N] alignment).

Log-prob convention. The value at token t is log π(input_ids[t] | the tokens before t in the
same sequence). A causal model's logits at position t − 1 predict token t, so the log-probs
computed from logits[:-1] of a sequence land at positions 1.., and position 0 of each sequence
(a prompt token) never carries one. Response tokens are the only ones with non-zero values.

`response_view` turns any [N] tensor into the right-padded `[S, R_max]` response layout that the
`rl_algos` functions take (advantages, losses), and `from_response_view` puts `[S, R_max]`
results back at their tokens; both are vectorised and let gradients through.

`micro_batches` builds one `ExperienceBatch` per micro-batch of a `MicroBatchPlan` for one rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from .batching import MicroBatchPlan
from .errors import DataError
from .packing import (
    cu_seqlens_from_lengths,
    packed_to_padded,
    padded_to_packed,
    position_ids_from_cu_seqlens,
)
from .records import LOGPROB_DTYPE, TOKEN_DTYPE, Trajectory
from .vision import ImageInputs
from .wire import WIRE_FORMAT, check_wire_format

__all__ = ["ExperienceBatch", "build_experience", "micro_batches"]

_TOKEN_SLOTS = ("old_logprobs", "ref_logprobs", "teacher_logprobs", "values", "advantages", "returns")
_TOKEN_FIELDS = (
    "input_ids",
    "position_ids",
    "action_mask",
    "rollout_logprobs",
    "routed_experts",
    *_TOKEN_SLOTS,
)
_SEQUENCE_TENSORS = (
    "prompt_lengths",
    "response_lengths",
    "rewards",
    "scores",
    "group_ids",
    "policy_versions",
)


class ExperienceBatch(msgspec.Struct, kw_only=True):
    """S trajectories packed into one row of N tokens; per-token fields are [N], per-sequence [S].

    Per token (aligned with `input_ids`):
        input_ids:        [N] int64, prompt then response of every trajectory, concatenated.
        position_ids:     [N] int64, restarting at 0 at every sequence.
        action_mask:      [N] bool, True only on response tokens the policy chose (trajectory
                          `action_mask` True); False on prompts and environment tokens.
        rollout_logprobs: [N] float32 log-probs of the sampler at response tokens, 0 elsewhere;
                          None when no record had them. Value at t: log π(input_ids[t] | tokens
                          before t of the same sequence).
        routed_experts:   [N, L, K] int16, the engine's top-K experts of every MoE layer at every
                          token (`Trajectory.routed_experts`; −1 where not reported); None when
                          the records had none. The learner replays them (`router_replay`).
    Per sequence:
        cu_seqlens:       [S+1] int32 boundaries (flash-attention convention).
        prompt_lengths, response_lengths: [S] int64.
        rewards, scores:  [S] float32.
        group_ids, policy_versions: [S] int64.
        finish_reasons:   S strings ("stop", "length", "abort").
        indices:          [S] int64, positions of the trajectories in the list they came from.
    Images (VL models; all None for text):
        pixel_values:     [P, D] float32 patches of every image, sequence by sequence, in the
                          order of their placeholder runs in `input_ids`.
        image_grid_thw:   [I, 3] int64 (t, h, w) patch grid of every image; P = Σ t·h·w.
        image_counts:     [S] int64 images of each sequence (0 for a text-only one).
    Filled later by learners ([N], same alignment and convention, None until then):
        old_logprobs, ref_logprobs, teacher_logprobs (a distillation teacher's log-probs of the
        sampled tokens), values, advantages, returns.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    action_mask: torch.Tensor
    rollout_logprobs: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    rewards: torch.Tensor
    scores: torch.Tensor
    group_ids: torch.Tensor
    policy_versions: torch.Tensor
    finish_reasons: list[str]
    indices: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    image_counts: torch.Tensor | None = None
    wire_format: int = WIRE_FORMAT
    """The wire format of the message (`rl_data.wire`); another major is refused on decode."""

    def __post_init__(self) -> None:
        # Shape checks only (no values read), so they cost nothing on a device.
        owner = type(self).__name__
        check_wire_format(self.wire_format, owner)
        tokens, sequences = self.input_ids.shape[0], self.cu_seqlens.numel() - 1
        if self.input_ids.dim() != 1 or self.cu_seqlens.dim() != 1 or sequences < 0:
            raise ValueError(
                f"{owner}: input_ids must be [N] and cu_seqlens [S+1], got shapes "
                f"{tuple(self.input_ids.shape)} and {tuple(self.cu_seqlens.shape)}"
            )
        for field in _TOKEN_FIELDS:
            value = getattr(self, field)
            if value is not None and value.shape[:1] != (tokens,):
                raise ValueError(
                    f"{owner}.{field}: shape {tuple(value.shape)} is not aligned with N = {tokens}"
                )
        for field in _SEQUENCE_TENSORS:
            value = getattr(self, field)
            if tuple(value.shape) != (sequences,):
                raise ValueError(
                    f"{owner}.{field}: shape {tuple(value.shape)}, expected [S] = ({sequences},)"
                )
        if tuple(self.indices.shape) != (sequences,) or len(self.finish_reasons) != sequences:
            raise ValueError(
                f"{owner}: indices and finish_reasons must have S = {sequences} entries, got "
                f"{tuple(self.indices.shape)} and {len(self.finish_reasons)}"
            )
        image_fields = (self.pixel_values, self.image_grid_thw, self.image_counts)
        if any(value is not None for value in image_fields):
            if any(value is None for value in image_fields):
                raise ValueError(f"{owner}: pixel_values, image_grid_thw and image_counts come together")
            if tuple(self.image_counts.shape) != (sequences,):
                raise ValueError(
                    f"{owner}.image_counts: shape {tuple(self.image_counts.shape)}, expected [S] = ({sequences},)"
                )
            if (
                self.image_grid_thw.dim() != 2
                or self.image_grid_thw.shape[1] != 3
                or self.pixel_values.dim() != 2
            ):
                raise ValueError(
                    f"{owner}: image_grid_thw must be [I, 3] and pixel_values [P, D], got "
                    f"{tuple(self.image_grid_thw.shape)} and {tuple(self.pixel_values.shape)}"
                )

    @classmethod
    def empty(cls, *, with_rollout_logprobs: bool = False) -> ExperienceBatch:
        """A batch of zero sequences: what an empty micro-batch of a plan becomes (dummy step)."""
        tokens = torch.zeros(0, dtype=TOKEN_DTYPE)
        return cls(
            input_ids=tokens,
            position_ids=tokens.clone(),
            cu_seqlens=torch.zeros(1, dtype=torch.int32),
            prompt_lengths=tokens.clone(),
            response_lengths=tokens.clone(),
            action_mask=torch.zeros(0, dtype=torch.bool),
            rollout_logprobs=torch.zeros(0, dtype=LOGPROB_DTYPE) if with_rollout_logprobs else None,
            rewards=torch.zeros(0, dtype=torch.float32),
            scores=torch.zeros(0, dtype=torch.float32),
            group_ids=tokens.clone(),
            policy_versions=tokens.clone(),
            finish_reasons=[],
            indices=tokens.clone(),
        )

    @property
    def num_sequences(self) -> int:
        """S."""
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        """N, prompt and response tokens of all sequences."""
        return self.input_ids.shape[0]

    @property
    def num_actions(self) -> int:
        """Tokens the policy chose (Σ action_mask): the token count of token-level losses."""
        return int(self.action_mask.sum())

    def to(self, device: torch.device | str) -> ExperienceBatch:
        """A copy with every tensor on `device`."""
        changes = {
            field: value.to(device)
            for field in self.__struct_fields__
            if isinstance(value := getattr(self, field), torch.Tensor)
        }
        return msgspec.structs.replace(self, **changes)

    @property
    def has_images(self) -> bool:
        """Whether any sequence carries images (VL batch)."""
        return self.pixel_values is not None and self.image_grid_thw.shape[0] > 0

    def images(self) -> ImageInputs | None:
        """All images of the batch as one `ImageInputs` (without originals), or None."""
        if self.pixel_values is None:
            return None
        return ImageInputs(pixel_values=self.pixel_values, grid_thw=self.image_grid_thw)

    def _image_fields(self, chosen: torch.Tensor) -> dict[str, torch.Tensor]:
        """pixel_values, image_grid_thw and image_counts of the sequences `chosen`, in that order."""
        if self.pixel_values is None:
            return {}
        counts = self.image_counts.cpu()
        grid = self.image_grid_thw.cpu()
        first_image = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        patches = grid.prod(-1)
        first_patch = torch.cat([patches.new_zeros(1), patches.cumsum(0)])
        images = [i for s in chosen.tolist() for i in range(int(first_image[s]), int(first_image[s + 1]))]
        rows = [torch.arange(int(first_patch[i]), int(first_patch[i + 1])) for i in images]
        rows_index = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        image_index = torch.tensor(images, dtype=torch.int64)
        return {
            "pixel_values": self.pixel_values[rows_index.to(self.pixel_values.device)],
            "image_grid_thw": self.image_grid_thw[image_index.to(self.image_grid_thw.device)],
            "image_counts": self.image_counts[chosen.to(self.image_counts.device)],
        }

    @property
    def sequence_lengths(self) -> torch.Tensor:
        """[S] int64 prompt + response length of every sequence."""
        return self.prompt_lengths + self.response_lengths

    def select(self, sequences: Sequence[int] | torch.Tensor) -> ExperienceBatch:
        """The sequences at positions `sequences` of this batch, repacked, with every field.

        Per-token fields (including filled slots such as `advantages`) move with their tokens and
        per-sequence fields with their sequences; `indices` keep pointing at the original records.
        This is how a batch whose advantages were computed over all groups is cut into the
        micro-batches of a `MicroBatchPlan`. Order follows `sequences`; repeats are allowed.
        """
        chosen = torch.as_tensor(sequences, dtype=torch.int64).reshape(-1)
        count = self.num_sequences
        if chosen.numel() and (int(chosen.min()) < 0 or int(chosen.max()) >= count):
            raise IndexError(f"sequences: positions must lie in [0, {count}), got {chosen.tolist()}")
        if chosen.numel() == 0:
            empty = ExperienceBatch.empty(with_rollout_logprobs=self.rollout_logprobs is not None)
            return msgspec.structs.replace(
                empty,
                **{slot: getattr(self, slot)[:0] for slot in _TOKEN_SLOTS if getattr(self, slot) is not None},
            )
        device = self.cu_seqlens.device
        chosen = chosen.to(device)
        lengths = self.sequence_lengths.to(device)[chosen]
        new_cu = cu_seqlens_from_lengths(lengths)
        total = int(new_cu[-1])
        starts = self.cu_seqlens[:-1].to(torch.int64)[chosen]
        offsets = torch.repeat_interleave(starts - new_cu[:-1].to(torch.int64), lengths, output_size=total)
        tokens = torch.arange(total, device=device) + offsets
        per_token = {
            field: value[tokens.to(value.device)]
            for field in _TOKEN_FIELDS
            if (value := getattr(self, field)) is not None
        }
        per_sequence = {
            field: getattr(self, field)[chosen.to(getattr(self, field).device)]
            for field in (*_SEQUENCE_TENSORS, "indices")
        }
        return msgspec.structs.replace(
            self,
            cu_seqlens=new_cu.to(self.cu_seqlens.device),
            finish_reasons=[self.finish_reasons[i] for i in chosen.tolist()],
            **per_token,
            **per_sequence,
            **self._image_fields(chosen.cpu()),
        )

    def response_positions(self) -> torch.Tensor:
        """[Σ R] indices into [N] of every response token, sequence by sequence."""
        starts = self.cu_seqlens[:-1].to(torch.int64) + self.prompt_lengths.to(self.cu_seqlens.device)
        response_cu = cu_seqlens_from_lengths(self.response_lengths).to(torch.int64)
        total = int(response_cu[-1])
        offsets = torch.repeat_interleave(starts - response_cu[:-1], self.response_lengths, output_size=total)
        return torch.arange(total, device=offsets.device) + offsets

    def response_view(self, values: torch.Tensor, pad_value: float = 0) -> torch.Tensor:
        """[N, ...] per-token values → [S, R_max, ...] response tokens only, right-padded with `pad_value`.

        Row s holds the values at the response tokens of sequence s, in order: the `[batch, seq]`
        layout of `rl_algos`. Gradients flow back to `values`.
        """
        self._check_token_aligned("values", values)
        responses = values[self.response_positions()]
        return packed_to_padded(
            responses, cu_seqlens_from_lengths(self.response_lengths), pad_value=pad_value
        )

    def response_action_mask(self) -> torch.Tensor:
        """[S, R_max] bool: `action_mask` in the `response_view` layout (False on padding)."""
        return self.response_view(self.action_mask, pad_value=False)

    def from_response_view(self, values: torch.Tensor) -> torch.Tensor:
        """[S, R, ...] right-padded response values (R ≥ R_max) → [N, ...], 0 on prompt tokens.

        The inverse of `response_view` (padding slots are dropped). Gradients flow back to `values`.
        """
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        if values.dim() < 2 or values.shape[0] != self.num_sequences:
            raise ValueError(
                f"values must have shape [S, R_max, ...] with S = {self.num_sequences}, got {tuple(values.shape)}"
            )
        responses = padded_to_packed(values, self.response_lengths.to(values.device))
        positions = self.response_positions().to(values.device)
        out = values.new_zeros((self.num_tokens, *values.shape[2:]))
        return out.index_put((positions,), responses)

    def _check_token_aligned(self, name: str, values: torch.Tensor) -> None:
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
        if values.dim() < 1 or values.shape[0] != self.num_tokens:
            raise ValueError(
                f"{name} must have shape [N, ...] with N = {self.num_tokens} tokens, got {tuple(values.shape)}"
            )


def build_experience(records: Sequence[Trajectory], indices: Sequence[int] | None = None) -> ExperienceBatch:
    """Pack trajectories into an `ExperienceBatch` (prompt + response of each, in order).

    Args:
      records: S ≥ 1 trajectories. Either all of them carry `rollout_logprobs` or none does; the
        same for `routed_experts` (of one shape [·, L, K]).
      indices: [S] positions of `records` in the list they came from; default 0..S−1.

    Raises:
      DataError naming the record (row) for a record that is not a `Trajectory` or whose
      `rollout_logprobs` presence differs from the first record's; ValueError for empty
      `records` or `indices` of the wrong length.
    """
    if isinstance(records, Trajectory) or not isinstance(records, Sequence):
        raise TypeError(f"records must be a sequence of Trajectory, got {type(records).__name__}")
    if len(records) == 0:
        raise ValueError("records is empty; at least one Trajectory is needed (use ExperienceBatch.empty())")
    count = len(records)
    if indices is None:
        index_tensor = torch.arange(count, dtype=torch.int64)
    else:
        index_tensor = torch.as_tensor(list(indices), dtype=torch.int64)
        if tuple(index_tensor.shape) != (count,):
            raise ValueError(f"indices has {index_tensor.numel()} entries but records has {count}")
    for row, record in enumerate(records):
        if not isinstance(record, Trajectory):
            raise DataError(f"expected a Trajectory, got {type(record).__name__}", source="records", row=row)
    with_logprobs = records[0].rollout_logprobs is not None
    for row, record in enumerate(records):
        if (record.rollout_logprobs is not None) != with_logprobs:
            raise DataError(
                f"rollout_logprobs is {'missing' if with_logprobs else 'present'} but record 0 "
                f"{'has' if with_logprobs else 'has none'}; either every record carries them or none does",
                source="records",
                row=row,
                key="rollout_logprobs",
            )

    routes = _routes(records)
    tokens, masks, logprobs = [], [], []
    for record in records:
        prompt_length = record.prompt_ids.numel()
        tokens += [record.prompt_ids, record.response_ids]
        masks += [torch.zeros(prompt_length, dtype=torch.bool), record.action_mask]
        if with_logprobs:
            logprobs += [torch.zeros(prompt_length, dtype=LOGPROB_DTYPE), record.rollout_logprobs]
    prompt_lengths = torch.tensor([r.prompt_ids.numel() for r in records], dtype=torch.int64)
    response_lengths = torch.tensor([r.response_ids.numel() for r in records], dtype=torch.int64)
    cu_seqlens = cu_seqlens_from_lengths(prompt_lengths + response_lengths)
    images = ImageInputs.concat([record.images for record in records])
    image_fields = {}
    if images is not None:
        image_fields = {
            "pixel_values": images.pixel_values,
            "image_grid_thw": images.grid_thw,
            "image_counts": torch.tensor(
                [record.images.num_images if record.images is not None else 0 for record in records],
                dtype=torch.int64,
            ),
        }
    return ExperienceBatch(
        input_ids=torch.cat(tokens).to(TOKEN_DTYPE),
        position_ids=position_ids_from_cu_seqlens(cu_seqlens),
        cu_seqlens=cu_seqlens,
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
        action_mask=torch.cat(masks),
        rollout_logprobs=torch.cat(logprobs) if with_logprobs else None,
        routed_experts=routes,
        rewards=torch.tensor([r.reward for r in records], dtype=torch.float32),
        scores=torch.tensor([r.score for r in records], dtype=torch.float32),
        group_ids=torch.tensor([r.group_id for r in records], dtype=torch.int64),
        policy_versions=torch.tensor([r.policy_version for r in records], dtype=torch.int64),
        finish_reasons=[str(r.finish_reason) for r in records],
        indices=index_tensor,
        **image_fields,
    )


def _routes(records: Sequence[Trajectory]) -> torch.Tensor | None:
    """[N, L, K] the records' `routed_experts` concatenated, or None when none has them; DataError
    naming the record when some have them and others not, or their layers × top-k differ."""
    first = records[0].routed_experts
    for row, record in enumerate(records):
        routes = record.routed_experts
        if (routes is None) != (first is None) or (
            routes is not None and routes.shape[1:] != first.shape[1:]
        ):
            raise DataError(
                f"routed_experts: {'None' if routes is None else list(routes.shape[1:])} but record 0 has "
                f"{'None' if first is None else list(first.shape[1:])} (layers, top_k); either every record "
                "carries routes of one model or none does",
                source="records",
                row=row,
                key="routed_experts",
            )
    return None if first is None else torch.cat([record.routed_experts for record in records])


def micro_batches(
    records: Sequence[Trajectory] | ExperienceBatch, plan: MicroBatchPlan, rank: int
) -> list[ExperienceBatch]:
    """One `ExperienceBatch` per micro-batch of `rank` in `plan`, in the plan's order.

    `records` is either the list of trajectories the plan was made for (lengths
    `record.num_tokens`) or an `ExperienceBatch` of them (lengths `sequence_lengths`; its filled
    slots such as advantages travel along, through `ExperienceBatch.select`). Each batch's
    `indices` are the records' positions in the original list. An empty micro-batch (a rank with
    fewer sequences than micro-steps) becomes an empty batch, so every rank still gets the same
    number of batches; it carries empty `rollout_logprobs` when the records have them.
    """
    if not isinstance(plan, MicroBatchPlan):
        raise TypeError(f"plan must be a MicroBatchPlan, got {type(plan).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < plan.num_ranks:
        raise ValueError(f"rank must be an integer in [0, {plan.num_ranks}), got {rank!r}")
    packed = isinstance(records, ExperienceBatch)
    lengths = records.sequence_lengths.tolist() if packed else [record.num_tokens for record in records]
    count = len(lengths)
    batches = []
    for step, batch in enumerate(plan.ranks[rank]):
        bad = [i for i in batch if not 0 <= i < count]
        if bad:
            raise ValueError(
                f"plan.ranks[{rank}][{step}] refers to record {bad[0]} but there are {count} records; "
                "the plan was made for other records"
            )
        tokens = sum(lengths[i] for i in batch)
        if tokens != plan.micro_batch_tokens[rank][step]:
            raise ValueError(
                f"plan.ranks[{rank}][{step}] has {plan.micro_batch_tokens[rank][step]} tokens in the plan but "
                f"{tokens} in these records; the plan was made for other records"
            )
        if packed:
            batches.append(records.select(batch))
        elif batch:
            batches.append(build_experience([records[i] for i in batch], batch))
        else:
            with_logprobs = count > 0 and records[0].rollout_logprobs is not None
            batches.append(ExperienceBatch.empty(with_rollout_logprobs=with_logprobs))
    return batches
