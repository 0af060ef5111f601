"""Batches of row indices in a reproducible order that can stop and resume anywhere.

A training run reads its prompts in epochs. Epoch `e` visits the rows `0 … N-1` in the order
`π_e`, a permutation that depends only on `(seed, e)`:

    π_e = randperm(N, generator=torch.Generator().manual_seed(s_e)),
    s_e = the first 63 bits of numpy's SeedSequence([seed, e]),

(or `0 … N-1` itself without shuffling) and is cut into consecutive batches of `batch_size`
rows; with `drop_last` the last `N mod batch_size` rows of each epoch are left out, otherwise
they form one smaller batch. `SeedSequence` hashes seed and epoch together, so that, unlike
`seed + e`, run 42's second epoch is not run 43's first.

The whole position of the reader is `(epoch, position)`, `position` being how many rows of
the epoch's order were already handed out. `state_dict()` returns it with the settings that
define the order (a `SamplerState`, msgspec-serialisable), and `load_state_dict` continues a
new sampler exactly where the old one stopped: the batches after a resume are the batches an
uninterrupted run would have yielded. A state whose settings differ (another dataset size, batch
size, seed...) is refused, since the same position would then mean other rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import msgspec
import numpy as np
import torch

from ..errors import DataError, check_integer, type_name
from ..records import PromptSample

__all__ = ["PromptLoader", "ResumableSampler", "SamplerState", "epoch_seed"]


class SamplerState(msgspec.Struct, kw_only=True):
    """Where a `ResumableSampler` stands, with the settings that define its order.

    Fields:
        seed, num_rows, batch_size, drop_last, shuffle: the sampler's settings; a state only
            loads into a sampler with the same ones.
        epoch:            the current epoch (0-based).
        position:         rows of this epoch's order already handed out (0 <= position <= num_rows).
        consumed_samples: rows handed out since the start of training, over all epochs.
    """

    seed: int
    num_rows: int
    batch_size: int
    drop_last: bool
    shuffle: bool
    epoch: int = 0
    position: int = 0
    consumed_samples: int = 0


# Settings that must match between a checkpoint and the sampler it is loaded into.
SETTINGS: tuple[str, ...] = ("seed", "num_rows", "batch_size", "shuffle", "drop_last")


def epoch_seed(seed: int, epoch: int) -> int:
    """The torch seed of epoch `epoch`: the first 63 bits of `SeedSequence([seed, epoch])`."""
    state = np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0]
    return int(state) >> 1


class ResumableSampler:
    """Batches of row indices, epoch after epoch, with a state to checkpoint and resume.

    Iterating the sampler (`for batch in sampler`) yields batches forever, epoch after epoch,
    starting at the current state; `iter_epoch()` yields only the rest of the current epoch.
    Each batch is a list of `int` row indices. The state moves as each batch is handed out, so
    `state_dict()` taken after receiving a batch resumes with the next one. The sampler is its
    own cursor: two loops over it at once share (and advance) the same position.

    Args:
        num_rows: rows in the dataset (N >= 1).
        batch_size: rows per batch (B >= 1); with `drop_last`, B <= N.
        seed: integer >= 0 that fixes every epoch's order.
        shuffle: visit rows in a new random order each epoch; in file order otherwise.
        drop_last: leave out the last N mod B rows of each epoch instead of a smaller batch.
    """

    def __init__(
        self, num_rows: int, *, batch_size: int, seed: int = 42, shuffle: bool = True, drop_last: bool = True
    ) -> None:
        self.num_rows = check_integer("num_rows", num_rows, 1)
        self.batch_size = check_integer("batch_size", batch_size, 1)
        self.seed = check_integer("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        if self.drop_last and self.batch_size > self.num_rows:
            raise ValueError(
                f"batch_size: {batch_size} is larger than the {num_rows} rows, and drop_last=True "
                "would yield no batch at all; lower batch_size or pass drop_last=False"
            )
        self.epoch = 0
        self.position = 0
        self.consumed_samples = 0
        self._order: torch.Tensor | None = None
        self._order_epoch = -1

    def __len__(self) -> int:
        """Batches per epoch: ⌊N / B⌋ with drop_last, ⌈N / B⌉ without."""
        if self.drop_last:
            return self.num_rows // self.batch_size
        return -(-self.num_rows // self.batch_size)

    @property
    def rows_per_epoch(self) -> int:
        """Rows handed out per epoch (N, or N - N mod B with drop_last)."""
        return len(self) * self.batch_size if self.drop_last else self.num_rows

    def order(self, epoch: int) -> torch.Tensor:
        """`[N]` int64: the row order of `epoch` (cached for the current epoch)."""
        if epoch != self._order_epoch or self._order is None:
            if self.shuffle:
                generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
                self._order = torch.randperm(self.num_rows, generator=generator)
            else:
                self._order = torch.arange(self.num_rows)
            self._order_epoch = epoch
        return self._order

    def iter_epoch(self) -> Iterator[list[int]]:
        """Yield the remaining batches of the current epoch, then move to the next epoch."""
        epoch = self.epoch
        order = self.order(epoch)
        end = self.rows_per_epoch
        while self.epoch == epoch and self.position < end:
            start = self.position
            stop = min(start + self.batch_size, end)
            batch = order[start:stop].tolist()
            self.consumed_samples += len(batch)
            if stop >= end:
                self.epoch, self.position = epoch + 1, 0
            else:
                self.position = stop
            yield batch
        if self.epoch == epoch:
            # Entered past the last full batch (a resumed state with drop_last): nothing left.
            self.epoch, self.position = epoch + 1, 0

    def __iter__(self) -> Iterator[list[int]]:
        """Yield batches forever, epoch after epoch, from the current state."""
        while True:
            yield from self.iter_epoch()

    def state_dict(self) -> SamplerState:
        """The current position and the settings, as a `SamplerState` (a fresh copy)."""
        return SamplerState(
            seed=self.seed,
            num_rows=self.num_rows,
            batch_size=self.batch_size,
            drop_last=self.drop_last,
            shuffle=self.shuffle,
            epoch=self.epoch,
            position=self.position,
            consumed_samples=self.consumed_samples,
        )

    def load_state_dict(self, state: SamplerState | Mapping[str, Any]) -> None:
        """Continue from `state` (a `SamplerState` or its dict form).

        Raises:
            DataError: a setting differs from this sampler's (names the field and both values),
                or the position is outside the epoch.
        """
        if isinstance(state, Mapping):
            state = msgspec.convert(dict(state), type=SamplerState)
        if not isinstance(state, SamplerState):
            raise TypeError(f"state: expected a SamplerState or a dict, got {type_name(state)}")
        for field in SETTINGS:
            saved, current = getattr(state, field), getattr(self, field)
            if saved != current:
                raise DataError(
                    f"sampler state: {field} is {saved!r} in the checkpoint but {current!r} now; "
                    "the data or the loader settings changed since the checkpoint, so its position "
                    "would point at other rows"
                )
        if state.epoch < 0 or state.consumed_samples < 0:
            raise DataError(
                f"sampler state: epoch {state.epoch} and consumed_samples {state.consumed_samples} must be >= 0"
            )
        if not 0 <= state.position <= self.num_rows:
            raise DataError(f"sampler state: position {state.position} is outside 0..{self.num_rows}")
        self.epoch, self.position, self.consumed_samples = state.epoch, state.position, state.consumed_samples


class PromptLoader:
    """Batches of `PromptSample`s from a dataset, in a `ResumableSampler`'s order.

    Iterating yields lists of `dataset[i]` forever, epoch after epoch; `iter_epoch()` yields the
    rest of the current epoch. `state_dict` / `load_state_dict` checkpoint and resume the
    position (see `ResumableSampler`).

    Args:
        dataset: anything with `__len__` and `__getitem__(int)`, e.g. a `PromptDataset`.
        batch_size, seed, shuffle, drop_last: as for `ResumableSampler`.
    """

    def __init__(
        self, dataset: Any, *, batch_size: int, seed: int = 42, shuffle: bool = True, drop_last: bool = True
    ):
        self.dataset = dataset
        self.sampler = ResumableSampler(
            len(dataset), batch_size=batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last
        )

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.sampler)

    def iter_epoch(self) -> Iterator[list[PromptSample]]:
        """The remaining batches of the current epoch."""
        for indices in self.sampler.iter_epoch():
            yield [self.dataset[index] for index in indices]

    def __iter__(self) -> Iterator[list[PromptSample]]:
        """Batches forever, epoch after epoch, from the current state."""
        for indices in self.sampler:
            yield [self.dataset[index] for index in indices]

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @property
    def consumed_samples(self) -> int:
        return self.sampler.consumed_samples

    def state_dict(self) -> SamplerState:
        return self.sampler.state_dict()

    def load_state_dict(self, state: SamplerState | Mapping[str, Any]) -> None:
        self.sampler.load_state_dict(state)
