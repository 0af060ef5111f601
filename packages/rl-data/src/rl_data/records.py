"""Token-in/token-out records: what a rollout hands to the learners.

A `Trajectory` is one sampled response to one prompt, kept in token ids from end to end: text
is never re-tokenised inside a trajectory. Multi-turn trajectories hold the model's tokens and
the environment's tokens in `response_ids`; `action_mask` is 1 on the tokens the policy chose
and 0 on environment tokens, so losses and advantages only see the policy's own actions.

Per-token fields are 1-D tensors aligned with `response_ids` (`[R]`): `rollout_logprobs[t]` is
the sampler's log π(response_ids[t] | prompt, response_ids[:t]) and `action_mask[t]` says
whether that token is an action. Lists are accepted and converted on construction; on decode
(`rl_data.serialization`) the same checks run, so a malformed message fails at the door.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import torch

from .vision import ImageInputs
from .wire import WIRE_FORMAT, check_wire_format

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")

TOKEN_DTYPE = torch.int64
LOGPROB_DTYPE = torch.float32
ROUTE_DTYPE = torch.int16
"""Expert indices of `routed_experts` (up to 32767 experts per layer; −1: not reported)."""


def as_routes(value: Any, tokens: int, *, field: str, owner: str) -> torch.Tensor:
    """`value` ([T, L, K] integers, a nested list or a tensor) as a contiguous CPU `ROUTE_DTYPE`
    tensor with T = `tokens`; indices must be ≥ −1 (−1: the engine did not report that token)."""
    tensor = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if tensor.is_floating_point():
        raise TypeError(f"{owner}.{field}: expected integer expert indices, got {tensor.dtype}")
    if tensor.ndim != 3 or tensor.shape[0] != tokens:
        raise ValueError(
            f"{owner}.{field}: expected shape [tokens = {tokens}, layers, top_k], got {tuple(tensor.shape)}"
        )
    if tensor.numel() and (int(tensor.min()) < -1 or int(tensor.max()) > torch.iinfo(ROUTE_DTYPE).max):
        raise ValueError(f"{owner}.{field}: expert indices must lie in [-1, {torch.iinfo(ROUTE_DTYPE).max}]")
    return tensor.to(device="cpu", dtype=ROUTE_DTYPE).contiguous()


def as_1d_tensor(value: Any, dtype: torch.dtype, *, field: str, owner: str) -> torch.Tensor:
    """`value` (a list, tuple or tensor) as a contiguous 1-D CPU tensor of `dtype`.

    Integer fields refuse floating input and boolean fields refuse values other than 0/1, so a
    swapped argument shows up as an error naming the field instead of a silent cast.
    """
    if isinstance(value, torch.Tensor):
        tensor = value.detach()
    elif isinstance(value, (list, tuple)):
        try:
            tensor = torch.tensor(value) if len(value) else torch.empty(0, dtype=dtype)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"{owner}.{field}: expected a flat sequence of numbers ({error})") from None
    else:
        raise TypeError(f"{owner}.{field}: expected a list or a 1-D tensor, got {type(value).__name__}")
    if tensor.ndim != 1:
        raise ValueError(f"{owner}.{field}: expected a 1-D sequence, got shape {tuple(tensor.shape)}")
    if tensor.is_floating_point() and not dtype.is_floating_point and tensor.numel():
        raise TypeError(f"{owner}.{field}: expected integers, got {tensor.dtype}")
    not_binary = dtype == torch.bool and tensor.dtype != torch.bool and tensor.numel()
    if not_binary and bool(((tensor != 0) & (tensor != 1)).any()):
        raise ValueError(f"{owner}.{field}: expected 0/1 values")
    return tensor.to(device="cpu", dtype=dtype).contiguous()


class Trajectory(msgspec.Struct, kw_only=True):
    """One response to one prompt, in token ids.

    Fields (R = len(response_ids)):
        prompt_ids:       [P] int64, the prompt exactly as the engine saw it (template applied).
        response_ids:     [R] int64, sampled tokens, plus environment tokens in multi-turn.
        rollout_logprobs: [R] float32 log-probs of `response_ids` under the sampler, 0 on
                          environment tokens; None when the engine did not return them.
        action_mask:      [R] bool, True on tokens the policy chose; defaults to all True.
        reward:           scalar reward used for training (after shaping).
        score:            scalar task score for logging and filtering (e.g. accuracy); defaults
                          to `reward`.
        group_id:         prompt group: responses to the same prompt share it (GRPO, RLOO).
        policy_version:   version of the weights that sampled its first token (async training,
                          staleness): the oldest weights that wrote any of it.
        token_versions:   [R] int64, the policy version of each response token, when they differ
                          (partial rollout: a weight sync landed mid-response; multi-turn turns
                          sampled by different weights); non-decreasing, none below
                          `policy_version`. None: every token is `policy_version`'s (records
                          written before this field decode to None). `versions()` gives [R].
        finish_reason:    "stop" (EOS or stop string), "length" (hit a length limit) or "abort".
        label:            the prompt's reference answer or any JSON-like label, for rewards.
        extra:            free-form JSON-like metadata (turns, tool calls, environment logs).
        images:           the processed images of prompt and response (VL models), in the order
                          of their placeholder runs in prompt_ids ‖ response_ids
                          (`rl_data.vision`); None for text.
        routed_experts:   [P+R, L, K] int16, a mixture-of-experts model's routes in the engine:
                          the top-K experts of each of its L MoE layers for every token of
                          prompt_ids ‖ response_ids; −1 where the engine did not report a token
                          (the last sampled token is never run). None: no routes (a dense model
                          or an engine that does not report them). For routing replay (R3).
    """

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    rollout_logprobs: torch.Tensor | None = None
    action_mask: torch.Tensor | None = None
    reward: float = 0.0
    score: float | None = None
    group_id: int = 0
    policy_version: int = 0
    token_versions: torch.Tensor | None = None
    finish_reason: FinishReason = "stop"
    label: Any = None
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    images: ImageInputs | None = None
    routed_experts: torch.Tensor | None = None
    wire_format: int = WIRE_FORMAT
    """The wire format of the message (`rl_data.wire`); another major is refused on decode."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        check_wire_format(self.wire_format, owner)
        self.prompt_ids = as_1d_tensor(self.prompt_ids, TOKEN_DTYPE, field="prompt_ids", owner=owner)
        self.response_ids = as_1d_tensor(self.response_ids, TOKEN_DTYPE, field="response_ids", owner=owner)
        length = self.response_ids.numel()
        if self.action_mask is None:
            self.action_mask = torch.ones(length, dtype=torch.bool)
        else:
            self.action_mask = as_1d_tensor(self.action_mask, torch.bool, field="action_mask", owner=owner)
        if self.rollout_logprobs is not None:
            self.rollout_logprobs = as_1d_tensor(
                self.rollout_logprobs, LOGPROB_DTYPE, field="rollout_logprobs", owner=owner
            )
        if self.token_versions is not None:
            self.token_versions = as_1d_tensor(
                self.token_versions, TOKEN_DTYPE, field="token_versions", owner=owner
            )
            versions = self.token_versions
            if versions.numel() and (
                bool((versions[1:] < versions[:-1]).any()) or int(versions[0]) < self.policy_version
            ):
                raise ValueError(
                    f"{owner}.token_versions: {versions.tolist()} must be non-decreasing and start at or "
                    f"after policy_version {self.policy_version}"
                )
        for field in ("action_mask", "rollout_logprobs", "token_versions"):
            value = getattr(self, field)
            if value is not None and value.numel() != length:
                raise ValueError(
                    f"{owner}.{field}: length {value.numel()} does not match response_ids length {length}"
                )
        if self.routed_experts is not None:
            self.routed_experts = as_routes(
                self.routed_experts, self.prompt_ids.numel() + length, field="routed_experts", owner=owner
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"{owner}.finish_reason: {self.finish_reason!r} is not one of {FINISH_REASONS}")
        self.reward = float(self.reward)
        if self.score is None:
            self.score = self.reward
        self.score = float(self.score)

    def versions(self) -> torch.Tensor:
        """[R] int64: the policy version of every response token (`token_versions`, or
        `policy_version` repeated)."""
        if self.token_versions is not None:
            return self.token_versions
        return torch.full((self.response_ids.numel(),), self.policy_version, dtype=TOKEN_DTYPE)

    @property
    def num_tokens(self) -> int:
        """Prompt plus response length: the tokens a learner forward pass sees."""
        return self.prompt_ids.numel() + self.response_ids.numel()

    @property
    def num_actions(self) -> int:
        """Number of tokens the policy chose (the loss's token count for this trajectory)."""
        assert self.action_mask is not None
        return int(self.action_mask.sum())


class PromptSample(msgspec.Struct, kw_only=True):
    """A prompt ready for an engine: rendered text, its token ids and the label for rewards.

    `index` is the sample's position in the dataset that yields it (after mixing and
    filtering); `source` and `row` name the file and the row it was read from, so a reward or an
    error can point back to it. `images` holds a VL prompt's processed images (`prompt_ids` then
    has each image's run of placeholder tokens, `rl_data.vision`).
    """

    prompt_ids: torch.Tensor
    prompt: str = ""
    label: Any = None
    index: int = -1
    source: str = ""
    row: int = -1
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    images: ImageInputs | None = None
    wire_format: int = WIRE_FORMAT
    """The wire format of the message (`rl_data.wire`); another major is refused on decode."""

    def __post_init__(self) -> None:
        check_wire_format(self.wire_format, "PromptSample")
        self.prompt_ids = as_1d_tensor(self.prompt_ids, TOKEN_DTYPE, field="prompt_ids", owner="PromptSample")


def total_tokens(records: Sequence[Trajectory]) -> int:
    """Sum of prompt and response lengths over `records`."""
    return sum(record.num_tokens for record in records)
