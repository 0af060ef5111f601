"""An exponential moving average (EMA) of a trained model's weights, kept on the host.

After every optimizer step t (counted from the initial weights θ₀, so EMA₀ = θ₀):

    EMAₜ = β · EMAₜ₋₁ + (1 − β) · θₜ

so that EMAₜ = βᵗ · θ₀ + (1 − β) · Σₛ₌₁..ₜ βᵗ⁻ˢ · θₛ: a weight of βᵗ stays with the initial model.
β close to 1 averages over about 1 / (1 − β) steps (β = 0.992: ~125 steps, OpenRLHF's default).

`ema_update` is the formula on one tensor. `WeightEMA` keeps one fp32 CPU tensor per trainable
parameter of a model (DeepSpeed engine or plain module) on rank 0 only: every data-parallel rank
holds the same weights under ZeRO 0-2, and under ZeRO-3 each parameter is gathered in turn (a
collective: every rank calls `update`) and rank 0 averages it. Its `state_dict` goes into a
checkpoint (`save_checkpoint(..., tensors={"ema": ...})`), so that a resumed run continues the
same average, and `export_names` gives the tensors `export_hf(..., replace=...)` writes instead of
the model's own.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["WeightEMA", "ema_update"]


def ema_update(average: torch.Tensor, value: torch.Tensor, beta: float) -> torch.Tensor:
    """`average` ← β · average + (1 − β) · value, in place; returns `average`.

    Args:
      average: the running average, any shape, a floating dtype (fp32 recommended: the increments
        (1 − β)·(θ − EMA) are small).
      value: the new weights, the same shape (any dtype and device; converted to `average`'s).
      beta: the decay β in [0, 1): 0 copies `value`.
    """
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
        raise ValueError(f"beta: {beta!r} is not a number in [0, 1)")
    if average.shape != value.shape:
        raise ValueError(f"value: shape {tuple(value.shape)} differs from average's {tuple(average.shape)}")
    if not average.is_floating_point():
        raise TypeError(f"average: dtype {average.dtype} is not a floating dtype")
    value = value.detach().to(device=average.device, dtype=average.dtype)
    return average.mul_(beta).add_(value, alpha=1.0 - beta)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextlib.contextmanager
def _gathered(parameter: torch.nn.Parameter) -> Iterator[None]:
    """The full parameter for the duration (ZeRO-3 gathers it on every rank; others as they are)."""
    if not hasattr(parameter, "ds_id"):
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters([parameter], modifier_rank=None):
        yield


def _module(model: Any) -> torch.nn.Module:
    module = model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"model: expected a torch module or a DeepSpeed engine, got {type(model).__name__}")
    return module


class WeightEMA:
    """The EMA of a model's trainable parameters (module docstring), fp32 on the CPU of rank 0.

    Args:
      model: the trained model or its DeepSpeed engine; its current weights start the average.
      beta: the decay β in (0, 1).

    Call `update(model)` after each applied optimizer step on every rank. Other ranks hold no
    tensors (`state_dict()` is empty there).
    """

    def __init__(self, model: Any, beta: float) -> None:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 < beta < 1.0:
            raise ValueError(f"beta: {beta!r} is not a number in (0, 1)")
        self.beta = float(beta)
        self.updates = 0
        self.averages: dict[str, torch.Tensor] = {}
        for name, parameter in self._parameters(model):
            with _gathered(parameter), torch.no_grad():
                if _rank() == 0:
                    self.averages[name] = parameter.detach().to("cpu", torch.float32, copy=True)

    @staticmethod
    def _parameters(model: Any) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, p) for name, p in _module(model).named_parameters() if p.requires_grad]

    def update(self, model: Any) -> None:
        """One step of `ema_update` for every trainable parameter of `model` (collective under ZeRO-3)."""
        rank = _rank()
        for name, parameter in self._parameters(model):
            with _gathered(parameter), torch.no_grad():
                if rank == 0:
                    if name not in self.averages:
                        raise KeyError(
                            f"WeightEMA.update: parameter {name!r} was not in the model it started from"
                        )
                    ema_update(self.averages[name], parameter, self.beta)
        self.updates += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Parameter name -> its average (fp32, CPU); empty off rank 0. The update count is
        `updates` (kept by the caller, e.g. in the training state)."""
        return dict(self.averages)

    def load_state_dict(self, state: Mapping[str, torch.Tensor], *, updates: int) -> None:
        """Restore the averages saved by `state_dict` (rank 0; other ranks pass {})."""
        if _rank() == 0:
            missing = sorted(set(self.averages) - set(state))
            unexpected = sorted(set(state) - set(self.averages))
            if missing or unexpected:
                raise KeyError(
                    f"WeightEMA.load_state_dict: missing {missing[:5]}, unexpected {unexpected[:5]} "
                    "(the checkpoint's EMA is of another model)"
                )
            for name, tensor in state.items():
                if tensor.shape != self.averages[name].shape:
                    raise ValueError(
                        f"WeightEMA.load_state_dict: {name} has shape {tuple(tensor.shape)}, "
                        f"the model's is {tuple(self.averages[name].shape)}"
                    )
                self.averages[name].copy_(tensor)
        self.updates = int(updates)

    def export_names(self, model: Any) -> dict[str, torch.Tensor]:
        """Every name of every averaged parameter, tied aliases included (`lm_head.weight` of a
        model whose embedding is tied), -> its average: `export_hf`'s `replace`. Empty off rank 0."""
        canonical = {id(p): name for name, p in self._parameters(model)}
        return {
            name: self.averages[canonical[id(p)]]
            for name, p in _module(model).named_parameters(remove_duplicate=False)
            if id(p) in canonical and canonical[id(p)] in self.averages
        }

    def initial_weight(self) -> float:
        """βᵗ: the weight the initial model still has in the average after t = `updates` steps."""
        return math.pow(self.beta, self.updates)
