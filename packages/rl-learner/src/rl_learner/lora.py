"""LoRA adapters (through `peft`, an optional extra: `pip install rl-learner[peft]`).

`apply_lora(model, LoraOptions(rank=16))` wraps a causal LM or a value model so that only the
low-rank adapters train (W' = W + (alpha / rank)·B·A, B initialised to 0 so the adapted model
starts equal to the base). A value model's scalar `score` head is new or task-specific, so it is
kept fully trainable (peft `modules_to_save`). `rank=0` turns LoRA off and returns the model
unchanged. After training, `model.merge_and_unload()` folds the adapters into plain weights.

`merged_tensors(model)` is the same fold without touching the model, one tensor at a time: the
weights as the plain model would hold them (Hugging Face names, what `save_pretrained` writes),
for weight sync (`rl_learner.sync`) and the HF export (`rl_learner.checkpoint.export_hf`). Each
`MergedTensor` names the live parameters it is computed from (`params()`, to gather under
ZeRO-3) and computes its value on a copy (`value()`):

    plain LoRA   W' = W + Σ_a transpose(B_a @ A_a, fan_in_fan_out) · s_a     (W: [out, in], A_a: [r, in], B_a: [out, r])
    DoRA         W' = m_a / ‖W + ΔW_a‖_row · (W + ΔW_a)                     (ΔW_a as above, m_a: [out], the norm per output row)
    lora_bias    b' = b + Σ_a bias(B_a) · s_a

over the active adapters `a` not yet merged into W (s_a = alpha / rank). Each delta is peft's
own (`get_delta_weight`; DoRA through the variant's `merge_safe`), added in the order and dtype
`merge_and_unload` uses, so the result has the bits of a merged model. A DoRA adapter is computed
from the live base weight, as peft's `merge_safe` does: with several adapters, put DoRA first.

Names: a DeepSpeed engine's or DDP's `.module` and a peft model's wrapper are unwrapped; peft's
`.base_layer` is dropped and the adapters (`lora_A`, `lora_B`, `lora_embedding_*`, magnitude,
dropout) are not tensors of their own; a `modules_to_save` module appears under its original name
with the active adapter's copy. Tied weights are one storage: one tensor under the first name
`named_parameters()` gives, or one per name with `tied=True` (then `value()` of the later names
is the same storage). Other peft wrappers raise (merge_and_unload() first).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import msgspec
import torch

__all__ = ["LoraOptions", "MergedTensor", "apply_lora", "linear_module_names", "merged_tensors"]

_HEADS = ("lm_head", "score")


class LoraOptions(msgspec.Struct, frozen=True, kw_only=True):
    """LoRA adapter options."""

    rank: int = 0
    """Adapter rank r; 0 turns LoRA off (full fine-tuning)."""
    alpha: float = 16.0
    """Scaling numerator: the adapter output is multiplied by alpha / rank."""
    target_modules: str | list[str] = "all-linear"
    """"all-linear" (every linear layer but the output heads; of a vision-language model, those of
    the language model only: not the vision tower `model.visual`) or module names such as
    ["q_proj", "v_proj"], matched wherever they occur (a name of the tower, e.g. "qkv", adapts it)."""
    dropout: float = 0.0
    """Dropout on the adapter input, in [0, 1)."""

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"{owner}.rank: {self.rank!r} is not an integer >= 0")
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"{owner}.alpha: {self.alpha!r} is not a number > 0")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"{owner}.dropout: {self.dropout!r} is not in [0, 1)")
        if isinstance(self.target_modules, str):
            if self.target_modules != "all-linear":
                raise ValueError(
                    f"{owner}.target_modules: {self.target_modules!r} is neither 'all-linear' nor a list of module names"
                )
        elif not self.target_modules or not all(isinstance(n, str) and n for n in self.target_modules):
            raise ValueError(
                f"{owner}.target_modules: {self.target_modules!r} must be a non-empty list of names"
            )


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Distinct short names (last path component) of the linear layers, output heads excluded."""
    names = []
    for path, module in model.named_modules():
        short = path.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and short not in _HEADS and short not in names:
            names.append(short)
    return names


def apply_lora(model: Any, options: LoraOptions) -> Any:
    """Wrap `model` with LoRA adapters (a `peft.PeftModel`), or return it as is when rank is 0.

    Raises:
      ValueError naming the targets and listing the model's linear layers when a name in
      `target_modules` matches no linear layer; ImportError when peft is not installed.
    """
    if not isinstance(options, LoraOptions):
        raise TypeError(f"options must be a LoraOptions, got {type(options).__name__}")
    if options.rank == 0:
        return model
    try:
        import peft
    except ImportError as error:  # pragma: no cover - peft is installed in the test environment
        raise ImportError("LoRA needs peft: pip install 'rl-learner[peft]'") from error

    available = linear_module_names(model)
    if not isinstance(options.target_modules, str):
        missing = [name for name in options.target_modules if name not in available]
        if missing:
            raise ValueError(
                f"target_modules: {missing} match no linear layer of {type(model).__name__} "
                f"(targets {list(options.target_modules)}); its linear layers are {available[:12]}"
            )
    has_score = isinstance(getattr(model, "score", None), torch.nn.Module)
    exclude = ["score"] if has_score else None
    from .models import _vision_model

    if isinstance(options.target_modules, str) and _vision_model(model) is not None:
        # peft's "all-linear" would adapt the vision tower's linears too (qkv, fc1, the merger)
        exclude = r"(.*\.)?visual\..*"
    config = peft.LoraConfig(
        r=options.rank,
        lora_alpha=options.alpha,
        lora_dropout=options.dropout,
        target_modules="all-linear"
        if isinstance(options.target_modules, str)
        else list(options.target_modules),
        exclude_modules=exclude,
        modules_to_save=["score"] if has_score else None,
        bias="none",
    )
    if getattr(model, "is_gradient_checkpointing", False):
        # With frozen embeddings no input requires grad, and checkpointed blocks would get none.
        model.enable_input_require_grads()
    return peft.get_peft_model(model, config)


# --- the merged weights, one tensor at a time ------------------------------------------------------

# Markers of peft adapter parameters: they must never appear under their own names.
_ADAPTER_MARKERS = (
    ".lora_A.",
    ".lora_B.",
    ".lora_embedding_A.",
    ".lora_embedding_B.",
    ".lora_magnitude_vector.",
    ".lora_dropout.",
    ".modules_to_save.",
    ".original_module.",
    ".base_layer.",
)


def check_wire_dtype(dtype: Any, where: str) -> None:
    """ValueError naming `where` unless `dtype` (a sync layout's wire dtype) is None or floating."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"{where}: dtype must be None or a floating torch.dtype, got {dtype!r}")


@dataclasses.dataclass(frozen=True)
class MergedTensor:
    """One tensor of the merged model: a live parameter (or buffer), plus the LoRA layer whose
    deltas merge into it.

    `role` is "weight" or "bias" of a LoRA layer's base layer (merged), "plain" for another
    parameter, "buffer" for a persistent buffer. `where` names the caller in errors.
    """

    name: str
    param: torch.Tensor
    lora: Any = None
    role: str = "plain"
    where: str = "merge"

    @property
    def shape(self) -> tuple[int, ...]:
        shape = getattr(self.param, "ds_shape", None)  # ZeRO-3: the full shape without gathering
        return tuple(shape if shape is not None else self.param.shape)

    def adapters(self) -> list[str]:
        """The LoRA adapters whose deltas belong in this tensor (active, not merged into it yet)."""
        if self.lora is None:
            return []
        layer = self.lora
        if layer.disable_adapters:
            if layer.merged:
                raise ValueError(
                    f"{self.where}: {self.name}: adapters {layer.merged_adapters} are merged into the weight "
                    "but disabled; unmerge them (or enable them) first"
                )
            return []
        available = set(layer.lora_A) | set(layer.lora_embedding_A)
        adapters = [a for a in layer.active_adapters if a in available and a not in layer.merged_adapters]
        if self.role == "bias":
            adapters = [a for a in adapters if getattr(layer, "lora_bias", {}).get(a, False)]
        return adapters

    def params(self) -> list[torch.Tensor]:
        """Every live parameter this tensor is computed from (all gathered together under ZeRO-3)."""
        if not self.adapters():
            return [self.param] if isinstance(self.param, torch.nn.Parameter) else []
        extra = [p for n, p in self.lora.named_parameters() if not n.startswith("base_layer.")]
        return [self.param, *extra]

    def value(self) -> torch.Tensor:
        """The merged tensor, from gathered parameters; the live model is not modified.

        Without adapters this is the live tensor itself (detached), else a new tensor.
        """
        tensor = self.param.detach()
        adapters = self.adapters()
        if not adapters:
            return tensor
        layer = self.lora
        merged = tensor.clone()
        with torch.no_grad():
            for adapter in adapters:
                if self.role == "bias":
                    merged += layer.lora_B[adapter].bias * layer.scaling[adapter]
                elif adapter in getattr(layer, "lora_variant", {}):
                    # DoRA and other variants: peft's out-of-place merge.
                    merged = layer.lora_variant[adapter].merge_safe(layer, adapter, merged)
                else:  # what merge_and_unload does in place: weight.data += delta
                    merged += layer.get_delta_weight(adapter)
        return merged


def _loaded(module_name: str) -> Any:
    """A module if something already imported it (then objects of its classes can exist), else None."""
    return sys.modules.get(module_name)


def _unwrap(model: Any, where: str) -> torch.nn.Module:
    """The HF model under DeepSpeed / DDP / peft wrappers (its names are the plain model's names)."""
    deepspeed, fsdp2 = _loaded("deepspeed"), _loaded("rl_learner.fsdp2")
    for _ in range(8):
        is_engine = deepspeed is not None and isinstance(model, deepspeed.DeepSpeedEngine)
        is_engine = is_engine or (fsdp2 is not None and isinstance(model, fsdp2.Fsdp2Engine))
        if is_engine or isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif (
            _loaded("peft") is not None and hasattr(model, "peft_config") and hasattr(model, "get_base_model")
        ):
            model = model.get_base_model()
        else:
            break
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"{where}: model must be a torch.nn.Module or a deepspeed.DeepSpeedEngine, got {type(model).__name__}"
        )
    return model


def merged_tensors(
    model: Any, *, where: str = "merge", buffers: bool = False, tied: bool = False
) -> list[MergedTensor]:
    """The tensors of `model` with its LoRA adapters merged, in `named_parameters()` order
    (module docstring), planned without gathering or computing anything.

    Args:
      model: an `nn.Module` (HF model, or a peft model around one), or a DeepSpeed engine / DDP
        around one.
      where: the caller's name, which errors start with ("sync", "export_hf").
      buffers: also the persistent buffers, each after its module's parameters.
      tied: every name of a tied (shared) tensor, instead of the first only.

    Raises:
      ValueError for peft wrappers other than LoRA layers and `modules_to_save` (a name that
      would still carry a peft marker); TypeError when `model` is not a module.
    """
    root = _unwrap(model, where)
    lora_module = _loaded("peft.tuners.lora")
    lora_layer = getattr(lora_module, "LoraLayer", None) if lora_module else None
    other = _loaded("peft.utils.other")
    modules_to_save = getattr(other, "ModulesToSaveWrapper", None)
    auxiliary = getattr(other, "AuxiliaryTrainingWrapper", None) or modules_to_save
    tensors: list[MergedTensor] = []
    seen: set[int] = set()

    def emit(name: str, param: torch.Tensor, lora: Any = None, role: str = "plain") -> None:
        if id(param) in seen and not tied:
            return
        seen.add(id(param))
        tensors.append(MergedTensor(name=name, param=param, lora=lora, role=role, where=where))

    def emit_buffers(module: torch.nn.Module, prefix: str) -> None:
        if buffers:
            skipped = module._non_persistent_buffers_set
            for key, buffer in module._buffers.items():
                if buffer is not None and key not in skipped:
                    emit(prefix + key, buffer, role="buffer")

    def walk(module: torch.nn.Module, prefix: str) -> None:
        if lora_layer is not None and isinstance(module, lora_layer):
            base = module.get_base_layer()
            for key, param in base._parameters.items():
                if param is not None:
                    if key in ("weight", "bias"):
                        emit(prefix + key, param, module, key)
                    else:
                        emit(prefix + key, param)
            emit_buffers(base, prefix)
            for key, child in base._modules.items():
                if child is not None:
                    walk(child, f"{prefix}{key}.")
            return  # the adapters themselves are merged, not tensors of their own
        if auxiliary is not None and isinstance(module, auxiliary):
            if not isinstance(module, modules_to_save):
                raise ValueError(
                    f"{where}: module {prefix.rstrip('.')!r} is a peft {type(module).__name__}, which is not "
                    "merged here (LoRA and modules_to_save are); merge_and_unload() first"
                )
            copies = module.modules_to_save
            active = [a for a in module.active_adapters if a in copies]
            if module.disable_adapters or not active:
                walk(module.original_module, prefix)
            else:
                walk(copies[active[0]], prefix)
            return
        for key, param in module._parameters.items():
            if param is not None:
                emit(prefix + key, param)
        emit_buffers(module, prefix)
        for key, child in module._modules.items():
            if child is not None:
                walk(child, f"{prefix}{key}.")

    walk(root, "")
    for tensor in tensors:
        dotted = f".{tensor.name}."
        marker = next((m for m in _ADAPTER_MARKERS if m in dotted), None)
        if marker is not None:
            raise ValueError(
                f"{where}: parameter {tensor.name!r} still carries the peft marker {marker.strip('.')!r}; "
                "this adapter kind is not merged here (LoRA and modules_to_save are)"
            )
    return tensors
