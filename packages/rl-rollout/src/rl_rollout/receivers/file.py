"""The "file" transport's receiver: reads `directory/version-<v>/` (`rl_data.sync.file.read_buckets`)."""

from __future__ import annotations

from typing import Any

from rl_data import WeightSyncReport
from rl_data.sync import Consume
from rl_data.sync.file import read_buckets

from ..receiver_base import RECEIVERS, TransportReceiver

__all__ = ["FileReceiver"]


@RECEIVERS.register("file")
class FileReceiver(TransportReceiver):
    """Reads a version the sender has finished writing (it does not wait for one)."""

    def receive(self, version: int, consume: Consume, payload: Any, *, hold: bool) -> WeightSyncReport:
        return read_buckets(self.spec.directory, self.layout, consume, version=version)
