"""Ulysses sequence parallelism: a group of `sp` ranks shares one packed micro-batch along its tokens.

Every rank of a sequence-parallel (SP) group holds the same packed micro-batch (N tokens, S
sequences). The row is padded to N_pad = sp·⌈N / sp⌉ tokens (the padding is one extra sequence
whose outputs are dropped) and rank r runs the contiguous slice of n = N_pad / sp tokens

    tokens [r·n, (r+1)·n)                                             (`SequenceParallelGroup.local_range`)

through every token-local layer (embeddings, norms, MLPs, rotary embeddings from its slice of
position_ids, the LM head, log-probs, the value head). Attention needs every earlier token of a
sequence, which may live on another rank, so around it (`ulysses_attention`) one all-to-all
trades tokens for heads and a second trades them back:

    q [1, H, n, D], k, v [1, H_kv, n, D]  ──all-to-all──▶  q [1, H/sp, N_pad, D], k, v [1, H_kv/sp, N_pad, D]
    packed attention of the full row on this rank's heads (length buckets, as without SP)
    out [1, N_pad, H/sp, D]               ──all-to-all──▶  out [1, n, H, D]

Rank r gets query heads [r·H/sp, (r+1)·H/sp) and KV heads [r·H_kv/sp, (r+1)·H_kv/sp): a query
head h reads KV head h // (H / H_kv), which lies in the same block, so grouped-query attention
needs no change. H and H_kv must both be divisible by sp (`check_heads`). Each all-to-all moves
(H + 2·H_kv)·n·D (forward) or H·n·D (back) values per rank and layer; attention itself runs
unchanged, so the result is exactly the unsplit one up to floating-point summation order
(none here: every reduction of attention runs on one rank).

Per-token outputs are then combined over the group with `sum_over_group`: each rank writes its
slice into a zero tensor of the full length and an all-reduce sums them (exact: every entry has
one non-zero term). Every rank of the group then holds the full [N] log-probs / values and
computes the same loss; the backward of `sum_over_group` is the identity (each rank keeps the
gradient of its own entries: the loss is replicated, not summed), and the all-to-alls send the
gradients of keys, values and queries back to the ranks that computed them. The parameter
gradient of rank r is the part of the micro-batch's gradient that flows through its tokens;
their sum over the group is the full gradient, which the learner's data-parallel averaging
(over all sp × dp ranks, scaled back by the world size) produces.

Why Ulysses rather than ring attention: the packed, length-bucketed attention (sdpa / eager on
CPU, the same kernels on GPU) runs unchanged on whole sequences, so SP = 2 equals SP = 1 to
float32 rounding of the same kernels, and the work per rank is balanced by heads whatever the
sequence lengths; ring attention needs an online-softmax merge of causal blocks, a kernel per
backend and load balancing of causal blocks. The limit is sp ≤ H_kv (KV heads are not
replicated here).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
import torch.distributed as dist

__all__ = [
    "SequenceParallelGroup",
    "check_heads",
    "heads_to_tokens",
    "new_sequence_parallel_group",
    "sum_over_group",
    "tokens_to_heads",
    "ulysses_attention",
]


@dataclasses.dataclass(frozen=True)
class SequenceParallelGroup:
    """This rank's sequence-parallel group: `size` consecutive global ranks that share a micro-batch.

    Attributes:
      group: the torch.distributed process group of the `size` ranks.
      size: sp ≥ 2.
      rank: this rank's index in the group, 0 ≤ rank < size.
    """

    group: Any
    size: int
    rank: int
    kind: ClassVar[str] = "sequence-parallel"

    def padded_length(self, num_tokens: int) -> int:
        """N_pad = sp·⌈N / sp⌉, at least sp (an empty row still gives every rank one token)."""
        return max(-(-num_tokens // self.size), 1) * self.size

    def local_range(self, num_tokens: int) -> tuple[int, int]:
        """(start, end) of this rank's slice of a row of `num_tokens` real tokens (padded, module docstring)."""
        chunk = self.padded_length(num_tokens) // self.size
        return self.rank * chunk, (self.rank + 1) * chunk


def new_sequence_parallel_group(size: int) -> SequenceParallelGroup | None:
    """Split the world into groups of `size` consecutive ranks; this rank's group (None for size 1).

    Ranks [g·sp, (g+1)·sp) form SP group g; the data-parallel groups are the strided ranks. Every
    rank must call this (creating a process group is collective), with the same size.

    Raises ValueError when the world size is not a multiple of `size`.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"sequence_parallel_size: {size!r} is not an integer >= 1")
    if size == 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(
            f"sequence_parallel_size: {size} does not divide the world size {world}; the ranks of a "
            "learner must form whole sequence-parallel groups (ranks = sp × data-parallel groups)"
        )
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return SequenceParallelGroup(group=mine, size=size, rank=rank % size)


def check_heads(num_heads: int, num_kv_heads: int, size: int, *, owner: str = "model") -> None:
    """ValueError unless sp divides both the query heads H and the KV heads H_kv."""
    for name, count in (("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads)):
        if count % size:
            raise ValueError(
                f"sequence_parallel_size {size}: {owner} has {name} = {count}, which is not divisible by "
                f"{size}; Ulysses sequence parallelism gives each rank {name} / sp heads (choose an sp that "
                f"divides {num_heads} query and {num_kv_heads} key-value heads)"
            )


def _all_to_all(chunks: torch.Tensor, group: SequenceParallelGroup) -> torch.Tensor:
    """[sp, ...] → [sp, ...]: chunk j goes to rank j; received chunk i came from rank i."""
    chunks = chunks.contiguous()
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group.group)
    return received


class _TokensToHeads(torch.autograd.Function):
    """[1, C, n, D] with C = Σ_c C_c channel blocks → [1, C/sp, sp·n, D] (all tokens, 1/sp of each block)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: SequenceParallelGroup, blocks: tuple[int, ...]
    ) -> torch.Tensor:
        ctx.group, ctx.blocks = group, blocks
        return _tokens_to_heads(x, group, blocks)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _heads_to_tokens(grad, ctx.group, tuple(b // ctx.group.size for b in ctx.blocks)), None, None


def _tokens_to_heads(x: torch.Tensor, group: SequenceParallelGroup, blocks: tuple[int, ...]) -> torch.Tensor:
    sp = group.size
    _, _, n, d = x.shape
    # each block's heads split into sp contiguous parts: part j of every block goes to rank j
    parts = [b.reshape(sp, size // sp, n, d) for b, size in zip(x[0].split(blocks), blocks, strict=True)]
    received = _all_to_all(torch.cat(parts, dim=1), group)  # [sp (source rank = token slice), C/sp, n, D]
    return received.permute(1, 0, 2, 3).reshape(1, -1, sp * n, d)


def _heads_to_tokens(x: torch.Tensor, group: SequenceParallelGroup, blocks: tuple[int, ...]) -> torch.Tensor:
    """[1, C/sp, sp·n, D] → [1, C, n, D], the inverse of `_tokens_to_heads` (`blocks` are the C/sp local sizes)."""
    sp = group.size
    _, c_local, total, d = x.shape
    n = total // sp
    chunks = x[0].reshape(c_local, sp, n, d).permute(1, 0, 2, 3)  # [sp (token slice), C/sp, n, D]
    received = _all_to_all(chunks, group)  # [sp (source rank = head part), C/sp, n, D]
    pieces = received.split(blocks, dim=1)  # per block: [sp, b/sp, n, D] → [b, n, D]
    return torch.cat([p.reshape(-1, n, d) for p in pieces])[None]


def tokens_to_heads(
    x: torch.Tensor, group: SequenceParallelGroup, blocks: tuple[int, ...] | None = None
) -> torch.Tensor:
    """The first all-to-all: [1, C, n, D] (all heads, this rank's n tokens) → [1, C/sp, sp·n, D].

    `blocks` (default (C,)) cuts the C channels into blocks of heads split separately (q, k, v
    concatenated: (H, H_kv, H_kv)), so each rank gets the same part of every block. Differentiable
    (the backward is the inverse all-to-all).
    """
    blocks = (x.shape[1],) if blocks is None else tuple(blocks)
    if sum(blocks) != x.shape[1] or any(b % group.size for b in blocks):
        raise ValueError(
            f"tokens_to_heads: blocks {blocks} must sum to {x.shape[1]} and divide by {group.size}"
        )
    return _TokensToHeads.apply(x, group, blocks)


class _HeadsToTokens(torch.autograd.Function):
    """[1, N_pad, H/sp, D] (attention output, token-major) → [1, n, H, D]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: SequenceParallelGroup) -> torch.Tensor:
        ctx.group = group
        heads = _heads_to_tokens(x.transpose(1, 2), group, (x.shape[2],))  # [1, H, n, D]
        return heads.transpose(1, 2).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        spread = _tokens_to_heads(grad.transpose(1, 2), ctx.group, (grad.shape[2],))  # [1, H/sp, N_pad, D]
        return spread.transpose(1, 2), None


def heads_to_tokens(x: torch.Tensor, group: SequenceParallelGroup) -> torch.Tensor:
    """The second all-to-all: attention output [1, N_pad, H/sp, D] → [1, n, H, D] (this rank's tokens).

    Differentiable (the backward is the first all-to-all)."""
    return _HeadsToTokens.apply(x, group)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: SequenceParallelGroup) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_group(x: torch.Tensor, group: SequenceParallelGroup) -> torch.Tensor:
    """Σ over the group's ranks of `x` (any shape, the same on every rank); the backward is the identity.

    For per-token outputs that each rank wrote into its own entries of a zero tensor, so every
    sum has one non-zero term (exact). The identity backward is right because every rank of the
    group then computes the same loss from the same sum (module docstring)."""
    return _SumOverGroup.apply(x, group)


def ulysses_attention(
    attention: Any,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: SequenceParallelGroup,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of the full packed row from this rank's slice of it (module docstring).

    Args:
      attention: the packed attention to run on all N_pad tokens of H/sp heads:
        `attention(module, q, k, v, **kwargs)` with q [1, H/sp, N_pad, D], k, v [1, H_kv/sp, N_pad, D],
        returning ([1, N_pad, H/sp, D], _).
      query: [1, H, n, D]; key, value: [1, H_kv, n, D], this rank's n = N_pad / sp tokens (rotary
        embeddings applied).
      group: the SP group.

    Returns:
      ([1, n, H, D] attention output of this rank's tokens, None).
    """
    heads, kv_heads = query.shape[1], key.shape[1]
    check_heads(heads, kv_heads, group.size, owner=type(module).__name__)
    both = tokens_to_heads(torch.cat([query, key, value], dim=1), group, (heads, kv_heads, kv_heads))
    local_q, local_k, local_v = both.split(
        (heads // group.size, kv_heads // group.size, kv_heads // group.size), 1
    )
    output, _ = attention(module, local_q, local_k, local_v, **kwargs)
    return heads_to_tokens(output, group), None
