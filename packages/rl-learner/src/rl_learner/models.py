"""Models from Hugging Face checkpoints, and their forward passes over packed experience.

Policy and reference models are `AutoModelForCausalLM`, or `AutoModelForImageTextToText` for a
vision-language folder (`rl_data.vision.is_vision_model`: the Qwen2-VL family). Critics and reward models are
`AutoModelForSequenceClassification` with `num_labels=1`: the causal-LM backbone plus a scalar
linear `score` head, so a model we save loads back with plain transformers and HF's own
forward gives the same score as `packed_scores`.

Packed forward. An `rl_data.ExperienceBatch` holds S sequences of lengths L₁..L_S in one row
of N = ΣLᵢ tokens. The model sees `input_ids[None]` and `position_ids[None]` [1, N] (restarting
at each sequence), so embeddings, norms and MLPs run on the N real tokens with no padding. Only
attention must not cross a boundary, and it costs ΣLᵢ² (never N²) on every backend:

    flash_attention_2:  no mask; transformers finds the boundaries from position_ids and calls
                        the varlen kernels.
    sdpa, eager:        the model is switched once to "rl_packed_sdpa" / "rl_packed_eager"
                        (`packed_attention_forward`): each layer gathers q, k, v of the packed row
                        into length buckets, right-padded [B_k, H, L_k, D] batches of sequences of
                        similar length, runs the stock sdpa (is_causal, no mask) or eager kernel
                        (a [1, 1, L_k, L_k] causal mask) on each, and gathers the real positions
                        back into packed order. Cost Σ_k B_k·L_k² ≤ (1 + max_waste)·max L·ΣLᵢ,
                        plus four gathers of N·H·D per layer. Without the packing keyword the
                        two implementations are exactly sdpa and eager, so the switched model
                        still runs padded batches and generate as before.
    flex_attention:     no mask; transformers builds a block-sparse document mask from
                        position_ids (CUDA only for training: torch has no flex backward on CPU).

so every token attends only to the earlier tokens of its own sequence, exactly as in a
per-sequence forward. No N×N mask is built (`rl_data.packed_attention_mask` is O(N²) and only
for tests and the benchmark).

Shared prefixes (`share_prefix=True`, sdpa / eager). GRPO-style batches hold n samples of one
prompt: n sequences that start with the same tokens. `shared_prefix(batch)` finds them (the
tokens before a sequence's first action token, compared exactly) and the forward runs each
distinct prefix once: the model sees the compressed row of Nc tokens (every token of a group's
first sequence, only the suffix of the others), and attention gathers each sequence's full
token list from it (the prefix from the first member), so every suffix token attends to the
prefix keys and values exactly as in its own sequence. Positions are unchanged (a suffix
continues from its prefix's length). Outputs are mapped back to the N tokens of the row
(`SharedPrefix.own`), so callers see the same [N] values; the gradient of a shared prefix
token is the sum of what its n copies would get, which is what the parameters receive from n
copies. Embeddings, projections, MLPs and the LM head then cost Nc instead of N tokens (a
GRPO group of n samples of a P-token prompt with L-token responses: P + n·L instead of
n·(P + L)); attention still costs what it did.

Alignment (the `rl_data` convention). The value at token t belongs to the state before t:

    logprobs[t] = log π(x_t | x_<t of its sequence)   from the logits at t − 1
    entropy[t]  = H(π(· | x_<t))                      from the logits at t − 1
    values[t]   = V(x_<t)                             from the score head at t − 1

and the first token of every sequence gets 0. A reward model's score of sequence s is the score
head at its last token: `scores[s] = score(h[cu_seqlens[s+1] − 1])`.

Images (VL models of the Qwen2-VL family, a batch with `has_images`). The packed row is the same;
what changes is what the model is given (`packed_model_inputs`):

    position_ids [4, 1, N]   row 0 the text positions (restarting per sequence: what the packed
                             attention and flash's varlen boundaries read), rows 1..3 the mRoPE
                             (t, h, w) positions: each sequence's own `get_rope_index` over its
                             ids and its images' grids, concatenated (`mrope_position_ids`).
    mm_encoder_outputs       the vision tower's merged embeddings of the row's image tokens, in
                             row order. The tower is called on its own (`model.visual(pixel_values,
                             grid_thw)`), so the packed-attention keywords never reach its
                             attention; through a DeepSpeed engine its submodules' ZeRO-3 hooks
                             still gather its weights. Every forward of a VL model runs the tower
                             once (a dummy merge×merge grid when the row has no image), so ZeRO-3's
                             collective gathers line up across ranks and its weights always get a
                             gradient (zero when unused).

The placeholder tokens (`rl_data.vision.vision_token_ids`) are outside the policy's support: the
log-probs and entropies are those of softmax(logits with them at −∞), as the engines sample, and
a placeholder token itself (never an action: the prompt or an environment put it there) gets
log-prob 0, like other tokens that are not the policy's.
The model scatters the embeddings into the placeholder tokens' positions and runs its language
model on the packed row; log-probs equal one unpacked HF forward per sequence (`model(input_ids,
pixel_values, image_grid_thw, mm_token_type_ids)`). `only_actions` and `share_prefix` (two prompts
are shared only when their sequences' images are equal too: placeholder ids do not tell images
apart) work as for text. Sequence parallelism is refused for a VL model: the slicing of the mRoPE rows and
of the image embeddings by rank is written (`packed_model_inputs`) but no multi-rank test pins
it yet, and an untested split must not give a wrong answer (run VL models with
sequence_parallel_size 1).

The `model` argument of the packed functions may be a transformers model or a DeepSpeed engine
wrapping one: calling through the engine is what lets ZeRO run its hooks.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_algos import entropy_from_logits, logprobs_from_logits
from rl_data import ExperienceBatch
from rl_data.vision import image_token_counts, is_vision_model, vision_token_ids

from .config import ATTN_IMPLEMENTATIONS
from .routing import MoERouting, row_routes
from .sequence_parallel import SequenceParallelGroup, sum_over_group, ulysses_attention

__all__ = [
    "PACKED_ATTENTION_MAX_WASTE",
    "LengthBuckets",
    "RouterCapture",
    "SharedPrefix",
    "freeze_visual_encoder",
    "length_buckets",
    "load_causal_lm",
    "load_value_model",
    "mrope_position_ids",
    "packed_attention_forward",
    "packed_logprobs",
    "packed_model_inputs",
    "packed_scores",
    "packed_values",
    "row_tokens",
    "shared_prefix",
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
    Sharding at load time needs torch.distributed: a process started without a launcher gets a
    world of one first (as a learner would make when it is built).
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

    from .distributed import ensure_distributed

    ensure_distributed()
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

    A vision-language folder (`rl_data.vision.is_vision_model`) loads with
    `AutoModelForImageTextToText` instead (e.g. `Qwen2VLForConditionalGeneration`: parameters
    `model.visual.*`, `model.language_model.*`, `lm_head.*`), ZeRO-3 sharded loading included.

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
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _check_attention(attn_implementation)
    path = Path(path)
    config = _read_config(path, "causal LM")
    auto = AutoModelForCausalLM
    if is_vision_model(path):
        auto = AutoModelForImageTextToText
    else:
        _check_architecture(path, config, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "causal LM")
    with _zero3_loading(zero3_config):
        model = auto.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
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

    A vision-language folder is refused (transformers has no sequence-classification class for
    the Qwen2-VL family): a critic or reward model is a text model here.

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
    if is_vision_model(path):
        raise ValueError(
            f"value model checkpoint {str(path)!r} is a vision-language model (model_type="
            f"{config.model_type!r}); critics and reward models are text-only causal LMs with a `score` "
            "head here (transformers has no sequence-classification class for it): use a text model "
            "as critic / reward model, or a critic-free estimator (GRPO, REINFORCE++, RLOO) with a "
            "reward function"
        )
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


# --------------------------------------------------------------------------- packed attention

PACKED_ATTENTION_MAX_WASTE = 0.1
"""Default bound on padded slots per real token in a length bucket (see `length_buckets`)."""

# The stock implementation each packed one runs per bucket, and the names models are switched to.
_PACKED_IMPLEMENTATIONS: dict[str, str] = {"sdpa": "rl_packed_sdpa", "eager": "rl_packed_eager"}
_BASE_IMPLEMENTATIONS: dict[str, str] = {packed: base for base, packed in _PACKED_IMPLEMENTATIONS.items()}
# Implementations that find sequence boundaries from position_ids on their own.
_POSITION_ID_IMPLEMENTATIONS: tuple[str, ...] = ("flash_attention_2", "flash_attention_3", "flex_attention")


class LengthBuckets:
    """Where the tokens of a packed row go in the length-bucketed batches that attention runs on.

    Attributes:
      gathers: one [B_k, L_k] int64 tensor per bucket: slot (b, j) holds packed token
        `start_b + min(j, L_b − 1)` of the bucket's b-th sequence (start_b, L_b its start and
        length; L_k the bucket's longest). Slots past a sequence's end repeat its last token; they
        lie after every real query of their row, so causal attention never reads them, and their
        outputs are dropped.
      order: [N] int64: for packed token t, its slot in the concatenation of every bucket's
        flattened [B_k·L_k] slots, so `torch.cat(outputs)[order]` is back in packed order.
      num_tokens: N.
    """

    def __init__(self, gathers: tuple[torch.Tensor, ...], order: torch.Tensor, num_tokens: int) -> None:
        self.gathers = gathers
        self.order = order
        self.num_tokens = num_tokens

    def to(self, device: torch.device | str) -> LengthBuckets:
        return LengthBuckets(
            tuple(g.to(device) for g in self.gathers), self.order.to(device), self.num_tokens
        )

    def __repr__(self) -> str:
        shapes = ", ".join(f"{tuple(g.shape)}" for g in self.gathers)
        return f"LengthBuckets(num_tokens={self.num_tokens}, buckets=[{shapes}])"


def length_buckets(
    cu_seqlens: torch.Tensor, *, max_waste: float = PACKED_ATTENTION_MAX_WASTE
) -> LengthBuckets:
    """Group the sequences of a packed row into right-padded batches of similar length.

    Sequences are sorted by length, longest first, and taken greedily: a bucket whose longest
    sequence has length L_k takes the next sequence while B_k·L_k ≤ (1 + max_waste)·(its real
    tokens), so its padded slots number at most `max_waste` × its real tokens (a single sequence
    always fits). With max_waste = 0 every bucket holds sequences of one length; a large value gives
    one padded batch. Zero-length sequences are skipped.

    Args:
      cu_seqlens: [S+1] int boundaries of the packed row (`rl_data` convention); read on the host.
      max_waste: padded slots per real token allowed in a bucket, ≥ 0.

    Returns:
      `LengthBuckets` on `cu_seqlens`' device. Cost O(S log S + N), one host read of cu_seqlens.
    """
    if not (isinstance(max_waste, (int, float)) and max_waste >= 0):
        raise ValueError(f"max_waste: {max_waste!r} is not allowed; expected a number >= 0")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least one entry, got shape {tuple(cu_seqlens.shape)}"
        )
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in itertools.pairwise(bounds)]
    if any(length < 0 for length in lengths):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {bounds}")
    by_length = sorted((i for i, length in enumerate(lengths) if length > 0), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    tokens = 0
    for index in by_length:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= (1 + max_waste) * (
            tokens + lengths[index]
        ):
            groups[-1].append(index)
            tokens += lengths[index]
        else:
            groups.append([index])
            tokens = lengths[index]
    num_tokens = bounds[-1] - bounds[0]
    order = torch.empty(num_tokens, dtype=torch.int64)
    gathers = []
    offset = 0
    for group in groups:
        width = lengths[group[0]]
        starts = torch.tensor([bounds[i] for i in group], dtype=torch.int64)[:, None]
        ends = torch.tensor([bounds[i + 1] for i in group], dtype=torch.int64)[:, None]
        slots = starts + torch.arange(width, dtype=torch.int64)
        real = slots < ends
        gathers.append(torch.minimum(slots, ends - 1))
        flat = torch.arange(offset, offset + slots.numel(), dtype=torch.int64).reshape(slots.shape)
        order[slots[real] - bounds[0]] = flat[real]
        offset += slots.numel()
    device = cu_seqlens.device
    return LengthBuckets(tuple(g.to(device) for g in gathers), order.to(device), num_tokens)


class SharedPrefix:
    """A packed row with each group's shared prefix run once (module docstring).

    Attributes:
      keep: [Nc] int64, ascending: the row's tokens the model runs (a group's first sequence
        whole, the other members from their first action token on).
      own: [N] int64: for every token of the row, the index in the compressed row of the token
        whose output it takes (itself, or the same position of its group's first sequence).
      num_tokens: N.
    """

    def __init__(self, keep: torch.Tensor, own: torch.Tensor, num_tokens: int) -> None:
        self.keep = keep
        self.own = own
        self.num_tokens = num_tokens

    @property
    def saved_tokens(self) -> int:
        """N − Nc: the tokens of the row the model does not run."""
        return self.num_tokens - self.keep.numel()

    def buckets(self, buckets: LengthBuckets) -> LengthBuckets:
        """`length_buckets` of the row's sequences, reading each token from the compressed row."""
        own = self.own.to(buckets.order.device)
        return LengthBuckets(
            tuple(own[gather] for gather in buckets.gathers),
            buckets.order[self.keep.to(own.device)],
            self.keep.numel(),
        )

    def __repr__(self) -> str:
        return f"SharedPrefix(num_tokens={self.num_tokens}, runs={self.keep.numel()})"


def shared_prefix(batch: ExperienceBatch) -> SharedPrefix | None:
    """Group the sequences of a packed batch by their prefix; None when no two share one.

    A sequence's prefix is its tokens before its first action token (`batch.action_mask`), the
    whole sequence if it has none. Sequences whose prefixes are equal token for token (and, with
    images, whose images are equal: `_prefix_images`) form a group; the first of each group (in row order) runs whole, the others only from their first
    action token on (`SharedPrefix`). Every sequence starts at position 0 (`rl_data`), so equal
    prefixes have equal positions. Cost O(N) on the host (one read of input_ids and the mask).
    """
    if batch.num_sequences < 2:
        return None
    ids = batch.input_ids.cpu().numpy()
    actions = batch.action_mask.cpu().numpy()
    bounds = batch.cu_seqlens.tolist()
    source = np.arange(batch.num_tokens)
    images = _prefix_images(batch)
    first: dict[bytes, int] = {}
    for sequence, (start, end) in enumerate(itertools.pairwise(bounds)):
        hits = np.flatnonzero(actions[start:end])
        length = int(hits[0]) if hits.size else end - start
        if length == 0:
            continue
        key = ids[start : start + length].tobytes() + images(sequence)
        origin = first.setdefault(key, start)
        if origin != start:
            source[start : start + length] = np.arange(origin, origin + length)
    runs = source == np.arange(batch.num_tokens)
    if runs.all():
        return None
    compressed = np.cumsum(runs) - 1
    return SharedPrefix(
        torch.from_numpy(np.flatnonzero(runs)),
        torch.from_numpy(compressed[source]),
        batch.num_tokens,
    )


def _prefix_images(batch: ExperienceBatch) -> Any:
    """`images(sequence)`: bytes of the images (grids and patches) of a sequence; b"" without images.

    Placeholder ids are the same for every image, so two prefixes are shared only when their
    sequences also hold the same images. All of a sequence's images count (those of its response,
    an environment's, too): sequences of a group whose later images differ run their prefix
    apart, never with another sequence's pixels."""
    if not batch.has_images:
        return lambda sequence: b""
    grid = batch.image_grid_thw.cpu()
    patches = grid.prod(-1)
    first_patch = torch.cat([patches.new_zeros(1), patches.cumsum(0)]).tolist()
    counts = batch.image_counts.cpu()
    first_image = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).tolist()
    pixels = batch.pixel_values.cpu()

    def images(sequence: int) -> bytes:
        low, high = first_image[sequence], first_image[sequence + 1]
        if low == high:
            return b""
        return (
            grid[low:high].numpy().tobytes() + pixels[first_patch[low] : first_patch[high]].numpy().tobytes()
        )

    return images


def _bucket_mask(
    width: int, sliding_window: int | None, base: str, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """The mask one bucket's kernel needs: None for sdpa's is_causal, else [1, 1, L, L] (bool or additive)."""
    windowed = sliding_window is not None and width > sliding_window
    if base == "sdpa" and not windowed:
        return None
    query = torch.arange(width, device=device)[:, None]
    key = torch.arange(width, device=device)[None, :]
    allowed = key <= query
    if windowed:
        allowed &= key > query - sliding_window  # transformers' sliding-window convention
    if base == "sdpa":
        return allowed[None, None]
    return torch.zeros((1, 1, width, width), dtype=dtype, device=device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )


def _eager_kernel(module: torch.nn.Module) -> Any:
    """The `eager_attention_forward` of the module's own modeling file (some models soft-cap, add sinks)."""
    kernel = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if kernel is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as kernel
    return kernel


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    base: str,
    packed_length_buckets: LengthBuckets | None = None,
    packed_sequence_parallel: SequenceParallelGroup | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over a packed row in length buckets; registered as "rl_packed_sdpa" / "rl_packed_eager".

    Args:
      query: [1, H, N, D]; key, value: [1, H_kv, N, D] (rotary embeddings already applied with the
        per-sequence position ids).
      attention_mask: ignored in packed mode (the packed forward passes an empty placeholder so
        transformers builds no mask).
      base: "sdpa" or "eager", the stock kernel run on each bucket.
      packed_length_buckets: from `length_buckets(cu_seqlens)`. When None this is exactly the
        stock `base` implementation, with the given mask.
      packed_sequence_parallel: the rank's sequence-parallel group, or None. With it, query, key
        and value hold this rank's n tokens of the padded row, the buckets cover all N_pad
        tokens, and the output is this rank's [1, n, H, D] (`rl_learner.sequence_parallel`).
      sliding_window, kwargs: as the stock kernels take them (scaling, dropout, soft-capping...).

    Returns:
      ([1, N, H, D] attention output in packed order, None): attention weights are not kept.
      Cost Σ_k B_k·H·L_k²·D.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if packed_sequence_parallel is not None:
        return ulysses_attention(
            functools.partial(packed_attention_forward, base=base),
            module,
            query,
            key,
            value,
            packed_sequence_parallel,
            attention_mask=attention_mask,
            packed_length_buckets=packed_length_buckets,
            sliding_window=sliding_window,
            **kwargs,
        )
    kernel = ALL_ATTENTION_FUNCTIONS["sdpa"] if base == "sdpa" else _eager_kernel(module)
    buckets = packed_length_buckets
    if buckets is None:
        return kernel(module, query, key, value, attention_mask, sliding_window=sliding_window, **kwargs)
    if query.shape[0] != 1 or query.shape[2] != buckets.num_tokens:
        raise ValueError(
            f"packed attention expects one packed row of {buckets.num_tokens} tokens, got query of shape "
            f"{tuple(query.shape)} ([batch, heads, tokens, head_dim])"
        )
    if not getattr(module, "is_causal", True):
        raise ValueError(f"packed attention is causal; {type(module).__name__} is not (is_causal=False)")
    kwargs.pop("is_causal", None)
    kwargs.pop("output_attentions", None)
    # [1, H, N, D] → [N, H, D], so one index picks whole tokens: [B_k, L_k, H, D] → [B_k, H, L_k, D].
    query, key, value = (tensor[0].transpose(0, 1) for tensor in (query, key, value))
    outputs = []
    for gather in buckets.gathers:
        mask = _bucket_mask(gather.shape[1], sliding_window, base, query.dtype, query.device)
        output, _ = kernel(
            module,
            query[gather].transpose(1, 2),
            key[gather].transpose(1, 2),
            value[gather].transpose(1, 2),
            mask,
            sliding_window=sliding_window,
            **kwargs,
        )
        outputs.append(output.reshape(-1, *output.shape[2:]))  # [B_k·L_k, H, D]
    return torch.cat(outputs)[buckets.order][None], None


_registered = False


def _register_packed_attention() -> None:
    """Register "rl_packed_sdpa" / "rl_packed_eager" with transformers (once per process)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for base, packed in _PACKED_IMPLEMENTATIONS.items():
        AttentionInterface.register(packed, functools.partial(packed_attention_forward, base=base))
        # Outside packed mode the mask is built exactly as for the stock implementation.
        AttentionMaskInterface.register(packed, ALL_MASK_ATTENTION_FUNCTIONS[base])
    _registered = True


def _packed_implementation(module: torch.nn.Module) -> str:
    """The model's attention implementation, switching sdpa/eager to their packed versions in place."""
    config = module.config
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    if implementation in _PACKED_IMPLEMENTATIONS:
        _register_packed_attention()
        implementation = _PACKED_IMPLEMENTATIONS[implementation]
        # Permanent, not undone after the forward: gradient checkpointing re-runs the layers in
        # the backward pass and reads the implementation again then.
        config._attn_implementation = implementation
    elif implementation in _BASE_IMPLEMENTATIONS:
        _register_packed_attention()  # already switched by an earlier packed forward
    elif not implementation.startswith(_POSITION_ID_IMPLEMENTATIONS):
        raise ValueError(
            f"{type(module).__name__}: attention implementation {implementation!r} has no packed forward; "
            f"use one of sdpa, eager, {', '.join(_POSITION_ID_IMPLEMENTATIONS)}"
        )
    return implementation


# --------------------------------------------------------------------------- packed forward


def row_tokens(
    num_tokens: int, sharing: SharedPrefix | None, sequence_parallel: SequenceParallelGroup | None
) -> torch.Tensor:
    """[R] int64: the batch token each position of a packed forward's row runs, −1 for filler.

    The row is the batch's N tokens, the compressed row `sharing.keep` under prefix sharing, and
    with `sequence_parallel` this rank's slice of that row padded to a multiple of the group
    (`packed_model_inputs`)."""
    source = torch.arange(num_tokens)
    if sharing is not None:
        source = source[sharing.keep.cpu()]
    if sequence_parallel is not None:
        row = source.numel()
        start, end = sequence_parallel.local_range(row)
        filler = torch.full((sequence_parallel.padded_length(row) - row,), -1, dtype=torch.int64)
        source = torch.cat([source, filler])[start:end]
    return source


def packed_model_inputs(
    model: Any,
    batch: ExperienceBatch,
    *,
    sharing: SharedPrefix | None = None,
    sequence_parallel: SequenceParallelGroup | None = None,
) -> dict[str, Any]:
    """Keyword arguments of a packed forward: input_ids, position_ids [1, N], and for sdpa/eager the buckets.

    flash / flex attention get only position_ids (module docstring). sdpa and eager models are
    switched to their packed versions and get `packed_length_buckets` (`length_buckets` of the
    batch) and an empty [1, 1, 0, 0] placeholder `attention_mask`, which transformers passes
    through untouched instead of building a mask. An empty batch (S = 0) becomes one dummy
    token, so every rank still runs a forward (ZeRO's collectives); its outputs must be
    multiplied by 0 by the caller. With `sharing` (`shared_prefix(batch)`; sdpa and eager only)
    the row is the compressed one: input_ids, position_ids [1, Nc] and buckets that read each
    sequence's tokens from it; outputs at compressed token c belong to the row's tokens t with
    `sharing.own[t] == c`. With `sequence_parallel` (sdpa and eager only) the row (N or Nc
    tokens, R) is padded to R_pad = sp·⌈R / sp⌉ with one extra sequence of token 0, input_ids
    and position_ids are this rank's slice [1, R_pad / sp] (`SequenceParallelGroup.local_range`),
    the buckets cover the padded row, and `packed_sequence_parallel` carries the group to attention.
    """
    module = unwrap_model(model)
    implementation = _packed_implementation(module)
    device = next(module.parameters()).device
    if sharing is not None and implementation not in _BASE_IMPLEMENTATIONS:
        raise ValueError(
            f"shared prefixes need sdpa or eager attention; {type(module).__name__} runs {implementation!r}, "
            "whose kernel finds sequences from position ids (run it with share_prefix=False)"
        )
    if sequence_parallel is not None and implementation not in _BASE_IMPLEMENTATIONS:
        raise ValueError(
            f"sequence parallelism needs sdpa or eager attention; {type(module).__name__} runs "
            f"{implementation!r} (run it with sequence_parallel_size 1, or attn_implementation sdpa)"
        )
    vision = _vision_model(module)
    if vision is not None and sequence_parallel is not None:
        raise ValueError(
            f"sequence parallelism is not supported for the vision-language model {type(module).__name__} "
            "yet (its per-rank split of mRoPE positions and image embeddings is not verified); "
            "run it with sequence_parallel_size 1"
        )
    if vision is None and batch.has_images:
        raise ValueError(
            f"the batch has {batch.image_grid_thw.shape[0]} images but {type(module).__name__} is not a "
            "vision-language model (load a VL checkpoint, e.g. Qwen2-VL, with load_causal_lm)"
        )
    if batch.num_tokens == 0:
        input_ids = torch.zeros(1, dtype=torch.int64, device=device)
        position_ids = torch.zeros(1, dtype=torch.int64, device=device)
        cu_seqlens = torch.tensor([0, 1], dtype=torch.int32)
        sharing = None
    else:
        input_ids = batch.input_ids.to(device)
        position_ids = batch.position_ids.to(device)
        cu_seqlens = batch.cu_seqlens.cpu()
    # rows of position ids: [1, R] text positions, or [4, R] for a VL model (text, then mRoPE t, h, w)
    positions = position_ids[None]
    if vision is not None:
        positions = torch.cat([positions, mrope_position_ids(vision, batch).to(device)])
    source = row_tokens(input_ids.numel(), sharing, sequence_parallel).to(device)
    if sharing is not None:
        keep = sharing.keep.to(device)
        input_ids, positions = input_ids[keep], positions[:, keep]
    padding = 0
    if sequence_parallel is not None:
        row = input_ids.numel()
        padding = sequence_parallel.padded_length(row) - row
        start, end = sequence_parallel.local_range(row)
        filler = torch.arange(padding, dtype=torch.int64, device=device)
        input_ids = torch.cat([input_ids, torch.zeros_like(filler)])[start:end]
        positions = torch.cat([positions, filler.expand(positions.shape[0], -1)], dim=1)[:, start:end]
    inputs: dict[str, Any] = {
        "input_ids": input_ids[None],
        "position_ids": positions[:, None] if vision is not None else positions,
        "use_cache": False,
    }
    if vision is not None:
        inputs["mm_encoder_outputs"] = {"image": _image_embeddings(vision, batch, source.cpu())}
    if implementation in _BASE_IMPLEMENTATIONS:
        buckets = length_buckets(cu_seqlens)
        if sharing is not None:
            buckets = sharing.buckets(buckets)
        if padding:
            buckets = _with_padding(buckets, padding)
        inputs["attention_mask"] = torch.zeros((1, 1, 0, 0), dtype=torch.bool, device=device)
        inputs["packed_length_buckets"] = buckets.to(device)
    if sequence_parallel is not None:
        inputs["packed_sequence_parallel"] = sequence_parallel
    return inputs


# --------------------------------------------------------------------------- vision-language models


def _placeholder_ids(model: Any) -> torch.Tensor | None:
    """[K] int64 ids of a VL model's placeholder tokens (`rl_data.vision.vision_token_ids`), None for
    a text model. They are outside the policy's support (its engines never sample them): its
    log-probs and entropies are those of softmax(logits with them at −∞)."""
    vision = _vision_model(unwrap_model(model))
    return None if vision is None else torch.tensor(vision_token_ids(vision.config), dtype=torch.int64)


def _zero_at_placeholders(
    never: torch.Tensor | None, logprobs: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """`logprobs` [K] of tokens `labels` [K], 0 where the token is a placeholder (`never`): it is
    outside the support (log-prob −∞) and never an action (the prompt or an environment placed
    it), so it carries 0 like every token that is not the policy's (no −∞ reaches a masked sum)."""
    if never is None:
        return logprobs
    return torch.where(torch.isin(labels, never.to(labels.device)), torch.zeros_like(logprobs), logprobs)


def _vision_model(module: torch.nn.Module) -> Any:
    """The inner multimodal model (`.visual` tower, `.get_rope_index`) of a Qwen2-VL-family model, else None."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    inner = getattr(base, "model", None)
    if isinstance(inner, torch.nn.Module) and hasattr(inner, "visual") and hasattr(inner, "get_rope_index"):
        return inner
    return None


def freeze_visual_encoder(model: Any) -> list[str]:
    """Freeze the vision tower of a VL model in place: every parameter under `model.visual` (patch
    embedding, vision blocks, merger) gets requires_grad False. Returns the frozen parameter names.

    `model` may be a transformers model, a peft wrapper or a DeepSpeed engine (before its
    optimizer is built: an optimizer keeps the parameters it was given). Raises ValueError for a
    model without a vision tower."""
    module = unwrap_model(model)
    vision = _vision_model(module)
    if vision is None:
        raise ValueError(
            f"freeze_visual_encoder: {type(module).__name__} has no vision tower (model.visual); "
            "it applies to vision-language models only (set it False for a text model)"
        )
    frozen = []
    tower = vision.visual
    ids = {id(parameter) for parameter in tower.parameters()}
    for name, parameter in module.named_parameters():
        if id(parameter) in ids:
            parameter.requires_grad_(False)
            frozen.append(name)
    return frozen


def _image_layout(vision: Any, batch: ExperienceBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(is_image [N] bool, tokens [I] int64): which tokens are image placeholders, and how many each image has.

    Image i fills the i-th run of nᵢ = tᵢ·hᵢ·wᵢ / merge² placeholders of the row (`rl_data.vision`).
    Raises ValueError when the counts disagree (or the batch has placeholders and no images)."""
    merge = int(vision.visual.spatial_merge_size)
    is_image = batch.input_ids.cpu() == int(vision.config.image_token_id)
    if batch.has_images:
        tokens = image_token_counts(batch.image_grid_thw.cpu(), merge)
    else:
        tokens = torch.zeros(0, dtype=torch.int64)
    if int(tokens.sum()) != int(is_image.sum()):
        raise ValueError(
            f"the batch has {int(is_image.sum())} image placeholder tokens (id {int(vision.config.image_token_id)}) "
            f"but its image_grid_thw gives {int(tokens.sum())} ({tokens.tolist()} per image)"
        )
    return is_image, tokens


def mrope_position_ids(vision: Any, batch: ExperienceBatch) -> torch.Tensor:
    """[3, N] int64 multimodal rotary positions (temporal, height, width) of a packed row, on the host.

    Each sequence with images gets the model's own `get_rope_index` of that sequence alone (its
    images' grids): text tokens count on from the previous token, an image's nᵢ tokens take
    (t, h, w) grid positions starting there, and the text after it resumes at that start plus
    max(h, w) / merge. A sequence without images has its text positions in all three rows, as
    in the model's own forward. Positions restart at 0 in every sequence (the packed row).
    `vision` is the inner model (`Qwen2VLModel`); N = 0 gives [3, 1] zeros (the dummy token).
    """
    if batch.num_tokens == 0:
        return torch.zeros((3, 1), dtype=torch.int64)
    positions = batch.position_ids.cpu().to(torch.int64).expand(3, -1).clone()
    if not batch.has_images:
        return positions
    is_image, _ = _image_layout(vision, batch)
    counts = batch.image_counts.cpu()
    first_image = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).tolist()
    grid = batch.image_grid_thw.cpu()
    bounds = batch.cu_seqlens.tolist()
    for sequence in torch.nonzero(counts, as_tuple=True)[0].tolist():
        start, end = bounds[sequence], bounds[sequence + 1]
        ids = batch.input_ids[start:end].cpu()[None]
        rope, _ = vision.get_rope_index(
            ids,
            mm_token_type_ids=is_image[start:end].to(torch.int32)[None],
            image_grid_thw=grid[first_image[sequence] : first_image[sequence + 1]],
        )
        positions[:, start:end] = rope[:, 0]
    return positions


def _image_embeddings(vision: Any, batch: ExperienceBatch, source: torch.Tensor) -> Any:
    """The vision tower's embeddings of the image tokens among the row's tokens, as `mm_encoder_outputs["image"]`.

    `source` [R] holds the batch token of each row token (the compressed row's under prefix
    sharing, this rank's slice under sequence parallelism; −1 for padding). The tower runs once
    on the images with a token in the row (called directly, so the packed-attention keywords of
    the language model never reach its own attention; through a DeepSpeed engine ZeRO-3's
    hooks on the submodules still gather its weights), and the embeddings of those tokens are
    taken in row order. Without such an image a dummy one (one merge×merge patch grid of zeros)
    runs and none of its embeddings is used: every rank runs the tower in every forward (ZeRO-3
    gathers collectively) and its weights always get a (zero) gradient.
    """
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    tower = vision.visual
    merge = int(tower.spatial_merge_size)
    weight = next(tower.parameters())
    is_image, tokens = _image_layout(vision, batch) if batch.num_tokens else (None, None)
    wanted = source[source >= 0]
    if is_image is not None:
        wanted = wanted[is_image[wanted]]
    if wanted.numel():
        rank = (torch.cumsum(is_image.to(torch.int64), 0) - 1)[wanted]  # [K] image-token rank in the batch
        first_token = torch.cat([tokens.new_zeros(1), tokens.cumsum(0)])
        image_of = torch.repeat_interleave(torch.arange(tokens.numel()), tokens)[rank]
        images = torch.unique(image_of)
        grid = batch.image_grid_thw.cpu()
        patches = grid.prod(-1)
        first_patch = torch.cat([patches.new_zeros(1), patches.cumsum(0)]).tolist()
        rows = torch.cat([torch.arange(first_patch[i], first_patch[i + 1]) for i in images.tolist()])
        grid = grid[images]
        pixels = batch.pixel_values[rows.to(batch.pixel_values.device)]
        offset = torch.cat([tokens.new_zeros(1), tokens[images].cumsum(0)])
        take = offset[torch.searchsorted(images, image_of)] + rank - first_token[image_of]
    else:
        config = tower.config
        width = config.in_channels * config.temporal_patch_size * config.patch_size**2
        grid = torch.tensor([[1, merge, merge]], dtype=torch.int64)
        pixels = torch.zeros((merge * merge, width))
        take = torch.zeros(0, dtype=torch.int64)
    output = tower(pixels.to(device=weight.device, dtype=weight.dtype), grid_thw=grid.to(weight.device))
    embeddings = output.pooler_output[take.to(weight.device)]
    return BaseModelOutputWithPooling(pooler_output=(embeddings,))


def _with_padding(buckets: LengthBuckets, padding: int) -> LengthBuckets:
    """`buckets` of a row of R tokens plus a last bucket for `padding` tokens R..R+padding−1 (one sequence)."""
    row = buckets.num_tokens
    slots = sum(gather.numel() for gather in buckets.gathers)
    extra = torch.arange(row, row + padding, dtype=torch.int64, device=buckets.order.device)
    return LengthBuckets(
        (*buckets.gathers, extra[None]),
        torch.cat([buckets.order, extra - row + slots]),
        row + padding,
    )


def _sharing(batch: ExperienceBatch, share_prefix: bool) -> SharedPrefix | None:
    """`shared_prefix(batch)` when asked for and the batch has any, else None."""
    if not share_prefix or batch.num_tokens == 0:
        return None
    return shared_prefix(batch)


def _shift_to_tokens(per_position: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """[N−1] values computed at positions 0..N−2 → [N] values at tokens 1..N−1, 0 at each sequence start."""
    shifted = torch.cat([per_position.new_zeros((1, *per_position.shape[1:])), per_position])
    return torch.where(position_ids.to(shifted.device) > 0, shifted, torch.zeros_like(shifted))


def _logits_before(tokens: torch.Tensor, sharing: SharedPrefix | None) -> torch.Tensor:
    """Where the logits that choose row tokens `tokens` (each ≥ 1) are: t − 1, or its compressed copy."""
    return tokens - 1 if sharing is None else sharing.own.to(tokens.device)[tokens - 1]


def packed_logprobs(
    model: Any,
    batch: ExperienceBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    only_actions: bool = False,
    share_prefix: bool = False,
    sequence_parallel: SequenceParallelGroup | None = None,
    routing: MoERouting | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Token log-probs (and entropies) of a causal LM over a packed batch.

    With `only_actions`, the LM head, the log-softmax and the entropy run only at the K positions
    that predict an action token (`batch.action_mask`), through transformers' `logits_to_keep`:
    their cost and the [K, V] logits scale with the response tokens instead of all N tokens
    (for a 152k vocabulary, 16k tokens of float32 logits are 10 GB). Values at other tokens are 0.
    With `share_prefix`, sequences that start with the same prompt run it once (module
    docstring; sdpa / eager attention and a model that takes `logits_to_keep`): the same values.
    With `sequence_parallel`, every rank of the group passes the same batch, runs its slice of
    the row (`rl_learner.sequence_parallel`) and gets the full [N] results: a token's log-prob is
    computed on the rank that holds the position before it (its label read from the full row),
    and the ranks' parts are summed over the group.
    With `routing` (an entered `rl_learner.routing.MoERouting` of this model), the batch's
    `routed_experts` are loaded for the forward's row: replayed when `routing.replay` (routing
    replay, R3; a batch without them is refused), recorded against the routes used otherwise.

    Returns:
      logprobs [N] (float32; float64 for a float64 model), value at t = log π(x_t | x_<t), 0 at
      each sequence's first token (and, with `only_actions`, at every non-action token); with
      `with_entropy`, also entropy [N], the entropy of the distribution that chose x_t. Gradients
      flow when grad mode is on. For an empty batch the tensors have N = 0 but are connected to
      the dummy forward (multiplied by 0).
    """
    takes_keep = (share_prefix or only_actions) and _accepts_logits_to_keep(model)
    if share_prefix and not takes_keep:
        raise ValueError(
            f"share_prefix needs a model whose forward takes logits_to_keep; {type(unwrap_model(model)).__name__} "
            "does not (run it with share_prefix=False: DeepSpeedConfig.share_prefix, rl-launch's model.share_prefix)"
        )
    sharing = _sharing(batch, share_prefix)
    if routing is not None:
        _load_routes(routing, batch, sharing, sequence_parallel)
    if sequence_parallel is not None:
        return _sequence_parallel_logprobs(
            model, batch, sharing, sequence_parallel, temperature, with_entropy, only_actions
        )
    inputs = packed_model_inputs(model, batch, sharing=sharing)
    device = inputs["input_ids"].device
    keep = targets = None
    if only_actions and batch.num_tokens and takes_keep:
        # a sequence's first token has no logits before it (its log-prob is 0 in either mode)
        targets = torch.nonzero(batch.action_mask & (batch.position_ids > 0), as_tuple=True)[0]
        keep = _logits_before(targets, sharing)
    elif sharing is not None:
        keep = _logits_before(torch.arange(1, batch.num_tokens), sharing)  # for tokens 1..N−1
    if keep is not None:
        inputs["logits_to_keep"] = keep.to(device)
    logits = model(**inputs).logits[0]
    never = _placeholder_ids(model)
    if never is not None:  # outside the support: −∞, as the engines sample
        logits = logits.index_fill(-1, never.to(logits.device), float("-inf"))
    if batch.num_tokens == 0:
        zero = logits.sum() * 0.0
        empty = zero.reshape(1)[:0].float()
        return (empty, empty.clone()) if with_entropy else empty
    labels = batch.input_ids.to(logits.device)
    if targets is not None:
        targets = targets.to(logits.device)
        selected = _zero_at_placeholders(
            never, logprobs_from_logits(logits, labels[targets], temperature=temperature), labels[targets]
        )
        logprobs = selected.new_zeros(batch.num_tokens).index_put((targets,), selected)
        if not with_entropy:
            return logprobs
        entropy = entropy_from_logits(logits, temperature=temperature)
        return logprobs, entropy.new_zeros(batch.num_tokens).index_put((targets,), entropy)
    if sharing is None:
        logits = logits[:-1]
    logprobs = _shift_to_tokens(
        _zero_at_placeholders(
            never, logprobs_from_logits(logits, labels[1:], temperature=temperature), labels[1:]
        ),
        batch.position_ids,
    )
    if not with_entropy:
        return logprobs
    entropy = _shift_to_tokens(entropy_from_logits(logits, temperature=temperature), batch.position_ids)
    return logprobs, entropy


def _load_routes(
    routing: MoERouting,
    batch: ExperienceBatch,
    sharing: SharedPrefix | None,
    sequence_parallel: SequenceParallelGroup | None,
) -> None:
    """Load `batch.routed_experts` of the forward's row into `routing` (None for an empty batch)."""
    if batch.num_tokens == 0:
        routing.load(None)
        return
    if batch.routed_experts is None:
        if routing.replay:
            raise ValueError(
                "router_replay R3: the batch has no routed_experts; the rollout engine must record them "
                "(rl_rollout's HFEngine(return_routed_experts=True), vLLM's enable_return_routed_experts)"
            )
        routing.load(None)
        return
    routing.load(row_routes(batch.routed_experts, row_tokens(batch.num_tokens, sharing, sequence_parallel)))


def _sequence_parallel_logprobs(
    model: Any,
    batch: ExperienceBatch,
    sharing: SharedPrefix | None,
    group: SequenceParallelGroup,
    temperature: float,
    with_entropy: bool,
    only_actions: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`packed_logprobs` on this rank's slice of the row: the K target tokens (action tokens, or
    every token but a sequence's first) whose preceding position lies in the slice are computed
    here, written into [K] zeros and summed over the group."""
    inputs = packed_model_inputs(model, batch, sharing=sharing, sequence_parallel=group)
    device = inputs["input_ids"].device
    row = batch.num_tokens if sharing is None else sharing.keep.numel()
    start, end = group.local_range(max(row, 1))
    positions = batch.position_ids.to(device)
    wanted = positions > 0
    if only_actions:
        wanted = wanted & batch.action_mask.to(device)
    targets = torch.nonzero(wanted, as_tuple=True)[0]
    before = _logits_before(targets, sharing)  # positions in the (compressed) row
    here = torch.nonzero((before >= start) & (before < end), as_tuple=True)[0]
    local = before[here] - start
    if _accepts_logits_to_keep(model):
        inputs["logits_to_keep"] = local
        logits = model(**inputs).logits[0]
    else:
        logits = model(**inputs).logits[0][local]
    labels = batch.input_ids.to(device)[targets[here]]
    count = targets.numel()

    def spread(selected: torch.Tensor) -> torch.Tensor:
        """[K_local] values of this rank's targets → [N] over the row (0 elsewhere), summed over the group."""
        gathered = sum_over_group(selected.new_zeros(count).index_put((here,), selected), group)
        full = gathered.new_zeros(batch.num_tokens).index_put((targets,), gathered)
        if batch.num_tokens == 0:  # connected to the dummy forward, as without SP
            full = full + logits.sum() * 0.0
        return full

    logprobs = spread(logprobs_from_logits(logits, labels, temperature=temperature))
    if not with_entropy:
        return logprobs
    return logprobs, spread(entropy_from_logits(logits, temperature=temperature))


def _accepts_logits_to_keep(model: Any) -> bool:
    """Whether the causal LM's forward takes `logits_to_keep` (transformers' LMs do; a peft wrapper
    passes it on to the model it wraps)."""
    module = unwrap_model(model)
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    return "logits_to_keep" in inspect.signature(base.forward).parameters


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


class RouterCapture:
    """Forward hooks on a mixture-of-experts model's routers: the router logits of every MoE
    layer during a forward, one [T, E] tensor per layer, in layer order (`logits`; cleared on entry).

    The routers are the modules transformers records as `router_logits` (`_can_record_outputs`
    of Mixtral, Qwen2-MoE, Qwen3-MoE, ...). Hooks instead of `output_router_logits=True`: that
    makes the model compute its own aux loss with the forward's `attention_mask`, and a packed
    forward's is a placeholder. In a packed row every token is real, so the T rows are exactly
    the batch's tokens (the compressed row's under prefix sharing: a shared prompt counts once).

    Raises ValueError for a model without such routers (a dense model).
    """

    def __init__(self, model: Any) -> None:
        from rl_data.routes import moe_routers

        module = unwrap_model(model)
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        spec = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
        self.index = int(getattr(spec, "index", 0) or 0)  # router_logits' place in the output
        try:
            self._routers, self.top_k = moe_routers(base)
        except ValueError as error:
            raise ValueError(f"{error}; the load-balancing loss needs an MoE model") from None
        self.logits: list[torch.Tensor] = []
        self._handles: list[Any] = []

    def _keep(self, _module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        logits = output[self.index] if isinstance(output, (tuple, list)) else output
        self.logits.append(logits.reshape(-1, logits.shape[-1]))

    def __enter__(self) -> RouterCapture:
        self.logits = []
        self._handles = [router.register_forward_hook(self._keep) for router in self._routers]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _per_position_scores(
    model: Any,
    batch: ExperienceBatch,
    share_prefix: bool = False,
    sequence_parallel: SequenceParallelGroup | None = None,
) -> torch.Tensor:
    """[N] output of the score head at every position (one dummy position for an empty batch).

    With `sequence_parallel` each rank scores its slice of the padded row; the slices are put in
    place in a zero row and summed over the group, and the padding is dropped."""
    module = unwrap_model(model)
    sharing = _sharing(batch, share_prefix)
    with _ScoreCapture(module) as capture:
        model(**packed_model_inputs(model, batch, sharing=sharing, sequence_parallel=sequence_parallel))
    assert capture.output is not None
    scores = capture.output[0, :, 0]
    if sequence_parallel is not None:
        row = max(batch.num_tokens if sharing is None else sharing.keep.numel(), 1)
        start, end = sequence_parallel.local_range(row)
        padded = sequence_parallel.padded_length(row)
        placed = torch.cat([scores.new_zeros(start), scores, scores.new_zeros(padded - end)])
        scores = sum_over_group(placed, sequence_parallel)[:row]
    if sharing is not None:
        scores = scores[sharing.own.to(scores.device)]
    return scores.double() if scores.dtype == torch.float64 else scores.float()


def packed_values(
    value_model: Any,
    batch: ExperienceBatch,
    *,
    share_prefix: bool = False,
    sequence_parallel: SequenceParallelGroup | None = None,
) -> torch.Tensor:
    """Critic values [N]: values[t] = score(h_{t−1}) = V(x_<t), 0 at each sequence's first token.

    float32 (float64 for a float64 model); gradients flow when grad mode is on. `share_prefix`,
    `sequence_parallel`: as in `packed_logprobs`, the same values.
    """
    scores = _per_position_scores(value_model, batch, share_prefix, sequence_parallel)
    if batch.num_tokens == 0:
        return scores[:0] + scores.sum() * 0.0
    return _shift_to_tokens(scores[:-1], batch.position_ids)


def packed_scores(
    reward_model: Any,
    batch: ExperienceBatch,
    *,
    share_prefix: bool = False,
    sequence_parallel: SequenceParallelGroup | None = None,
) -> torch.Tensor:
    """Reward-model scores [S]: the score head at the last token of each sequence.

    Equal to HF's `AutoModelForSequenceClassification` forward on the same sequences, right-padded,
    when no sequence ends with the pad token (HF reads the last non-pad token). `share_prefix`,
    `sequence_parallel`: as in `packed_logprobs`, the same scores.
    """
    scores = _per_position_scores(reward_model, batch, share_prefix, sequence_parallel)
    if batch.num_sequences == 0:
        return scores[:0] + scores.sum() * 0.0
    last = batch.cu_seqlens[1:].to(device=scores.device, dtype=torch.int64) - 1
    return scores[last]
