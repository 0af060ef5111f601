"""DTensor parameters (FSDP2 `fully_shard`, DTensor tensor parallelism) in weight sync and export.

A model sharded by torch's FSDP2 (`torch.distributed.fsdp.fully_shard`) or by DTensor tensor
parallelism (`torch.distributed.tensor.parallel.parallelize_module`) holds each parameter as a
`DTensor`: a local shard plus its placement on a device mesh. `param.shape` is already the full
(global) shape, so a sync layout is planned without gathering; the full tensor is
`param.full_tensor()`, a collective over the parameter's mesh that every rank of the mesh runs
in the same order.

Weight sync (`rl_learner.sender_base`) gathers one bucket at a time: rank 0 of the mesh
announces the next bucket (as it does for ZeRO-3), every rank computes that bucket's full
tensors (`full_value`, in the layout's order), rank 0 packs them and the others drop them. So
the peak extra memory of a rank is one bucket's full tensors, never the whole model.

A LoRA layer of a sharded peft model (FSDP2 over `rl_learner.apply_lora`'s model) merges on
full tensors: `full_value` gathers that one layer's parameters (its base weight and bias, its
adapters' factors), in `named_parameters()` order on every rank, computes W + scaling·B·A on
them with peft's own `get_delta_weight` (DoRA through its `merge_safe`), the computation the
unsharded model runs on the same numbers (so the same bits), and puts the shards back. The peak
extra memory is one layer's full tensors; adapter-only sync (`rl_learner.adapter_sync`) gathers
each factor alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["dtensor_group", "full_value", "is_dtensor"]


def _dtensor_class() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DTensor


def is_dtensor(tensor: Any) -> bool:
    """Whether `tensor` is a `torch.distributed.tensor.DTensor` (an nn.Parameter around one too)."""
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


def dtensor_group(params: Iterable[torch.Tensor], *, where: str = "sync") -> Any:
    """The process group whose ranks gather the DTensor parameters among `params` together, or
    None when there are none.

    A one-dimensional mesh (FSDP2 alone, tensor parallelism alone) gives its own group; a mesh
    of several dimensions (FSDP × TP) spans the whole world, whose group is returned. Every
    DTensor parameter must live on one mesh or on sub-meshes of one mesh (FSDP × TP: the split
    matrices on the dp × tp mesh, the others on its dp mesh), which then spans the world; else
    the ranks' gathers would not pair up.

    Raises:
      ValueError naming two parameters' meshes when they are not parts of one mesh, or a
      multi-dimensional mesh that is not the whole world.
    """
    meshes: dict[Any, int] = {}
    for index, param in enumerate(params):
        if is_dtensor(param):
            meshes.setdefault(param.device_mesh, index)
    if not meshes:
        return None
    roots = {_root_mesh(mesh) for mesh in meshes}
    if len(roots) > 1:
        shown = ", ".join(f"{mesh} (tensor {index})" for mesh, index in list(meshes.items())[:2])
        raise ValueError(
            f"{where}: the model's DTensor parameters live on different device meshes ({shown}); "
            "weight sync gathers them over one mesh"
        )
    mesh = next(iter(meshes)) if len(meshes) == 1 else roots.pop()
    if mesh.ndim == 1:
        return mesh.get_group()
    import torch.distributed as dist

    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"{where}: the DTensor parameters' {mesh.ndim}-D mesh has {mesh.size()} ranks, not the world's "
            f"{dist.get_world_size()}; weight sync of a multi-dimensional mesh needs it to span the world"
        )
    return dist.group.WORLD


def _root_mesh(mesh: Any) -> Any:
    """The mesh `mesh` was sliced from (`grid["dp"]` → `grid`), or `mesh` itself."""
    root = getattr(mesh, "_get_root_mesh", None)  # torch's own accessor (private in torch 2.13)
    return root() if root is not None else mesh


def full_value(source: Any) -> torch.Tensor:
    """The full tensor the engines receive for one `rl_learner.lora.MergedTensor`: its value,
    gathered with `full_tensor()` where it is a DTensor (a collective over its mesh); a sharded
    LoRA layer's merged weight is computed on its gathered parameters (module docstring)."""
    if source.lora is not None and is_dtensor(source.param) and source.adapters():
        with _whole_layer(source.lora) as base:
            return dataclasses.replace(source, param=getattr(base, source.role)).value()
    value = source.value()
    if is_dtensor(value):
        value = value.full_tensor()
    return value


@contextlib.contextmanager
def _whole_layer(layer: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Every DTensor parameter of a peft LoRA layer (its base layer's and its adapters') replaced
    by its full tensor, gathered in `named_modules()` order (the same collectives on every rank of
    the mesh), for the duration of the block; yields the base layer. The shards go back after,
    so the sharded model is left as it was (no forward or backward runs in between)."""
    swapped: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
    try:
        for module in layer.modules():
            for key, param in list(module._parameters.items()):
                if param is not None and is_dtensor(param):
                    module._parameters[key] = param.detach().full_tensor()
                    swapped.append((module, key, param))
        yield layer.get_base_layer()
    finally:
        for module, key, param in reversed(swapped):
            module._parameters[key] = param
