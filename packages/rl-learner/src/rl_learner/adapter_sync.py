"""Weight sync of a LoRA policy's adapter only: the sending side (`rl_data.adapters` is the wire side).

A LoRA policy's update lives in its adapters; its base weights never change. Instead of merging
the adapters into the base weights and sending the whole model every step (`rl_learner.sync`),
this sends the adapter tensors alone, which the engines serve on the base weights they loaded
once: r·(in + out) numbers per adapted layer instead of out·in, ~2 % of the model at rank 64 for
Qwen2.5-7B, ~1 % at rank 16 for Qwen2.5-0.5B.

- `adapter_layout(model, dtype=...)` is the bucket layout (`rl_data.WeightSyncMeta`) of the
  adapter tensors, under peft's saved names (`base_model.model.<module>.lora_A.weight` [r, in],
  `...lora_B.weight` [out, r]), planned without gathering anything;
- `lora_adapter(model)` is its configuration (`rl_data.adapters.LoraAdapter`, peft's
  `adapter_config.json` content), which goes to the engines once in `WeightSyncSpec.adapter`;
- a sender built from a spec whose `adapter` is set (`rl_learner.make_sender`, any transport)
  sends `adapter_tensors(model)` instead of the merged weights: bucketed, cast to the layout's
  dtype while packing, checksummed, gathered one bucket at a time under ZeRO-3 and FSDP2 (each
  factor a DTensor gathered with `full_tensor()`, `rl_learner.dtensor`), as any sync.

    layout, adapter = adapter_layout(engine, dtype=torch.float32), lora_adapter(engine)
    spec = WeightSyncSpec(transport="shm", layout=layout, directory=folder, adapter=adapter)
    sender = make_sender(spec, engine)
    sender.send(version=step)        # the adapter tensors of this step, nothing else

Only plain LoRA on linear layers with one active adapter goes this way (what
`rl_learner.apply_lora` makes for a policy); DoRA, LoRA bias, embedding adapters,
`modules_to_save` and adapters merged into the weights are refused with the reason (merged sync
serves them: `model.lora_sync merged`).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from rl_data import WeightSyncMeta, plan_buckets
from rl_data.adapters import LoraAdapter, adapter_wire_name
from rl_data.errors import check_integer

from .lora import MergedTensor, _loaded, check_wire_dtype

__all__ = ["adapter_layout", "adapter_tensors", "lora_adapter"]

DEFAULT_BUCKET_BYTES = 256 * 2**20


def _peft_model(model: Any, where: str) -> Any:
    """The peft model under a DeepSpeed engine, an FSDP2 engine (`rl_learner.fsdp2.Fsdp2Engine`)
    or DDP; ValueError when `model` is not a LoRA model."""
    deepspeed, fsdp2 = _loaded("deepspeed"), _loaded("rl_learner.fsdp2")
    for _ in range(8):
        is_engine = deepspeed is not None and isinstance(model, deepspeed.DeepSpeedEngine)
        is_engine = is_engine or (fsdp2 is not None and isinstance(model, fsdp2.Fsdp2Engine))
        if is_engine or isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            break
    if not (hasattr(model, "peft_config") and hasattr(model, "get_base_model")):
        raise ValueError(
            f"{where}: adapter sync needs a LoRA policy (a peft model: model.lora_rank > 0), "
            f"got {type(model).__name__}; use merged sync (model.lora_sync merged)"
        )
    return model


def _active_adapter(model: Any, where: str) -> str:
    active = model.active_adapters if hasattr(model, "active_adapters") else [model.active_adapter]
    if len(active) != 1:
        raise ValueError(f"{where}: adapter sync serves one active adapter, this model has {list(active)}")
    config = model.peft_config[active[0]]
    refusals = {
        "peft_type": str(getattr(config, "peft_type", "")) not in ("LORA", "PeftType.LORA"),
        "use_dora": bool(getattr(config, "use_dora", False)),
        "lora_bias": bool(getattr(config, "lora_bias", False)),
        "bias": getattr(config, "bias", "none") != "none",
        "modules_to_save": bool(getattr(config, "modules_to_save", None)),
    }
    refused = [name for name, refuse in refusals.items() if refuse]
    if refused:
        raise ValueError(
            f"{where}: adapter {active[0]!r} has {', '.join(refused)} set; adapter sync serves plain LoRA "
            "on linear layers only: use merged sync (model.lora_sync merged)"
        )
    return active[0]


def adapter_tensors(model: Any, *, where: str = "adapter sync") -> list[MergedTensor]:
    """The adapter tensors the engines receive, in `named_parameters()` order, under their wire
    names (`rl_data.adapters.adapter_wire_name`); planned without gathering anything.

    Each is a `MergedTensor` without LoRA layer: `value()` is the live factor (detached),
    `params()` the parameter to gather under ZeRO-3, `shape` its full shape.

    Raises ValueError when `model` is not a peft LoRA model with one active plain-LoRA adapter,
    or an adapter is merged into its weights or adapts an embedding.
    """
    peft_model = _peft_model(model, where)
    adapter = _active_adapter(peft_model, where)
    tensors: list[MergedTensor] = []
    for name, param in peft_model.named_parameters():
        wire = adapter_wire_name(name, adapter)
        if wire is not None:
            tensors.append(MergedTensor(name=wire, param=param, where=where))
        elif f".{adapter}" in name and any(
            f".{kind}" in name for kind in ("lora_embedding_", "lora_magnitude")
        ):
            raise ValueError(
                f"{where}: {name!r} is an adapter tensor other than a linear layer's LoRA factors; "
                "use merged sync (model.lora_sync merged)"
            )
    merged = [
        path
        for path, module in peft_model.named_modules()
        if adapter in (getattr(module, "merged_adapters", None) or [])
    ]
    if merged:
        raise ValueError(
            f"{where}: adapter {adapter!r} is merged into the weights of {merged[:3]}; "
            "unmerge it before an adapter sync"
        )
    if not tensors:
        raise ValueError(f"{where}: adapter {adapter!r} adapts no linear layer; nothing to send")
    return tensors


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def lora_adapter(model: Any, *, where: str = "adapter sync") -> LoraAdapter:
    """The active adapter's configuration as the engines serve it: peft's `adapter_config.json`
    content (what `save_pretrained` writes: sets as sorted lists, no runtime settings)."""
    peft_model = _peft_model(model, where)
    adapter = _active_adapter(peft_model, where)
    config = peft_model.peft_config[adapter].to_dict()
    config.pop("runtime_config", None)
    config["inference_mode"] = True
    return LoraAdapter(peft_config=json.loads(json.dumps(config, default=_jsonable)))


def adapter_layout(
    model: Any,
    *,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    alignment: int = 256,
) -> WeightSyncMeta:
    """The bucket layout of the adapter tensors the engines receive from `model` (`adapter_tensors`).

    Args:
      model: a peft LoRA model, or a DeepSpeed engine / DDP around one (ZeRO-3 or not), or an
        FSDP2 engine (`rl_learner.fsdp2.Fsdp2Engine`) or `fully_shard` module of one.
      dtype: the engine's dtype, the factors' wire dtype; None keeps theirs.
      bucket_bytes, alignment: as `rl_learner.sync_layout`'s.
    """
    check_wire_dtype(dtype, "adapter_layout")
    check_integer("adapter_layout: bucket_bytes", bucket_bytes, 1)
    return plan_buckets(
        ((t.name, dtype or t.param.dtype, t.shape) for t in adapter_tensors(model, where="adapter_layout")),
        bucket_bytes=bucket_bytes,
        alignment=alignment,
    )
