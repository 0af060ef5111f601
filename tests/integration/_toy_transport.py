"""A toy weight-sync transport registered from outside the packages, one section per side.

"toy_folder" copies every bucket through a folder named in the spec's `options` (its own field,
not one of the built-ins'): the sender writes `bucket-<i>-v<version>.bin` and a checksum file,
the receiver reads them back and checks each bucket. It is what a plugin module passed with
`--plugin` would hold: imported in every process, it registers the wire spec (rl_data), the
sender (rl_learner) and the receiver (rl_rollout) under one name.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

import torch

from rl_data import WeightSyncReport, bucket_checksum, unpack_bucket
from rl_data.sync import Transport, WeightSyncError, WeightSyncSpec, register_transport
from rl_learner import SENDERS, WeightSender
from rl_rollout import RECEIVERS, TransportReceiver

NAME = "toy_folder"


def _check(spec: WeightSyncSpec) -> None:
    if not spec.options.get("folder"):
        raise ValueError("WeightSyncSpec.options.folder: the toy_folder transport needs a folder")


register_transport(
    Transport(name=NAME, check=_check, doc="buckets copied through options.folder"), override=True
)


def _path(spec: WeightSyncSpec, index: int, version: int) -> pathlib.Path:
    return pathlib.Path(spec.options["folder"]) / f"bucket-{index}-v{version}.bin"


class ToySender(WeightSender):
    transport = NAME

    def _send(self, version: int) -> WeightSyncReport:
        start, checksums = time.perf_counter(), []
        for bucket in self.layout.buckets:
            out = self._produce(bucket, torch.empty(bucket.nbytes, dtype=torch.uint8))
            checksums.append(bucket_checksum(out))
            _path(self.spec, bucket.index, version).write_bytes(out.numpy().tobytes())
            _path(self.spec, bucket.index, version).with_suffix(".sum").write_text(str(checksums[-1]))
        return WeightSyncReport(
            version=version,
            num_bytes=self.layout.total_bytes,
            seconds=time.perf_counter() - start,
            checksums=tuple(checksums),
        )


class ToyReceiver(TransportReceiver):
    def receive(self, version: int, consume: Any, payload: Any, *, hold: bool) -> WeightSyncReport:
        start, checksums = time.perf_counter(), []
        for bucket in self.layout.buckets:
            path = _path(self.spec, bucket.index, version)
            buffer = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
            got, sent = bucket_checksum(buffer), int(path.with_suffix(".sum").read_text())
            if got != sent:
                raise WeightSyncError(f"toy_folder: {path} has checksum {got:#x}, the sender wrote {sent:#x}")
            checksums.append(got)
            consume(bucket, unpack_bucket(bucket, buffer))
        return WeightSyncReport(
            version=version,
            num_bytes=self.layout.total_bytes,
            seconds=time.perf_counter() - start,
            checksums=tuple(checksums),
        )


SENDERS.register(NAME, ToySender, override=True)
RECEIVERS.register(NAME, ToyReceiver, override=True)
