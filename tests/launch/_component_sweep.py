"""One training step of every advantage estimator and policy loss name, on one set of actors.

Run by tests/launch/test_every_component.py as a script (it starts a local Ray in its own
process): `python _component_sweep.py MODEL PROMPTS REWARD RAY_DIR OUT.json` (REWARD: a reward
function file or name). The actors (policy,
critic, reference, a transformers engine) start once; each case builds its own config through the
CLI's resolver and `check_components`, then runs the launcher's own step pieces: generation
(`Rollouts`), experience (`PPOTrainer.make_experience`), training, weight sync. A case that
raises is recorded with its error, so one broken name does not hide the others.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import tempfile
import traceback


def case_overrides(kind: str, name: str) -> dict[str, str]:
    """The config of one case: the KL goes where the estimator can use it (β > 0 in every case,
    so the reference model's forward and both KL paths run)."""
    from rl_launch.components import estimator_needs

    estimator = name if kind == "estimator" else "grpo"
    overrides = {"algo.advantage.estimator": estimator, "algo.kl.init_kl_coef": "0.01"}
    if not estimator_needs(estimator).token_rewards:
        overrides["algo.kl.use_kl_loss"] = "true"
    if kind == "loss":
        overrides["algo.policy.loss"] = name
    return overrides


def main(model: str, prompts: str, reward: str, ray_dir: str, out: str) -> None:
    from transformers import AutoTokenizer

    from rl_algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
    from rl_data.datasets import PromptLoader
    from rl_launch.cli import resolve_ppo_config
    from rl_launch.cluster import start_ray
    from rl_launch.components import check_components
    from rl_launch.ppo import PPOTrainer
    from rl_launch.preflight import resolve_inputs
    from rl_launch.prompts import load_prompts
    from rl_launch.roles import Roles
    from rl_launch.rollouts import make_rollouts

    base = {
        "model.pretrain": model,
        "data.prompt_data": prompts,
        "reward.function": reward,
        "rollout.n_samples_per_prompt": "2",
        "rollout.rollout_batch_size": "4",
        "rollout.generate_max_len": "4",
        "train.actor_learning_rate": "1e-5",
        "train.zero_stage": "0",
        "ray.temp_dir": ray_dir,
        "rollout.engine": "hf",  # every case's step goes through it; it starts in a second
        "log.output_dir": tempfile.mkdtemp(),
    }
    config = resolve_ppo_config(None, {**base, **case_overrides("estimator", "gae")})  # critic + reference
    inputs = resolve_inputs(config, None)
    train_data, _ = load_prompts(config, inputs, AutoTokenizer.from_pretrained(inputs.model_path))
    loader = PromptLoader(train_data, batch_size=4, seed=0, shuffle=True)
    start_ray(config, temp_dir=ray_dir)
    roles = Roles(config)
    roles.start(inputs, log_dir=None, total_steps=100)
    roles.init_weight_sync()
    version, results = 0, {}
    cases = [("estimator", name) for name in ADVANTAGE_ESTIMATORS] + [
        ("loss", name) for name in POLICY_LOSSES
    ]
    try:
        for step, (kind, name) in enumerate(cases, start=1):
            try:
                case = resolve_ppo_config(None, {**base, **case_overrides(kind, name)})
                check_components(case)
                trainer = PPOTrainer(case, roles, make_rollouts(case, roles.engines, loader), None, None)
                trainer.version = version
                records, _ = trainer.rollouts.generate(step, trainer.version)
                batch, metrics = trainer.make_experience(records)
                metrics |= trainer.train(batch, step)
                metrics |= trainer.sync()
                version = trainer.version
                numbers = {key: value for key, value in metrics.items() if isinstance(value, float)}
                results[f"{kind}:{name}"] = {
                    "ok": True,
                    "finite": all(math.isfinite(value) for value in numbers.values()),
                    "policy_loss": metrics.get("policy/loss"),
                    "sync_match": metrics["health/sync_checksum_match"],
                    "samples": len(records),
                    "baseline": metrics.get("reward/greedy_baseline_mean"),
                    "advantages_abs_mean": metrics.get("advantages/abs_mean"),
                    "skipped": metrics.get("policy/skipped"),
                }
            except Exception:
                results[f"{kind}:{name}"] = {"ok": False, "error": traceback.format_exc()[-3000:]}
            print(kind, name, results[f"{kind}:{name}"].get("ok"), flush=True)
    finally:
        # Ray's processes: one worker per actor, none started idle (cluster._no_idle_workers)
        logs = pathlib.Path(ray_dir, "session_latest", "logs")
        results["_ray"] = {
            "actors": len(roles.actor_names()),
            "workers": len(list(logs.glob("python-core-worker-*.log"))),
        }
        with open(out, "w") as handle:
            json.dump(results, handle, indent=1)
        roles.shutdown()
        import ray

        ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:6])
