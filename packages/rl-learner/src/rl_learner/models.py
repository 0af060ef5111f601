"""Models from Hugging Face checkpoints, and their forward passes over packed experience.

Policy and reference models are `AutoModelForCausalLM`. Critics and reward models are
`AutoModelForSequenceClassification` with `num_labels=1`: the causal-LM backbone plus a scalar
linear `score` head, so a model we save loads back with plain transformers and HF's own
forward gives the same score as `packed_scores`.

Packed forward. An `rl_data.ExperienceBatch` holds S sequences in one row of N tokens. The
model sees `input_ids[None]` with `position_ids[None]` (restarting at each sequence) and

    sdpa:               a [1, 1, N, N] bool block-diagonal causal mask (True = attend);
    eager:              the same mask as an additive float mask (0 or the dtype's minimum);
    flash_attention_2:  no mask; the kernels find the boundaries from position_ids.

so every token attends only to the earlier tokens of its own sequence, exactly as in a
per-sequence forward.

Alignment (the `rl_data` convention). The value at token t belongs to the state before t:

    logprobs[t] = log π(x_t | x_<t of its sequence)   from the logits at t − 1
    entropy[t]  = H(π(· | x_<t))                      from the logits at t − 1
    values[t]   = V(x_<t)                             from the score head at t − 1

and the first token of every sequence gets 0. A reward model's score of sequence s is the score
head at its last token: `scores[s] = score(h[cu_seqlens[s+1] − 1])`.

The `model` argument of the packed functions may be a transformers model or a DeepSpeed engine
wrapping one: calling through the engine is what lets ZeRO run its hooks.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from rl_algos import entropy_from_logits, logprobs_from_logits
from rl_data import ExperienceBatch, packed_attention_mask

from .config import ATTN_IMPLEMENTATIONS

__all__ = [
    "load_causal_lm",
    "load_value_model",
    "packed_logprobs",
    "packed_model_inputs",
    "packed_scores",
    "packed_values",
    "unwrap_model",
]


def unwrap_model(model: Any) -> torch.nn.Module:
    """The model inside a DeepSpeed engine (`engine.module`); any other model is returned as is."""
    return model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model


# --------------------------------------------------------------------------- loading


def _read_config(path: Path, kind: str) -> Any:
    """AutoConfig of the checkpoint at `path`, with errors that name the path and architecture."""
    from transformers import AutoConfig

    if not path.exists():
        raise FileNotFoundError(f"{kind} checkpoint {str(path)!r} does not exist")
    config_file = path / "config.json"
    if path.is_dir() and not config_file.is_file():
        raise ValueError(
            f"{kind} checkpoint {str(path)!r} has no config.json; is it a Hugging Face model folder?"
        )
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as error:
        found = "unknown"
        with contextlib.suppress(OSError, ValueError):
            raw = json.loads(config_file.read_text())
            found = f"model_type={raw.get('model_type')!r}, architectures={raw.get('architectures')!r}"
        raise ValueError(
            f"{kind} checkpoint {str(path)!r}: transformers cannot read its config ({found}): {error}"
        ) from error


def _check_architecture(path: Path, config: Any, mapping_names: dict, kind: str) -> None:
    if config.model_type not in mapping_names:
        raise ValueError(
            f"{kind} checkpoint {str(path)!r} has architecture model_type={config.model_type!r} "
            f"({', '.join(getattr(config, 'architectures', None) or ['no architectures listed'])}), "
            f"which has no causal-LM head in transformers; expected a decoder-only language model "
            f"such as qwen2 or llama"
        )


def _check_attention(attn_implementation: str) -> None:
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation: {attn_implementation!r} is not one of {ATTN_IMPLEMENTATIONS}")


@contextlib.contextmanager
def _zero3_loading(zero3_config: dict[str, Any] | None):
    """Hold a `HfDeepSpeedConfig` while loading, so `from_pretrained` builds ZeRO-3 sharded weights.

    transformers keeps only a weak reference to it: the local variable keeps it alive for the
    load, and dropping it afterwards keeps later non-ZeRO-3 loads in this process unsharded.
    """
    if zero3_config is None:
        yield
        return
    stage = zero3_config.get("zero_optimization", {}).get("stage")
    if stage != 3:
        raise ValueError(
            f"zero3_config: zero_optimization.stage is {stage!r}; pass a ZeRO stage 3 config or None"
        )
    from transformers.integrations import HfDeepSpeedConfig

    keep_alive = HfDeepSpeedConfig(zero3_config)
    try:
        yield
    finally:
        del keep_alive


def load_causal_lm(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    zero3_config: dict[str, Any] | None = None,
) -> Any:
    """A policy or reference model: `AutoModelForCausalLM.from_pretrained(path)`.

    Args:
      path: a Hugging Face model folder (config.json + weights).
      dtype: the weights' dtype.
      attn_implementation: "sdpa", "eager" or "flash_attention_2".
      gradient_checkpointing: recompute activations in the backward pass (non-reentrant).
      zero3_config: the DeepSpeed config dict when the model is trained or run with ZeRO-3:
        the weights are then created sharded over the ranks while loading.

    Raises:
      FileNotFoundError for a path that does not exist; ValueError naming the path and the
      architecture for a folder without config.json or whose model is not a causal LM.
    """
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _check_attention(attn_implementation)
    path = Path(path)
    config = _read_config(path, "causal LM")
    _check_architecture(path, config, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "causal LM")
    with _zero3_loading(zero3_config):
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation
        )
    _finish(model, gradient_checkpointing)
    return model


def load_value_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str = "sdpa",
    gradient_checkpointing: bool = False,
    zero3_config: dict[str, Any] | None = None,
    pad_token_id: int | None = None,
    head_seed: int = 0,
) -> Any:
    """A critic or reward model: `AutoModelForSequenceClassification(num_labels=1)` from `path`.

    From a causal-LM checkpoint the backbone is loaded and the scalar `score` head is new:
    weight ~ N(0, (1 / (hidden_size + 1))²), drawn from a generator seeded with `head_seed`, so
    every rank creates the same head. From a value model saved with `save_pretrained` the head
    loads as saved.

    `config.pad_token_id` is set (argument, else the config's, else the tokenizer's in `path`,
    else eos) so that HF's own forward can find the last non-pad token of padded batches.

    Arguments and errors as `load_causal_lm`.
    """
    from transformers import AutoModelForSequenceClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _check_attention(attn_implementation)
    path = Path(path)
    config = _read_config(path, "value model")
    _check_architecture(path, config, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "value model")
    pad = pad_token_id if pad_token_id is not None else _find_pad_token_id(path, config)
    with _zero3_loading(zero3_config):
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path,
            dtype=dtype,
            attn_implementation=attn_implementation,
            num_labels=1,
            pad_token_id=pad,
            output_loading_info=True,
        )
    if not hasattr(model, "score"):
        raise ValueError(
            f"value model checkpoint {str(path)!r}: {type(model).__name__} has no `score` head; "
            "only decoder-only sequence classifiers with a `score` linear head are supported"
        )
    if any(key.startswith("score.") for key in info.get("missing_keys", ())):
        _init_value_head(model.score, head_seed)
    model.config.pad_token_id = pad
    _finish(model, gradient_checkpointing)
    return model


def _find_pad_token_id(path: Path, config: Any) -> int | None:
    if getattr(config, "pad_token_id", None) is not None:
        return config.pad_token_id
    with contextlib.suppress(Exception):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer.pad_token_id is not None:
            return tokenizer.pad_token_id
    eos = getattr(config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) else eos


def _init_value_head(head: torch.nn.Linear, seed: int) -> None:
    weight = head.weight
    gathered = contextlib.nullcontext()
    if hasattr(weight, "ds_id"):  # ZeRO-3 partitioned: gather, change on rank 0, re-partition
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(
            [weight, *([head.bias] if head.bias is not None else [])], modifier_rank=0
        )
    with gathered, torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        values = torch.randn(weight.shape, generator=generator, dtype=torch.float32)
        weight.copy_((values / (weight.shape[-1] + 1)).to(weight.dtype))
        if head.bias is not None:
            head.bias.zero_()


def _finish(model: Any, gradient_checkpointing: bool) -> None:
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False


# --------------------------------------------------------------------------- packed forward


def packed_model_inputs(model: Any, batch: ExperienceBatch) -> dict[str, torch.Tensor]:
    """Keyword arguments of a packed forward: input_ids, position_ids [1, N] and the mask.

    The attention mask follows `model.config._attn_implementation` (module docstring). An
    empty batch (S = 0) becomes one dummy token, so every rank still runs a forward (ZeRO's
    collectives); its outputs must be multiplied by 0 by the caller.
    """
    module = unwrap_model(model)
    implementation = getattr(module.config, "_attn_implementation", "sdpa") or "sdpa"
    device = next(module.parameters()).device
    if batch.num_tokens == 0:
        input_ids = torch.zeros(1, dtype=torch.int64, device=device)
        position_ids = torch.zeros(1, dtype=torch.int64, device=device)
        cu_seqlens = torch.tensor([0, 1], dtype=torch.int32, device=device)
    else:
        input_ids = batch.input_ids.to(device)
        position_ids = batch.position_ids.to(device)
        cu_seqlens = batch.cu_seqlens.to(device)
    inputs = {"input_ids": input_ids[None], "position_ids": position_ids[None], "use_cache": False}
    if implementation.startswith("flash_attention"):
        return inputs
    mask = packed_attention_mask(cu_seqlens)[None, None]
    if implementation != "sdpa":
        dtype = module.dtype if module.dtype.is_floating_point else torch.float32
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)
    inputs["attention_mask"] = mask
    return inputs


def _shift_to_tokens(per_position: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """[N−1] values computed at positions 0..N−2 → [N] values at tokens 1..N−1, 0 at each sequence start."""
    shifted = torch.cat([per_position.new_zeros((1, *per_position.shape[1:])), per_position])
    return torch.where(position_ids.to(shifted.device) > 0, shifted, torch.zeros_like(shifted))


def packed_logprobs(
    model: Any,
    batch: ExperienceBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Token log-probs (and entropies) of a causal LM over a packed batch.

    Returns:
      logprobs [N] (float32; float64 for a float64 model), value at t = log π(x_t | x_<t), 0 at
      each sequence's first token; with `with_entropy`, also entropy [N], the entropy of the
      distribution that chose x_t. Gradients flow when grad mode is on. For an empty batch the
      tensors have N = 0 but are connected to the dummy forward (multiplied by 0).
    """
    logits = model(**packed_model_inputs(model, batch)).logits[0]
    if batch.num_tokens == 0:
        zero = logits.sum() * 0.0
        empty = zero.reshape(1)[:0].float()
        return (empty, empty.clone()) if with_entropy else empty
    labels = batch.input_ids.to(logits.device)
    logprobs = _shift_to_tokens(
        logprobs_from_logits(logits[:-1], labels[1:], temperature=temperature), batch.position_ids
    )
    if not with_entropy:
        return logprobs
    entropy = _shift_to_tokens(entropy_from_logits(logits[:-1], temperature=temperature), batch.position_ids)
    return logprobs, entropy


class _ScoreCapture:
    """Forward hook on the `score` head that keeps its full per-position output [1, N, 1]."""

    def __init__(self, module: torch.nn.Module) -> None:
        head = getattr(module, "score", None)
        if not isinstance(head, torch.nn.Module):
            raise ValueError(
                f"value model {type(module).__name__} has no `score` head; load it with load_value_model"
            )
        self.output: torch.Tensor | None = None
        self._handle = head.register_forward_hook(self._keep)

    def _keep(self, _module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        self.output = output

    def __enter__(self) -> _ScoreCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()


def _per_position_scores(model: Any, batch: ExperienceBatch) -> torch.Tensor:
    """[N] output of the score head at every position (one dummy position for an empty batch)."""
    module = unwrap_model(model)
    with _ScoreCapture(module) as capture:
        model(**packed_model_inputs(model, batch))
    assert capture.output is not None
    scores = capture.output[0, :, 0]
    return scores.double() if scores.dtype == torch.float64 else scores.float()


def packed_values(value_model: Any, batch: ExperienceBatch) -> torch.Tensor:
    """Critic values [N]: values[t] = score(h_{t−1}) = V(x_<t), 0 at each sequence's first token.

    float32 (float64 for a float64 model); gradients flow when grad mode is on.
    """
    scores = _per_position_scores(value_model, batch)
    if batch.num_tokens == 0:
        return scores[:0] + scores.sum() * 0.0
    return _shift_to_tokens(scores[:-1], batch.position_ids)


def packed_scores(reward_model: Any, batch: ExperienceBatch) -> torch.Tensor:
    """Reward-model scores [S]: the score head at the last token of each sequence.

    Equal to HF's `AutoModelForSequenceClassification` forward on the same sequences, right-padded,
    when no sequence ends with the pad token (HF reads the last non-pad token).
    """
    scores = _per_position_scores(reward_model, batch)
    if batch.num_sequences == 0:
        return scores[:0] + scores.sum() * 0.0
    last = batch.cu_seqlens[1:].to(device=scores.device, dtype=torch.int64) - 1
    return scores[last]
