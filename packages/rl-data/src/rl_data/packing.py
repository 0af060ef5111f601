"""Padding-free sequence packing: many variable-length sequences in one row, and back.

A packed row concatenates S sequences into N tokens. Its boundaries are given by
`cu_seqlens` ([S+1], int32), in the flash-attention ("varlen") convention:

    cu_seqlens[0] = 0,   cu_seqlens[i+1] − cu_seqlens[i] = length of sequence i,   cu_seqlens[S] = N.

`position_ids` ([N], int64) restart at 0 at every sequence start, so rotary embeddings see each
sequence as if it were alone; `segment_ids` ([N]) give each token's sequence index. Attention
must not cross a boundary: flash-attention's varlen kernels take `cu_seqlens` directly;
`packed_attention_mask` builds the equivalent block-diagonal (causal) mask for plain
`scaled_dot_product_attention`, at O(N²) cost (a reference for tests, not for training).

`packed_to_padded` and `padded_to_packed` convert between the packed layout `[N, ...]` and the
padded `[S, L, ...]` layout the `rl_algos` functions take. They are pure index arithmetic with
one gather (or one boolean-mask select) over all sequences at once, with no Python loop over
sequences, and gradients flow through both.

Helpers that read `cu_seqlens` values (lengths, maxima, totals) synchronise with the device once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import msgspec
import torch

from .errors import check_integer

__all__ = [
    "PADDING_SIDES",
    "PackedSequences",
    "cu_seqlens_from_lengths",
    "lengths_from_cu_seqlens",
    "pack_sequences",
    "packed_attention_mask",
    "packed_to_padded",
    "padded_to_packed",
    "position_ids_from_cu_seqlens",
    "segment_ids",
    "unpack_sequences",
]

PADDING_SIDES: tuple[str, ...] = ("right", "left")
CU_SEQLENS_DTYPE = torch.int32


class PackedSequences(msgspec.Struct, frozen=True):
    """S sequences packed into one row of N tokens.

    Fields:
        values:        [N] the tokens of every sequence, concatenated, then any tail padding.
        position_ids:  [N] int64, 0, 1, ... restarting at every segment start.
        cu_seqlens:    [num_segments + 1] int32 segment boundaries (flash-attention convention).
        max_seqlen:    length of the longest segment (padding segment included), the
                       `max_seqlen` argument of flash-attention's varlen kernels.
        num_sequences: number of real sequences S. When `pack_sequences` padded the row to a
                       multiple, the padding is one more segment after them, so
                       `num_segments = S + 1` and `cu_seqlens[S]` is the number of real tokens.
    """

    values: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_sequences: int

    @property
    def num_segments(self) -> int:
        """Segments in `cu_seqlens`: the real sequences plus the padding segment, if any."""
        return self.cu_seqlens.numel() - 1

    @property
    def num_padding(self) -> int:
        """Tokens of tail padding (0 when no padding segment was added)."""
        return self.values.shape[0] - int(self.cu_seqlens[self.num_sequences])

    @property
    def sequence_cu_seqlens(self) -> torch.Tensor:
        """[S+1] boundaries of the real sequences only (the padding segment left out)."""
        return self.cu_seqlens[: self.num_sequences + 1]

    def unpack(self, values: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The real sequences of `values` ([N, ...] or [1, N, ...]; default `self.values`) as views."""
        values = self.values if values is None else values
        return unpack_sequences(values, self.cu_seqlens)[: self.num_sequences]


# --------------------------------------------------------------------------- checks


def _check_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], name: str = "cu_seqlens") -> torch.Tensor:
    """`cu_seqlens` as a 1-D int64 tensor, after checking it starts at 0 and never decreases."""
    if not isinstance(cu_seqlens, torch.Tensor):
        try:
            cu_seqlens = torch.tensor(list(cu_seqlens), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"{name}: expected a 1-D sequence of integers ({error})") from None
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise ValueError(f"{name} must have shape [S+1] with S >= 0, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool or cu_seqlens.is_complex():
        raise TypeError(f"{name} must hold integers, got dtype {cu_seqlens.dtype}")
    cu_seqlens = cu_seqlens.to(torch.int64)
    first = int(cu_seqlens[0])
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {first}")
    steps = cu_seqlens[1:] - cu_seqlens[:-1]
    if steps.numel() and bool((steps < 0).any()):
        where = int(torch.nonzero(steps < 0)[0, 0])
        raise ValueError(
            f"{name} must be non-decreasing, got {name}[{where}] = {int(cu_seqlens[where])} > "
            f"{name}[{where + 1}] = {int(cu_seqlens[where + 1])}"
        )
    return cu_seqlens


def _check_lengths(lengths: torch.Tensor | Sequence[int], name: str = "lengths") -> torch.Tensor:
    """`lengths` as a 1-D int64 tensor of non-negative values."""
    if not isinstance(lengths, torch.Tensor):
        try:
            lengths = torch.tensor(list(lengths), dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"{name}: expected a 1-D sequence of integers ({error})") from None
    if lengths.dim() != 1:
        raise ValueError(f"{name} must have shape [S], got shape {tuple(lengths.shape)}")
    if lengths.is_floating_point() or lengths.dtype == torch.bool or lengths.is_complex():
        raise TypeError(f"{name} must hold integers, got dtype {lengths.dtype}")
    lengths = lengths.to(torch.int64)
    if lengths.numel() and bool((lengths < 0).any()):
        where = int(torch.nonzero(lengths < 0)[0, 0])
        raise ValueError(f"{name} must be >= 0, got {name}[{where}] = {int(lengths[where])}")
    return lengths


def _check_padding_side(padding_side: str) -> None:
    if padding_side not in PADDING_SIDES:
        raise ValueError(f"padding_side must be one of {PADDING_SIDES}, got {padding_side!r}")


def _check_total(name: str, packed: torch.Tensor, total: int, source: str) -> None:
    if packed.shape[0] != total:
        raise ValueError(
            f"{name} has {packed.shape[0]} tokens (shape {tuple(packed.shape)}) but the lengths in "
            f"{source} add up to {total}; they must match"
        )


# --------------------------------------------------------------------------- cu_seqlens helpers


def cu_seqlens_from_lengths(lengths: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """[S] lengths → [S+1] int32 `cu_seqlens` = (0, l₀, l₀+l₁, ..., Σ l)."""
    lengths = _check_lengths(lengths)
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=CU_SEQLENS_DTYPE, device=lengths.device)
    if lengths.numel():
        cu_seqlens[1:] = torch.cumsum(lengths, dim=0)
    return cu_seqlens


def lengths_from_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """[S+1] `cu_seqlens` → [S] int64 lengths lᵢ = cu_seqlens[i+1] − cu_seqlens[i]."""
    cu_seqlens = _check_cu_seqlens(cu_seqlens)
    return cu_seqlens[1:] - cu_seqlens[:-1]


def segment_ids(cu_seqlens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """[N] int64: the index i of the sequence each token belongs to (cu_seqlens[i] ≤ t < cu_seqlens[i+1])."""
    cu_seqlens = _check_cu_seqlens(cu_seqlens)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    sequence = torch.arange(lengths.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(sequence, lengths, output_size=int(cu_seqlens[-1]))


def position_ids_from_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """[N] int64 positions t − cu_seqlens[i] of every token t of sequence i (0 at each sequence start)."""
    cu_seqlens = _check_cu_seqlens(cu_seqlens)
    total = int(cu_seqlens[-1])
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - starts


def packed_attention_mask(cu_seqlens: torch.Tensor | Sequence[int], *, causal: bool = True) -> torch.Tensor:
    """[N, N] bool mask: token q may attend to token k iff both are in the same sequence (and k ≤ q if causal).

    True means "attend", the convention of `torch.nn.functional.scaled_dot_product_attention`,
    so attention over a packed row with this mask equals attention run on every sequence
    alone. It is O(N²): N² bytes here (256 MiB at N = 16,384, 4× that as a float mask), and
    attention under it does N² work instead of ΣLᵢ², and rules out flash kernels. Meant for
    tests and benchmarks only: the packed forwards of `rl_learner.models` run attention in length
    buckets or flash-attention's varlen kernels, which take `cu_seqlens` instead. A zero-length
    sequence contributes no rows.
    """
    segments = segment_ids(cu_seqlens)
    mask = segments[:, None] == segments[None, :]
    if causal:
        mask = torch.tril(mask)
    return mask


# --------------------------------------------------------------------------- pack / unpack


def _as_sequence_tensor(sequence: torch.Tensor | Sequence[int], index: int) -> torch.Tensor:
    if isinstance(sequence, torch.Tensor):
        tensor = sequence
    else:
        try:
            items = list(sequence)
            tensor = torch.tensor(items) if items else torch.empty(0, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(
                f"sequences[{index}]: expected a 1-D tensor or a list of ints, got {type(sequence).__name__} "
                f"({error})"
            ) from None
    if tensor.dim() != 1:
        raise ValueError(f"sequences[{index}] must be 1-D, got shape {tuple(tensor.shape)}")
    return tensor


def pack_sequences(
    sequences: Sequence[torch.Tensor | Sequence[int]], *, pad_to_multiple_of: int = 1, pad_value: int = 0
) -> PackedSequences:
    """Concatenate S 1-D sequences into one packed row with its `cu_seqlens` and `position_ids`.

    With `pad_to_multiple_of` = m > 1 the row is padded at the end with `pad_value` to N' =
    ⌈N / m⌉·m tokens (tensor-parallel and sequence-parallel layouts want N divisible by their
    degree). The p = N' − N padding tokens (0 ≤ p < m) form one extra segment of their own in
    `cu_seqlens` (positions 0..p−1), so that attention never mixes padding with a real
    sequence; `num_sequences` stays S and `unpack()` / `sequence_cu_seqlens` leave it out.
    No segment is added when N is already a multiple of m.

    Args:
      sequences: S ≥ 1 sequences, each a 1-D tensor or a list of ints (lists become int64).
        Tensors must share one dtype and device. Empty sequences are allowed.
      pad_to_multiple_of: m ≥ 1.
      pad_value: value of the padding tokens.

    Returns:
      `PackedSequences` with `values` [N'], `position_ids` [N'] int64, `cu_seqlens` int32
      ([S+1], or [S+2] with a padding segment), `max_seqlen` and `num_sequences` = S.
    """
    if isinstance(sequences, torch.Tensor) or not isinstance(sequences, Sequence):
        raise TypeError(
            f"sequences must be a list of 1-D tensors or lists of ints, got {type(sequences).__name__}"
        )
    if len(sequences) == 0:
        raise ValueError("sequences is empty; at least one sequence is needed")
    check_integer("pad_to_multiple_of", pad_to_multiple_of, 1)
    tensors = [_as_sequence_tensor(sequence, index) for index, sequence in enumerate(sequences)]
    reference = next((t for t in tensors if t.numel()), tensors[0])
    for index, tensor in enumerate(tensors):
        if tensor.numel() == 0:
            tensors[index] = tensor.to(dtype=reference.dtype, device=reference.device)
        elif tensor.dtype != reference.dtype or tensor.device != reference.device:
            raise ValueError(
                f"sequences[{index}] has dtype {tensor.dtype} on {tensor.device} but the others have "
                f"{reference.dtype} on {reference.device}; they must match"
            )
    lengths = [t.numel() for t in tensors]
    total = sum(lengths)
    padding = -total % pad_to_multiple_of
    if padding:
        tensors.append(torch.full((padding,), pad_value, dtype=reference.dtype, device=reference.device))
        lengths.append(padding)
    cu_seqlens = cu_seqlens_from_lengths(torch.tensor(lengths, dtype=torch.int64)).to(reference.device)
    return PackedSequences(
        values=torch.cat(tensors),
        position_ids=position_ids_from_cu_seqlens(cu_seqlens),
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lengths),
        num_sequences=len(sequences),
    )


def _unbatch(packed: torch.Tensor, total: int) -> torch.Tensor:
    """[1, N, ...] → [N, ...]; [N, ...] unchanged."""
    if packed.dim() >= 2 and packed.shape[0] == 1 and packed.shape[0] != total and packed.shape[1] == total:
        return packed[0]
    return packed


def unpack_sequences(packed: torch.Tensor, cu_seqlens: torch.Tensor | Sequence[int]) -> list[torch.Tensor]:
    """Split a packed row `[N, ...]` (or `[1, N, ...]`) into its S sequences `[lᵢ, ...]`, as views.

    Every segment of `cu_seqlens` comes back, a padding segment included; use
    `PackedSequences.unpack` to get only the real sequences.
    """
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    cu_seqlens = _check_cu_seqlens(cu_seqlens)
    bounds = cu_seqlens.tolist()
    if packed.dim() == 0:
        raise ValueError(f"packed must have shape [N, ...] or [1, N, ...], got shape {tuple(packed.shape)}")
    packed = _unbatch(packed, bounds[-1])
    _check_total("packed", packed, bounds[-1], "cu_seqlens")
    lengths = [end - start for start, end in itertools.pairwise(bounds)]
    return list(torch.split(packed, lengths, dim=0))


# --------------------------------------------------------------------------- packed <-> padded


def _padded_token_index(
    cu_seqlens: torch.Tensor, lengths: torch.Tensor, width: int, padding_side: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, L] packed index of every padded slot, and [S, L] validity.

    Right padding: slot j of sequence i holds token cu[i] + j when j < lᵢ.
    Left padding:  slot j holds token cu[i] + j − (L − lᵢ) when j ≥ L − lᵢ.
    """
    columns = torch.arange(width, device=cu_seqlens.device)
    if padding_side == "right":
        offset = columns[None, :]
        valid = offset < lengths[:, None]
    else:
        offset = columns[None, :] - (width - lengths)[:, None]
        valid = offset >= 0
    return cu_seqlens[:-1, None] + offset, valid


def packed_to_padded(
    packed: torch.Tensor,
    cu_seqlens: torch.Tensor | Sequence[int],
    *,
    pad_value: float = 0,
    padding_side: str = "right",
) -> torch.Tensor:
    """Packed `[N, ...]` (or `[1, N, ...]`) → padded `[S, L_max, ...]`, L_max = the longest sequence.

    out[i, j] = packed[cu[i] + j] for j < lᵢ and `pad_value` elsewhere (right padding); with
    left padding sequence i occupies the last lᵢ slots of its row. One gather over all
    sequences; the gradient flows back to `packed` (padding slots get none).
    """
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    _check_padding_side(padding_side)
    cu_seqlens = _check_cu_seqlens(cu_seqlens).to(packed.device)
    total = int(cu_seqlens[-1])
    if packed.dim() == 0:
        raise ValueError(f"packed must have shape [N, ...] or [1, N, ...], got shape {tuple(packed.shape)}")
    packed = _unbatch(packed, total)
    _check_total("packed", packed, total, "cu_seqlens")
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    width = int(lengths.max()) if lengths.numel() else 0
    index, valid = _padded_token_index(cu_seqlens, lengths, width, padding_side)
    # Invalid slots read one extra row holding pad_value, so the whole result is a single gather.
    filler = torch.full((1, *packed.shape[1:]), pad_value, dtype=packed.dtype, device=packed.device)
    extended = torch.cat([packed, filler])
    return extended[torch.where(valid, index, total)]


def padded_to_packed(
    padded: torch.Tensor, lengths: torch.Tensor | Sequence[int], *, padding_side: str = "right"
) -> torch.Tensor:
    """Padded `[S, L, ...]` → packed `[N, ...]`, N = Σ lᵢ, keeping the first (right padding) or
    last (left padding) lᵢ slots of row i, in order. The inverse of `packed_to_padded`.

    One boolean-mask select; the gradient flows back to `padded` (padding slots get zero).
    """
    if not isinstance(padded, torch.Tensor):
        raise TypeError(f"padded must be a torch.Tensor, got {type(padded).__name__}")
    _check_padding_side(padding_side)
    if padded.dim() < 2:
        raise ValueError(f"padded must have shape [S, L, ...], got shape {tuple(padded.shape)}")
    lengths = _check_lengths(lengths).to(padded.device)
    rows, width = padded.shape[0], padded.shape[1]
    if lengths.numel() != rows:
        raise ValueError(
            f"lengths has {lengths.numel()} entries but padded has {rows} rows (shape {tuple(padded.shape)})"
        )
    if rows and bool((lengths > width).any()):
        where = int(torch.nonzero(lengths > width)[0, 0])
        raise ValueError(
            f"lengths[{where}] = {int(lengths[where])} is longer than the padded width {width} "
            f"(padded shape {tuple(padded.shape)})"
        )
    columns = torch.arange(width, device=padded.device)
    if padding_side == "right":
        valid = columns[None, :] < lengths[:, None]
    else:
        valid = columns[None, :] >= (width - lengths)[:, None]
    return padded[valid]
