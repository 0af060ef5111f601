"""Argument checks shared by every public function.

Each check raises at the door with the argument's name and what was expected, so a wrong
shape or a NaN reward never travels into a loss as a silent NaN. Checks that read tensor
values (finiteness) synchronise with the device; they are used on small per-sequence
tensors (rewards), never on per-token tensors in the hot path.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch

__all__ = [
    "bool_mask",
    "check_choice",
    "check_finite",
    "check_floating",
    "check_integer",
    "check_ndim",
    "check_nonempty",
    "check_positive",
    "check_probability",
    "check_rewards",
    "check_rows",
    "check_same_shape",
    "check_shape",
    "check_tensor",
    "compute_dtype",
    "first_flagged",
    "mask_as",
]


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32: bf16/fp16 inputs are computed in fp32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_ndim(name: str, value: torch.Tensor, ndim: int, layout: str) -> torch.Tensor:
    """`value` must be a tensor of rank `ndim`; `layout` names the axes, e.g. "[batch, seq]"."""
    check_tensor(name, value)
    if value.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout} ({ndim} dims), got shape {tuple(value.shape)}")
    return value


def check_same_shape(name: str, value: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    check_tensor(name, value)
    if value.shape != ref.shape:
        raise ValueError(
            f"{name} has shape {tuple(value.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
            "they must match"
        )


def check_shape(name: str, value: torch.Tensor, shape: tuple[int, ...], layout: str) -> None:
    check_tensor(name, value)
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {layout} = {tuple(shape)}, got {tuple(value.shape)}")


def check_nonempty(name: str, value: torch.Tensor) -> None:
    if value.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(value.shape)}); at least one element is needed")


def check_floating(name: str, value: torch.Tensor) -> None:
    check_tensor(name, value)
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")


def check_integer(name: str, value: torch.Tensor) -> None:
    check_tensor(name, value)
    if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (e.g. torch.long), got dtype {value.dtype}")


def check_finite(name: str, value: torch.Tensor) -> None:
    """Raise if `value` holds NaN or +-inf, naming the first offending index."""
    bad = ~torch.isfinite(value)
    if bool(bad.any()):
        index, where = first_flagged(bad)
        raise ValueError(
            f"{name} must be finite, got {value[index].item()} at index {where} "
            f"({int(bad.sum())} non-finite of {value.numel()})"
        )


def first_flagged(flags: torch.Tensor) -> tuple[tuple[int, ...], int | tuple[int, ...]]:
    """Index of the first True in `flags` (some entry must be True): the tuple to index with,
    and the form to print (a plain int for 1-D tensors)."""
    index = tuple(int(i) for i in flags.nonzero()[0].tolist())
    return index, index[0] if len(index) == 1 else index


def check_positive(name: str, value: float, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return float(value)


def check_probability(name: str, value: float, *, inclusive_high: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(f"{name} must be a number, got {value!r}")
    high_ok = value <= 1 if inclusive_high else value < 1
    if value < 0 or not high_ok:
        interval = "[0, 1]" if inclusive_high else "[0, 1)"
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return float(value)


def check_choice(name: str, value: str, allowed: Collection[str]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {sorted(allowed)}, got {value!r}")
    return value


def mask_as(name: str, mask: torch.Tensor, like: torch.Tensor, like_name: str) -> torch.Tensor:
    """Check `mask` against `like` and return it as `like`'s floating dtype (1 keeps, 0 drops).

    Accepts bool, integer or floating masks whose values are 0 or 1.
    """
    check_same_shape(name, mask, like_name, like)
    if mask.is_complex():
        raise TypeError(f"{name} must be a bool, integer or float tensor of 0/1, got dtype {mask.dtype}")
    return mask.to(like.dtype)


def bool_mask(name: str, mask: torch.Tensor, like: torch.Tensor, like_name: str) -> torch.Tensor:
    """Check `mask` (bool, or integer/float holding only 0 and 1, shaped like `like`); return bool.

    Costs one device sync for non-bool masks: a mask of 0.5s or 2s is a bug upstream that would
    otherwise turn into silently wrong advantages.
    """
    check_same_shape(name, mask, like_name, like)
    if mask.is_complex():
        raise TypeError(f"{name} must be a bool, integer or float tensor of 0/1, got dtype {mask.dtype}")
    if mask.dtype == torch.bool:
        return mask
    invalid = (mask != 0) & (mask != 1)
    if bool(invalid.any()):
        raise ValueError(f"{name} must hold only 0 and 1, got {mask[invalid][0].item()}")
    return mask != 0


def check_rewards(name: str, value: torch.Tensor) -> None:
    """A `[batch]` float tensor of scalar rewards, non-empty and finite (naming the bad index)."""
    check_ndim(name, value, 1, "[batch]")
    check_floating(name, value)
    check_nonempty(name, value)
    check_finite(name, value)


def check_rows(name: str, value: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """`value` and `ref` must have the same leading (batch) dimension."""
    if value.shape[0] != ref.shape[0]:
        raise ValueError(
            f"{name} has {value.shape[0]} rows (shape {tuple(value.shape)}) but {ref_name} has "
            f"{ref.shape[0]} (shape {tuple(ref.shape)}); they must match"
        )
