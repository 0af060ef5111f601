"""The "file" transport's sender: each version as bucket files in a folder (`rl_data.sync.file`)."""

from __future__ import annotations

from typing import Any

from rl_data import WeightSyncReport
from rl_data.errors import check_integer
from rl_data.sync import WeightSyncSpec
from rl_data.sync.file import write_buckets

from ..sender_base import SENDERS, WeightSender

__all__ = ["FileSender"]


@SENDERS.register("file")
class FileSender(WeightSender):
    """Write each version as bucket files under `spec.directory` (`rl_data.sync.file.write_buckets`).

    The engines read `directory/version-<v>/` with `read_buckets`; a version appears atomically.
    `keep`: how many newest versions stay on disk.
    """

    transport = "file"

    def __init__(
        self, model: Any, spec: WeightSyncSpec, *, keep: int = 1, is_sender: bool | None = None
    ) -> None:
        super().__init__(model, spec, is_sender=is_sender)
        check_integer("FileSender: keep", keep, 1)
        self.directory, self.keep = spec.directory, keep

    def _send(self, version: int) -> WeightSyncReport:
        return write_buckets(self.directory, self.layout, self._produce, version=version, keep=self.keep)
