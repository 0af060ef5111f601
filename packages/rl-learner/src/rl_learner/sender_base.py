"""The base of every weight sender: `WeightSender`, the `SENDERS` registry, the per-bucket work.

A transport's sender (`rl_learner.senders`, or a plugin's) subclasses `WeightSender` and registers
with `@SENDERS.register("name")`; `rl_learner.sync` builds one from a spec (`make_sender`) and
plans the layout (`sync_layout`). What is shared lives here, so that the senders import it
without importing `rl_learner.sync`, which imports them: gathering a bucket's ZeRO-3
parameters, merging LoRA on a copy, casting while packing, and data-parallel rank 0 telling the
other ranks which bucket to gather next (see `rl_learner.sync`'s docstring).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from rl_algos import Registry
from rl_data import WeightSyncMeta, WeightSyncReport, pack_bucket
from rl_data.errors import check_integer
from rl_data.sync import WeightSyncError, WeightSyncSpec
from rl_data.weights import BucketMeta

from .adapter_sync import adapter_tensors
from .dtensor import dtensor_group, full_value
from .lora import MergedTensor, merged_tensors

__all__ = ["SENDERS", "WeightSender"]

# --- which tensors the engines receive ------------------------------------------------------------


def sent_tensors(model: Any) -> list[MergedTensor]:
    """The tensors the engines receive (`rl_learner.lora.merged_tensors`), in `named_parameters()`
    order, each storage once, parameters only."""
    return merged_tensors(model, where="sync")


def _check_layout(layout: WeightSyncMeta, sources: Sequence[MergedTensor], where: str) -> None:
    """Raise ValueError naming the differences between a layout and the tensors `model` yields."""
    planned = {param.name: param for bucket in layout.buckets for param in bucket.params}
    available = {source.name: source for source in sources}
    only_layout = [name for name in planned if name not in available]
    only_model = [name for name in available if name not in planned]
    shapes = [
        f"{name}: layout {planned[name].shape}, model {available[name].shape}"
        for name in planned.keys() & available.keys()
        if planned[name].shape != available[name].shape
    ]
    problems = []
    if only_layout:
        problems.append(f"{len(only_layout)} names only in the layout ({', '.join(only_layout[:5])})")
    if only_model:
        problems.append(f"{len(only_model)} names only in the model ({', '.join(only_model[:5])})")
    if shapes:
        problems.append(f"{len(shapes)} shapes differ ({'; '.join(sorted(shapes)[:5])})")
    if problems:
        raise ValueError(
            f"{where}: spec.layout does not match the model: {', '.join(problems)}; "
            "build the layout with rl_learner.sync.sync_layout(model)"
        )


# --- data-parallel coordination -------------------------------------------------------------------

_DONE = -1
_ABORT = -2


class _Coordinator:
    """Data-parallel rank 0 tells the other ranks which bucket to gather next (or that it is over)."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self._dist, self._group = dist, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._root = dist.get_global_rank(group, 0)
        backend = str(dist.get_backend(group)).lower()
        self._device = (
            torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        )

    def signal(self, value: int) -> None:
        self._dist.broadcast(
            torch.tensor([value], dtype=torch.int64, device=self._device), self._root, self._group
        )

    def wait(self) -> int:
        word = torch.empty(1, dtype=torch.int64, device=self._device)
        self._dist.broadcast(word, self._root, self._group)
        return int(word.item())


def _zero3_group(sources: Sequence[MergedTensor]) -> Any:
    """The data-parallel group of the ZeRO-3 partitioned parameters, None when there are none."""
    for source in sources:
        for param in source.params():
            if hasattr(param, "ds_id"):
                return getattr(param, "ds_process_group", None) or _default_group()
    return None


def _default_group() -> Any:
    import torch.distributed as dist

    return dist.group.WORLD


def _distributed_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# --- senders --------------------------------------------------------------------------------------


SENDERS = Registry("weight-sync sender")
"""transport name -> `WeightSender` subclass (`rl_learner.senders` holds the built-ins; a plugin
registers its own with `@SENDERS.register("name")`)."""


class WeightSender(abc.ABC):
    """Sends the weights of one model to its engines, one version per `send`; a strategy per transport.

    Every learner rank builds the sender from the same `spec` and calls `send` together (see the
    module docstring); `is_sender` says whether this rank talks to the engines. `layout` is the
    bucket layout (no checksums) that the engines were given in the same spec.
    """

    transport: ClassVar[str]
    every_rank_sends: ClassVar[bool] = False
    """Whether every learner rank sends to the engines on its own GPU (CUDA IPC), not only rank 0."""
    payload: Any = None
    """What the engines need from this rank to receive the last send, handed to them by the
    orchestrator (the "ipc" transport's `IpcPayload`); None where the transport carries it all."""

    def __init__(self, model: Any, spec: WeightSyncSpec, *, is_sender: bool | None = None) -> None:
        name = type(self).__name__
        if not isinstance(spec, WeightSyncSpec):
            raise TypeError(f"{name}: spec must be an rl_data.sync.WeightSyncSpec, got {type(spec).__name__}")
        if spec.transport != self.transport:
            raise ValueError(
                f"{name}: spec.transport is {spec.transport!r}, this sender handles {self.transport!r}"
            )
        self.spec = spec
        self.layout: WeightSyncMeta = spec.layout.layout_only()
        # a spec with an adapter (LoRA adapter sync, `rl_learner.adapter_sync`) sends the adapter only
        sources = adapter_tensors(model, where=name) if spec.adapter is not None else sent_tensors(model)
        self._sources = {source.name: source for source in sources}
        _check_layout(self.layout, list(self._sources.values()), name)
        zero3 = _zero3_group(list(self._sources.values()))
        # FSDP2 / tensor-parallel DTensors: gathered bucket by bucket like ZeRO-3 (rl_learner.dtensor)
        sharded = dtensor_group((p for s in self._sources.values() for p in s.params()), where=name)
        self._zero3, self._dtensor = zero3 is not None, sharded is not None
        group = zero3 if zero3 is not None else sharded
        if is_sender is None:
            if self.every_rank_sends:
                is_sender = True
            elif group is not None:
                import torch.distributed as dist

                is_sender = dist.get_rank(group) == 0
            else:
                is_sender = _distributed_rank() == 0
        self.is_sender = bool(is_sender)
        self._coordinator = _Coordinator(group) if group is not None and not self.every_rank_sends else None
        if self._coordinator is not None and self._coordinator.size == 1:
            self._coordinator = None
        self.last_report: WeightSyncReport | None = None
        self._closed = False

    # The per-bucket work: gather (ZeRO-3), merge LoRA, cast while packing.
    def _gathered(self, bucket: BucketMeta) -> Any:
        if not self._zero3:
            return contextlib.nullcontext()
        import deepspeed

        params: list[torch.nn.Parameter] = []
        ids: set[int] = set()
        for param_meta in bucket.params:
            for param in self._sources[param_meta.name].params():
                if id(param) not in ids and hasattr(param, "ds_id"):
                    ids.add(id(param))
                    params.append(param)
        return deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=bool(params))

    def _produce(self, bucket: BucketMeta, out: torch.Tensor) -> torch.Tensor:
        """Fill `out` (`[bucket.nbytes]` uint8) with the bucket's tensors, gathered, merged and cast."""
        if self._coordinator is not None:
            self._coordinator.signal(bucket.index)
        with self._gathered(bucket), torch.no_grad():
            tensors = {param.name: full_value(self._sources[param.name]) for param in bucket.params}
            return pack_bucket(bucket, tensors, out=out)

    def _follow(self, version: int) -> None:
        """A data-parallel rank other than 0: join the gathers rank 0 announces until it is done."""
        while True:
            index = self._coordinator.wait()
            if index == _DONE:
                return
            if index == _ABORT:
                raise WeightSyncError(
                    f"{type(self).__name__}.send: data-parallel rank 0 failed to send version {version}; "
                    "its own error says why"
                )
            if not 0 <= index < len(self.layout.buckets):
                raise WeightSyncError(f"{type(self).__name__}.send: rank 0 announced bucket {index}, unknown")
            bucket = self.layout.buckets[index]
            with self._gathered(bucket), torch.no_grad():
                if self._dtensor:  # take part in rank 0's full_tensor() gathers, in its order
                    for param in bucket.params:
                        full_value(self._sources[param.name])

    def send(self, version: int) -> WeightSyncReport | None:
        """Send the model's current weights as `version`; call it on every learner rank together.

        Returns this rank's `WeightSyncReport` (bytes, seconds, per-bucket checksums of the
        buffers as sent) where `is_sender`, else None. Raises `WeightSyncError` when the sync
        fails (a receiver rejected the layout, a transfer broke) on every rank of the learner.
        """
        check_integer(f"{type(self).__name__}.send: version", version, 0)
        if self._closed:
            raise RuntimeError(f"{type(self).__name__}.send: the sender is closed")
        if not self.is_sender:
            if self._coordinator is not None:
                self._follow(version)
            return None
        if self._coordinator is None:
            report = self._send(version)
        else:
            try:
                report = self._send(version)
            except BaseException:
                self._coordinator.signal(_ABORT)
                raise
            self._coordinator.signal(_DONE)
        self.last_report = report
        return report

    @abc.abstractmethod
    def _send(self, version: int) -> WeightSyncReport:
        """Move every bucket of `self.layout` (built by `self._produce`) to the engines."""

    def release(self) -> None:  # noqa: B027 - most transports keep nothing for the engines
        """Free what the last send keeps for the engines (after every engine has received it)."""

    def close(self) -> None:
        """Release the transport (idempotent)."""
        self._closed = True

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
