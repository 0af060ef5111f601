"""The "ipc" transport's sender: CUDA IPC handles of buffers on the learner's own GPU (`rl_data.sync.ipc`)."""

from __future__ import annotations

import time
from typing import Any

import torch

from rl_data import WeightSyncReport
from rl_data.sync import WeightSyncSpec
from rl_data.sync.ipc import IpcPayload, share_buckets

from ..sender_base import SENDERS, WeightSender

__all__ = ["IpcSender"]


@SENDERS.register("ipc")
class IpcSender(WeightSender):
    """CUDA IPC for engines on the learner's own GPUs: every bucket packed into a buffer they map.

    Every learner rank is a sender for the engines on its GPU (under ZeRO-3 each rank holds the
    full bucket while it is gathered). `send` packs all buckets into buffers on `device`, keeps
    them alive and sets `payload` (an `rl_data.sync.ipc.IpcPayload`: the layout stamped with
    version and checksums, one handle per bucket) for the orchestrator to hand to the engines
    (`read_ipc_buckets`). The buffers stay until `release()` or the next `send`: release only
    after every engine has returned. Peak extra GPU memory: the whole model in the layout dtype.
    The report's seconds cover the packing only.
    """

    transport = "ipc"
    every_rank_sends = True

    def __init__(
        self,
        model: Any,
        spec: WeightSyncSpec,
        *,
        device: torch.device | str | None = None,
        is_sender: bool | None = None,
    ) -> None:
        super().__init__(model, spec, is_sender=is_sender)
        if device is None:
            if not torch.cuda.is_available():
                raise ValueError("IpcSender: CUDA IPC needs a CUDA device and none is available")
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"IpcSender: device must be a CUDA device, got {self.device}")
        self.payload: IpcPayload | None = None
        self._buffers: list[torch.Tensor] = []

    def _send(self, version: int) -> WeightSyncReport:
        self.release()
        start = time.perf_counter()
        payload, buffers = share_buckets(self.layout, self._produce, version=version, device=self.device)
        self.payload, self._buffers = payload, buffers
        return WeightSyncReport(
            version=version,
            num_bytes=self.layout.total_bytes,
            seconds=time.perf_counter() - start,
            checksums=tuple(int(checksum) for checksum in payload.layout.checksums),
        )

    def release(self) -> None:
        """Free the buffers of the last send (after every engine has read them)."""
        self.payload, self._buffers = None, []

    def close(self) -> None:
        super().close()
        self.release()
