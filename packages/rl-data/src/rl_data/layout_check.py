"""A weight-sync layout checked against the receiving model before any bucket moves.

A learner whose model differs from the engine's (another size, another vocabulary) would otherwise
fail inside the engine's own loader with its bare error (vLLM: an `AssertionError` from a weight
loader, with no name). `check_layout_shapes` compares every parameter the layout and the model
both name and says which differ, with both shapes. Names only one side has are not checked here:
a checkpoint may leave out tied weights, and engines map names (vLLM fuses `q_proj`, `k_proj`,
`v_proj` into `qkv_proj`), so only a shared name says both sides mean the same tensor.

`safetensors_shapes` reads a checkpoint folder's shapes from its `.safetensors` headers alone (the
8-byte header length, then JSON), so an engine that loaded a folder can check without touching its
own parameters.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
from collections.abc import Mapping, Sequence

from .weights import WeightSyncMeta

__all__ = ["check_layout_shapes", "safetensors_shapes"]

_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit for a header


def safetensors_shapes(folder: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} over every `*.safetensors` file directly in `folder` ({} if none)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(pathlib.Path(folder).glob("*.safetensors")):
        with open(path, "rb") as file:
            prefix = file.read(8)
            if len(prefix) != 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (length,) = struct.unpack("<Q", prefix)
            if length > _MAX_HEADER_BYTES:
                raise ValueError(f"{path}: safetensors header of {length} bytes is over {_MAX_HEADER_BYTES}")
            header = json.loads(file.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(int(dim) for dim in entry["shape"])
    return shapes


def check_layout_shapes(
    layout: WeightSyncMeta, shapes: Mapping[str, Sequence[int]], *, where: str, shown: int = 5
) -> None:
    """Raise ValueError naming each parameter whose shape in `layout` differs from `shapes`.

    Args:
      layout: the sender's bucket layout.
      shapes: the receiving model's {name: shape}.
      where: the caller, first in the message (e.g. "VLLMEngine.init_weight_sync").
      shown: how many mismatches the message lists (the rest are counted).
    """
    mismatched = [
        (param.name, tuple(param.shape), tuple(int(dim) for dim in shapes[param.name]))
        for bucket in layout.buckets
        for param in bucket.params
        if param.name in shapes and tuple(int(dim) for dim in shapes[param.name]) != tuple(param.shape)
    ]
    if not mismatched:
        return
    listed = "; ".join(
        f"{name!r} is {list(sent)} in the layout (the learner's model) and {list(own)} in this engine's model"
        for name, sent, own in mismatched[:shown]
    )
    more = f" (and {len(mismatched) - shown} more)" if len(mismatched) > shown else ""
    raise ValueError(
        f"{where}: the weight-sync layout does not match the engine's model: {listed}{more}; "
        "the learner and the engines must load the same architecture"
    )
