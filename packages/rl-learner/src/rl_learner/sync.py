"""Weight sync, sending side: the learner's weights into the rollout engines, as a strategy.

A learner hands new weights to its engines after every policy update. What the engines expect
is the model as they loaded it: Hugging Face parameter names (`model.layers.0.self_attn.q_proj.weight`,
what `save_pretrained` writes and vLLM's `load_weights` takes), full (not sharded) tensors, in
the engine's dtype. What the learner holds may be a DeepSpeed engine, with ZeRO-3 shards instead
of full tensors, and a peft LoRA model whose base weights are frozen and whose update lives in
the adapters. This module bridges the two:

- `sync_layout(model, dtype=...)` is the bucket layout (`rl_data.WeightSyncMeta`) of the weights
  the engines receive, planned without gathering anything. The orchestrator puts it in the
  `rl_data.sync.WeightSyncSpec` that both sides get, once.
- A `WeightSender` moves one version of the weights per `send(version)`, bucket by bucket, and
  returns the sender's `WeightSyncReport` (bytes, seconds, per-bucket checksums) to compare with
  the receivers' (`rl_data.compare_checksums(sent, received) == []`). One strategy per
  transport, each in its own module of `rl_learner.senders` and found by name in `SENDERS`:
  `BroadcastSender` (a torch.distributed group of its own with the engines' workers: gloo on
  CPU, NCCL on GPU), `IpcSender` (CUDA IPC handles for engines on the same GPUs), `FileSender`
  (bucket files in a folder) and `ShmSender` (shared-memory slots for engines on the same
  machine); a plugin registers its own. `make_sender(spec, model)` picks one from the spec.

Per bucket, the sender (1) gathers exactly that bucket's ZeRO-3 parameters
(`deepspeed.zero.GatheredParameters(params, modifier_rank=None)`, released at the end of the
bucket), (2) merges LoRA into the base weights of that bucket on a copy,

    W' = W + Σ_a transpose(B_a @ A_a, fan_in_fan_out) · scaling_a       (W: [out, in], A_a: [r, in], B_a: [out, r])

over the active, not yet merged adapters `a` (DoRA too: `rl_learner.lora.merged_tensors`, the
walker `export_hf` uses as well; peft's `get_delta_weight`, added in the order and dtype
`merge_and_unload` uses, so the engine gets the same bits), and (3) casts to the layout's dtype
while packing (`rl_data.pack_bucket`). The live model is never modified.

Names the engine sees: a DeepSpeed engine's or DDP's `.module` is unwrapped; for a peft model the
`base_model.model.` prefix and `.base_layer` are dropped, the adapters (`lora_A`, `lora_B`,
`lora_embedding_*`, dropout) are not sent, and a `modules_to_save` module is sent under its
original name with the active adapter's copy of its weights. Tied weights are one storage and
are sent once, under the first name `named_parameters()` gives (`model.embed_tokens.weight`, not
`lm_head.weight`); a receiver whose model ties them too (HF, vLLM) updates both. Only
parameters are sent, not buffers.

Data-parallel learners. Every learner rank builds the same sender and calls `send(version)`
together: under ZeRO-3 each bucket's gather is a collective over the data-parallel group. Only
data-parallel rank 0 talks to the engines (broadcast, file); it tells the other ranks which
bucket to gather next (one small broadcast on the data-parallel group per bucket) and when the
sync ended or failed, so a sync that fails on rank 0 (a receiver rejected the layout) raises on
every rank instead of leaving them waiting in a gather. `send` returns the report on the
sending rank and None on the others. With CUDA IPC every rank shares its own gathered copy with
the engines on its own GPU, so every rank is a sender.

    layout = sync_layout(engine, dtype=torch.bfloat16)
    spec = WeightSyncSpec(transport="broadcast", layout=layout, port=port, world_size=1 + workers)
    sender = make_sender(spec, engine)           # rank 0 blocks here until the engines joined
    report = sender.send(version=step)           # on every learner rank
"""

from __future__ import annotations

import abc
import contextlib
import inspect
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from rl_algos import Registry
from rl_data import WeightSyncMeta, WeightSyncReport, pack_bucket, plan_buckets
from rl_data.errors import check_integer
from rl_data.sync import WeightSyncError, WeightSyncSpec
from rl_data.weights import BucketMeta

from .lora import MergedTensor, merged_tensors

__all__ = [
    "SENDERS",
    "WeightSender",
    "make_sender",
    "sync_layout",
]

DEFAULT_BUCKET_BYTES = 256 * 2**20

# --- which tensors the engines receive ------------------------------------------------------------


def _sources(model: Any) -> list[MergedTensor]:
    """The tensors the engines receive (`rl_learner.lora.merged_tensors`), in `named_parameters()`
    order, each storage once, parameters only."""
    return merged_tensors(model, where="sync")


def _wire_dtype(source: MergedTensor, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is None or not source.param.dtype.is_floating_point:
        return source.param.dtype
    return dtype


def _check_dtype(dtype: Any, where: str) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{where}: dtype must be None or a floating torch.dtype, got {dtype!r}")


def sync_layout(
    model: Any,
    *,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    alignment: int = 256,
) -> WeightSyncMeta:
    """The bucket layout of the weights the engines receive from `model`, planned without gathering.

    Args:
      model: an `nn.Module` (HF causal LM, or a peft model around one) or a
        `deepspeed.DeepSpeedEngine` around one, ZeRO-3 partitioned or not.
      dtype: the engine's dtype; floating parameters are cast to it when packed. None keeps each
        parameter's own dtype. Non-floating parameters always keep theirs.
      bucket_bytes: target bucket size in bytes (`rl_data.plan_buckets`); the peak extra memory
        of a sync is about two buckets (plus, under ZeRO-3, one bucket's gathered parameters).
      alignment: byte alignment of every parameter in a bucket, a power of two.

    Returns:
      A `WeightSyncMeta` with no checksums and version 0: one entry per tensor the engine loads,
      named as in the HF checkpoint (see the module docstring for peft and tied weights).
    """
    _check_dtype(dtype, "sync_layout")
    check_integer("sync_layout: bucket_bytes", bucket_bytes, 1)
    return plan_buckets(
        ((s.name, _wire_dtype(s, dtype), s.shape) for s in _sources(model)),
        bucket_bytes=bucket_bytes,
        alignment=alignment,
    )


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
        self._sources = {source.name: source for source in _sources(model)}
        _check_layout(self.layout, list(self._sources.values()), name)
        zero3 = _zero3_group(list(self._sources.values()))
        self._zero3 = zero3 is not None
        if is_sender is None:
            if self.every_rank_sends:
                is_sender = True
            elif zero3 is not None:
                import torch.distributed as dist

                is_sender = dist.get_rank(zero3) == 0
            else:
                is_sender = _distributed_rank() == 0
        self.is_sender = bool(is_sender)
        self._coordinator = _Coordinator(zero3) if zero3 is not None and not self.every_rank_sends else None
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
            tensors = {param.name: self._sources[param.name].value() for param in bucket.params}
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
            with self._gathered(self.layout.buckets[index]):
                pass

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


def _registered() -> Registry:
    """`SENDERS`, with the built-in senders imported (each module registers its own)."""
    from . import senders  # noqa: F401

    return SENDERS


def make_sender(
    spec: WeightSyncSpec, model: Any, *, is_sender: bool | None = None, **options: Any
) -> WeightSender:
    """The sender registered for `spec.transport` in `SENDERS`, built on `model`.

    `options` go to that sender's constructor, those it takes: `device` (broadcast, ipc), `keep`
    (file), `slots` (shm), a plugin sender's own; the others are left out, so one call serves
    every transport. An option that no registered sender takes is a TypeError.
    """
    if not isinstance(spec, WeightSyncSpec):
        raise TypeError(
            f"make_sender: spec must be an rl_data.sync.WeightSyncSpec, got {type(spec).__name__}"
        )
    senders = _registered()
    sender_class = senders[spec.transport]
    takes = set(inspect.signature(sender_class).parameters)
    unknown = sorted(
        name
        for name in options
        if not any(name in inspect.signature(other).parameters for other in senders.values())
    )
    if unknown:
        raise TypeError(f"make_sender: no weight sender takes {', '.join(unknown)}")
    given = {name: value for name, value in options.items() if name in takes}
    return sender_class(model, spec, is_sender=is_sender, **given)


def __getattr__(name: str) -> Any:
    # The built-in senders moved to `rl_learner.senders`; their old address keeps working.
    if name in ("BroadcastSender", "FileSender", "IpcSender", "ShmSender"):
        from . import senders

        return getattr(senders, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
