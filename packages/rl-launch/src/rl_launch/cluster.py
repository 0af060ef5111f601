"""Ray for the launcher: start or join a cluster, check resources, place actor groups.

Every role (policy, critic, reference, distillation teacher, reward model, rollout engines, the
judge) is a group of Ray actors.
Roles are placed with placement groups, one bundle per actor: a role alone gets its own group;
colocated roles (`ray.colocate`) share one group and split each bundle's GPU between them, as
OpenRLHF's colocation flags do. In CPU mode bundles hold CPUs only.

The resource check runs before any actor starts: a request for more GPUs than the cluster has
fails at once with the numbers, instead of waiting forever for a placement that cannot happen.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from .config import ConfigError, PPOConfig
from .errors import ClusterError

__all__ = [
    "ClusterError",
    "RoleLayout",
    "colocation_groups",
    "forwarded_env",
    "place_roles",
    "plan_roles",
    "start_ray",
]

logger = logging.getLogger(__name__)


class RoleLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Where the actors of one role go: `num_actors` actors, each with these resources."""

    role: str
    num_actors: int
    num_gpus: float
    num_cpus: float
    group: str
    """Name of the placement group shared by the colocated roles."""


def colocation_groups(colocate: str) -> list[set[str]]:
    """Sets of roles sharing bundles for a `ray.colocate` value; roles not listed stand alone. The
    distillation teacher goes where the reference goes (both are frozen policy-shaped models that
    score the policy's samples)."""
    groups = {
        "none": [],
        "all": [{"policy", "ref", "teacher", "critic", "reward_model", "engine"}],
        "policy_ref": [{"policy", "ref", "teacher"}],
        "critic_reward": [{"critic", "reward_model"}],
        "policy_ref+critic_reward": [{"policy", "ref", "teacher"}, {"critic", "reward_model"}],
    }
    return groups[colocate]


def _roles(config: PPOConfig) -> dict[str, tuple[int, float, float]]:
    """role -> (actors, GPUs per actor, CPUs per actor) for the roles this run needs."""
    from .components.estimators import estimator_needs

    ray_cfg = config.ray
    roles = {"policy": ray_cfg.policy}
    if config.needs_reference:
        roles["ref"] = ray_cfg.ref
    if config.needs_teacher:
        roles["teacher"] = ray_cfg.teacher
    if estimator_needs(config.algo.advantage.estimator).critic:
        roles["critic"] = ray_cfg.critic
    if config.model.reward_pretrain is not None:
        roles["reward_model"] = ray_cfg.reward_model
    if config.reward.judge_pretrain is not None:
        roles["judge"] = ray_cfg.judge
    out = {name: (r.num_actors, r.num_gpus_per_actor, r.num_cpus_per_actor) for name, r in roles.items()}
    out["engine"] = (
        config.rollout.num_engines,
        float(config.rollout.tensor_parallel_size),
        ray_cfg.engine_num_cpus,
    )
    return out


def plan_roles(config: PPOConfig, *, use_gpus: bool) -> list[RoleLayout]:
    """The layout of every role; colocated roles share a group and split its GPUs.

    Colocated roles must have the same number of actors (one bundle per actor, shared); each
    role in a colocated set of k roles takes 1/k of a bundle's GPUs.
    """
    roles = _roles(config)
    layouts = []
    grouped = {}
    for members in colocation_groups(config.ray.colocate):
        present = sorted(members & roles.keys())
        if len(present) < 2:
            continue
        counts = {role: roles[role][0] for role in present}
        if len(set(counts.values())) != 1:
            raise ConfigError(
                f"ray.colocate: {config.ray.colocate!r} puts {', '.join(present)} on the same bundles, "
                f"so they need the same number of actors; got {counts}"
            )
        for role in present:
            grouped[role] = ("+".join(present), len(present))
    for role, (count, gpus, cpus) in roles.items():
        group, share = grouped.get(role, (role, 1))
        layouts.append(
            RoleLayout(
                role=role,
                num_actors=count,
                num_gpus=(gpus / share) if use_gpus else 0.0,
                num_cpus=cpus / share if share > 1 else cpus,
                group=group,
            )
        )
    return layouts


def _bundles(layouts: Sequence[RoleLayout]) -> dict[str, list[dict[str, float]]]:
    """Placement-group bundles per group name: the sum over its roles, one bundle per actor."""
    bundles: dict[str, list[dict[str, float]]] = {}
    for layout in layouts:
        rows = bundles.setdefault(layout.group, [{} for _ in range(layout.num_actors)])
        for row in rows:
            for key, value in (("CPU", layout.num_cpus), ("GPU", layout.num_gpus)):
                if value > 0:
                    row[key] = row.get(key, 0.0) + value
    return bundles


def _total(layouts: Sequence[RoleLayout], key: str) -> float:
    return sum(sum(row.get(key, 0.0) for row in rows) for rows in _bundles(layouts).values())


def start_ray(
    config: Any, *, temp_dir: str | None = None, layouts: Sequence[RoleLayout] | None = None
) -> bool:
    """Join `ray.address` or start a local Ray bound to 127.0.0.1; True when this call started it.

    A local Ray gets enough logical CPUs for every actor of `layouts` (None: a ppo run's,
    `plan_roles(config)`; `ray.num_cpus` overrides): on a laptop the actors share the cores,
    Ray's CPU count only decides what may be placed.
    """
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": forwarded_env(os.environ)}
    if config.ray.address is not None:
        try:
            ray.init(address=config.ray.address, runtime_env=runtime_env, log_to_driver=True)
        except ConnectionError as error:  # an address nothing answers at, or a refused token
            cause = str(error.__cause__ or "").strip().splitlines()[:1]
            raise ClusterError(
                f"ray.address {config.ray.address}: could not join a Ray cluster there ({error}"
                f"{': ' + cause[0] if cause else ''}); check the address (`ray status` on the head "
                "node prints it) and, with token authentication, RAY_AUTH_MODE=token and the "
                "cluster's token (RAY_AUTH_TOKEN)"
            ) from None
        return True
    _keep_auth_token_in_memory()
    _no_idle_workers()
    num_cpus = config.ray.num_cpus
    if num_cpus is None:
        num_cpus = max(
            os.cpu_count() or 1,
            int(_total(plan_roles(config, use_gpus=False) if layouts is None else layouts, "CPU") + 0.999)
            + 1,
        )
    ray.init(
        address="local",
        num_cpus=num_cpus,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        _temp_dir=temp_dir,
        runtime_env=runtime_env,
        log_to_driver=True,
        logging_level=logging.WARNING,  # no INFO lines about the local instance on the console
    )
    return True


def _no_idle_workers() -> None:
    """A local cluster starts no Python workers before an actor asks for one.

    Ray's raylet starts idle workers when the first driver connects, to hand out to tasks. Our
    actors never take them (each actor gets a worker of its own, started for it): on the 2-core
    machine a tiny run's local cluster started 8 worker processes where 4 were used, and the
    idle ones (an `import ray` each) slowed the start-up of the actors they competed with (a
    tiny run 29-31 s against 25.6 s, wall, at a load of ~2). Set in the environment the raylet
    inherits; a value the user set is kept.
    """
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")


def _keep_auth_token_in_memory() -> None:
    """Token authentication for the local cluster without a token file in the home folder.

    Ray 2.60 turns token authentication on for a local cluster and, finding no token, writes a
    new one to ~/.ray/auth_token. Unless the user configured authentication (RAY_AUTH_MODE,
    RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH), the run hands Ray a fresh random token through the
    environment instead (Ray's processes inherit it), so nothing is written outside the run.
    """
    if any(name in os.environ for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        return
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    # Ray then says at WARNING that it turned token authentication on, which it does by default
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


# Settings the actors must see as the driver does (Ray workers do not inherit every variable).
_FORWARDED_ENV = (
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "HF_HOME",
    "TOKENIZERS_PARALLELISM",
    "DS_ACCELERATOR",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "PYTHONPATH",
    "CUDA_DEVICE_MAX_CONNECTIONS",
)


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `_FORWARDED_ENV` that `environ` sets, for the job's runtime environment,
    less those the submitted job's own runtime environment sets already.

    Under `ray job submit` the entrypoint's environment holds the job's `env_vars` and its job
    config (RAY_JOB_CONFIG_JSON_ENV_VAR); `ray.init` refuses a runtime environment that names one
    of the job's variables again (even with the same value). Those reach every actor through the
    job, with the values this process sees.
    """
    job_vars: set[str] = set()
    job_config = environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if job_config:
        try:
            job_vars = set((json.loads(job_config).get("runtime_env") or {}).get("env_vars") or {})
        except (ValueError, AttributeError) as error:
            raise ClusterError(
                f"RAY_JOB_CONFIG_JSON_ENV_VAR is not the JSON job config Ray writes: {error}"
            ) from None
    return {name: value for name, value in environ.items() if name in _FORWARDED_ENV and name not in job_vars}


def cluster_has_gpus() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0.0) > 0


def place_roles(layouts: Sequence[RoleLayout], *, timeout_s: float) -> dict[str, Any]:
    """Create one placement group per group name after checking the cluster can hold them all.

    Returns group name -> ready `PlacementGroup`. Raises `ClusterError` naming the resource,
    what the run asks for and what the cluster has, or the group that could not be placed.
    """
    import ray
    from ray.util.placement_group import placement_group

    available = ray.cluster_resources()
    for key in ("GPU", "CPU"):
        wanted = _total(layouts, key)
        have = available.get(key, 0.0)
        if wanted > have + 1e-9:
            detail = ", ".join(
                f"{layout.role}: {layout.num_actors} x {getattr(layout, 'num_' + key.lower() + 's'):g}"
                for layout in layouts
                if getattr(layout, "num_" + key.lower() + "s") > 0
            )
            raise ClusterError(
                f"the run needs {wanted:g} {key}s ({detail}) but the Ray cluster has {have:g}; "
                f"lower ray.<role>.num_actors / num_{key.lower()}s_per_actor, rollout.num_engines or "
                "rollout.tensor_parallel_size, or colocate roles with ray.colocate"
            )
    groups = {}
    try:
        for name, bundles in _bundles(layouts).items():
            # A bundle may not be empty: a CPU-less, GPU-less role still takes a sliver of CPU.
            bundles = [row or {"CPU": 0.001} for row in bundles]
            groups[name] = placement_group(bundles, strategy="PACK", name=f"rl-launch-{name}-{os.getpid()}")
        for name, group in groups.items():
            ready, _ = ray.wait([group.ready()], timeout=timeout_s)
            if not ready:
                raise ClusterError(
                    f"placement group {name!r} ({_bundles(layouts)[name]}) was not placed within "
                    f"{timeout_s:g} s (ray.startup_timeout_s); the cluster has {available}"
                )
    except BaseException:
        for group in groups.values():
            ray.util.remove_placement_group(group)
        raise
    return groups
