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

import inspect
from typing import Any

import torch

from rl_algos import Registry
from rl_data import WeightSyncMeta, plan_buckets
from rl_data.errors import check_integer
from rl_data.sync import WeightSyncSpec

from .lora import MergedTensor, check_wire_dtype
from .sender_base import SENDERS, WeightSender, sent_tensors

__all__ = ["make_sender", "sync_layout"]

DEFAULT_BUCKET_BYTES = 256 * 2**20

# --- which tensors the engines receive ------------------------------------------------------------


def _wire_dtype(source: MergedTensor, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is None or not source.param.dtype.is_floating_point:
        return source.param.dtype
    return dtype


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
        `deepspeed.DeepSpeedEngine` around one, ZeRO-3 partitioned or not, or a module whose
        parameters are DTensors (FSDP2 `fully_shard`, DTensor tensor parallelism: gathered with
        `full_tensor()` one bucket at a time, `rl_learner.dtensor`).
      dtype: the engine's dtype; floating parameters are cast to it when packed. None keeps each
        parameter's own dtype. Non-floating parameters always keep theirs.
      bucket_bytes: target bucket size in bytes (`rl_data.plan_buckets`); the peak extra memory
        of a sync is about two buckets (plus, under ZeRO-3, one bucket's gathered parameters).
      alignment: byte alignment of every parameter in a bucket, a power of two.

    Returns:
      A `WeightSyncMeta` with no checksums and version 0: one entry per tensor the engine loads,
      named as in the HF checkpoint (see the module docstring for peft and tied weights).
    """
    check_wire_dtype(dtype, "sync_layout")
    check_integer("sync_layout: bucket_bytes", bucket_bytes, 1)
    return plan_buckets(
        ((s.name, _wire_dtype(s, dtype), s.shape) for s in sent_tensors(model)),
        bucket_bytes=bucket_bytes,
        alignment=alignment,
    )


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
