"""The "shm" transport's receiver: views over the sender's shared pages (`rl_data.sync.shm.ShmReader`)."""

from __future__ import annotations

from typing import Any

import torch

from rl_data import WeightSyncMeta, WeightSyncReport
from rl_data.sync import Consume, WeightSyncSpec
from rl_data.sync.shm import ShmReader

from ..receiver_base import RECEIVERS, TransportReceiver

__all__ = ["ShmReceiver"]


@RECEIVERS.register("shm")
class ShmReceiver(TransportReceiver):
    """Waits for the version to be published (up to `spec.timeout_s`), so `receive` may start before
    the sender's `send`; with `hold=True` the views stay valid until `release()`."""

    views_outlive_receive = True

    def __init__(
        self, spec: WeightSyncSpec, rank: int, layout: WeightSyncMeta, *, device: torch.device | str | None
    ) -> None:
        super().__init__(spec, rank, layout, device=device)
        self._reader: ShmReader | None = ShmReader(spec.directory, layout, timeout_s=spec.timeout_s)

    def receive(self, version: int, consume: Consume, payload: Any, *, hold: bool) -> WeightSyncReport:
        return self._reader.read(consume, version=version, hold=hold)

    def release(self) -> None:
        if self._reader is not None:
            self._reader.release()

    def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
