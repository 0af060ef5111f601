"""Tensor parallelism for the FSDP2 learner: DTensor column / row plans for the Qwen2 / Llama family.

`DeepSpeedConfig.tensor_parallel_size` = tp > 1 (backend "fsdp2") splits each decoder layer's
matrices over tp consecutive ranks (Megatron's layout, torch's `parallelize_module`):

    q_proj, k_proj, v_proj, gate_proj, up_proj   ColwiseParallel   (output features split: each
                                                                    rank holds whole attention heads)
    o_proj, down_proj                            RowwiseParallel   (input features split; the
                                                                    partial outputs are all-reduced)

so a layer's attention runs heads/tp query heads and kv_heads/tp key-value heads per rank, and its
output (after the row-parallel all-reduce) is whole on every rank. Embeddings, norms, the LM head
and a value model's score head are not split: every rank of a TP group computes them in full, so
the loss of a micro-batch is the same number on each of them. The learner's ranks form a 2-D mesh
(dp × tp, `rl_learner.fsdp2`): ranks [g·tp, (g+1)·tp) are TP group g (they get the same
micro-batches, like a sequence-parallel group), and `fully_shard` shards every parameter over the
dp dimension on top (a split matrix is then a DTensor on the 2-D mesh, the others on the dp mesh).

Gradients. A split matrix's gradient shard is exact on its rank (DTensor's backward all-reduces the
partial input gradients of the column-parallel layers); a whole parameter's gradient is the same on
every rank of a TP group. FSDP2 averages gradients over the dp ranks only, so the learner's
backward factor is dp = world_size / tp (`rl_learner.learner`).

`tensor_parallel_refusals` says what stands in the way (model family, head counts, widths) before
anything is built; `apply_tensor_parallel` splits the layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

__all__ = [
    "TENSOR_PARALLEL_FAMILIES",
    "TensorParallelGroup",
    "apply_tensor_parallel",
    "layer_plan",
    "tensor_parallel_refusals",
]

TENSOR_PARALLEL_FAMILIES = ("qwen2", "llama")
"""HF `model_type`s whose decoder layers the plan fits (q/k/v/o attention, gate/up/down MLP)."""

COLUMN_PARALLEL = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
)
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


@dataclasses.dataclass(frozen=True)
class TensorParallelGroup:
    """This rank's TP group: `size` consecutive global ranks that share a micro-batch.

    Attributes:
      group: the torch.distributed process group of the `size` ranks.
      size: tp ≥ 2.
      rank: this rank's index in the group, 0 ≤ rank < size.
      kind: "tensor-parallel" (for messages; a sequence-parallel group says "sequence-parallel").
    """

    group: Any
    size: int
    rank: int
    kind: ClassVar[str] = "tensor-parallel"


def layer_plan() -> dict[str, Any]:
    """The `parallelize_module` plan of one Qwen2 / Llama decoder layer: {sub-module: style}."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        **{name: ColwiseParallel() for name in COLUMN_PARALLEL},
        **{name: RowwiseParallel() for name in ROW_PARALLEL},
    }


def _reader(config: Any) -> Any:
    """`read(key)` of an HF config object or a config.json dict (its text model's, for a VLM)."""
    if isinstance(config, dict):
        config = config.get("text_config") or config
        return config.get
    config = getattr(config, "text_config", None) or config
    return lambda key: getattr(config, key, None)


def tensor_parallel_refusals(config: Any, size: int) -> list[str]:
    """Why a model with HF config `config` (an object or a config.json dict) cannot be split over
    `size` tensor-parallel ranks: [reason], empty when it can (or when `size` is 1)."""
    if size == 1:
        return []
    read = _reader(config)
    family = read("model_type")
    reasons = []
    if family not in TENSOR_PARALLEL_FAMILIES:
        reasons.append(
            f"model_type {family!r} has no tensor-parallel plan (plans exist for "
            f"{', '.join(TENSOR_PARALLEL_FAMILIES)})"
        )
        return reasons
    heads = read("num_attention_heads")
    kv_heads = read("num_key_value_heads") or heads
    for name, value in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
        ("intermediate_size", read("intermediate_size")),
    ):
        if not isinstance(value, int) or value % size:
            reasons.append(f"{name} {value} is not divisible by tensor_parallel_size {size}")
    return reasons


def apply_tensor_parallel(model: torch.nn.Module, mesh: Any) -> int:
    """Split every decoder layer of `model` over the 1-D tensor-parallel `mesh` (module docstring);
    returns the number of layers split.

    Raises ValueError with `tensor_parallel_refusals`' reasons, or when no decoder layer is found.
    """
    size = mesh.size()
    reasons = tensor_parallel_refusals(getattr(model, "config", None), size)
    if reasons:
        raise ValueError(f"tensor_parallel_size {size}: " + "; ".join(reasons))
    from torch.distributed.tensor.parallel import parallelize_module

    units = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in units]
    if not layers:
        raise ValueError(
            f"tensor_parallel_size {size}: {type(model).__name__} names no decoder layer class "
            "(_no_split_modules) to split"
        )
    for layer in layers:
        parallelize_module(layer, mesh, layer_plan())
    return len(layers)
