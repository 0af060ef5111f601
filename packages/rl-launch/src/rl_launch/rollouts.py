"""Generation for the step loop: the prompt stream, the engines' futures, DAPO filtering, eval.

`Rollouts.generate(step)` returns one step's records: `rollout.rollout_batch_size` prompts x
`rollout.n_samples_per_prompt` responses, scored by the reward next to each engine. In async
mode (`rollout.async_train`) the next step's generation is submitted before this step trains,
on the weights the engines hold now. With dynamic filtering, groups whose mean reward is
outside the range are dropped and more prompts are sampled (at most `max_sampling_rounds`).
Group ids count up across the run (evaluation does not consume them), so they are unique keys.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import msgspec

from rl_data import PromptSample, Trajectory, decode, encode
from rl_rollout import SamplingParams, filter_groups

from .actors import ActorGroup
from .components import estimator_takes
from .config import PPOConfig
from .evaluation import eval_metrics

__all__ = ["Rollouts", "rollout_metrics"]


def rollout_metrics(records: list[Trajectory]) -> dict[str, float]:
    """What the executors wrote into one step's records, as `rollout/...` metrics.

    Every step, with T_i = response tokens of record i and A_i = Σ its action_mask (the tokens
    the policy chose; the loss sees only these):
      rollout/action_tokens_mean = mean A_i,  rollout/env_tokens_mean = mean (T_i − A_i)
      (environment tokens of multi-turn episodes; 0 for single-turn responses),
      rollout/truncated = #records with finish reason "length" (a response, or an episode's last
      action, cut at rollout.generate_max_len; an episode ended by max_turns or max_length).
    When records carry them: rollout/turns_mean (mean extra["turns"]), rollout/episode_failures
    (#records with extra["episode_error"]: failed episodes kept with the fallback reward),
    rollout/reward_fallbacks (#records with extra["reward_fallback"]), and rollout/agent/<key> =
    the mean of each numeric entry of the agent's extra_logs (its last step's).
    """
    if not records:
        return {}
    count = len(records)
    actions = [float(record.action_mask.sum()) for record in records]
    lengths = [float(record.response_ids.numel()) for record in records]
    metrics = {
        "rollout/action_tokens_mean": sum(actions) / count,
        "rollout/env_tokens_mean": (sum(lengths) - sum(actions)) / count,
        "rollout/truncated": float(sum(record.finish_reason == "length" for record in records)),
    }
    turns = [record.extra["turns"] for record in records if "turns" in record.extra]
    if turns:
        metrics["rollout/turns_mean"] = sum(turns) / len(turns)
        metrics["rollout/episode_failures"] = float(sum("episode_error" in r.extra for r in records))
    if any("reward_fallback" in record.extra for record in records):
        metrics["rollout/reward_fallbacks"] = float(
            sum(bool(r.extra.get("reward_fallback")) for r in records)
        )
    agent: dict[str, list[float]] = {}
    for record in records:
        for key, value in (record.extra.get("extra_logs") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                agent.setdefault(f"rollout/agent/{key}", []).append(float(value))
    metrics |= {name: sum(values) / len(values) for name, values in agent.items()}
    return metrics


class Rollouts:
    """The engines of a run, fed from a prompt loader."""

    def __init__(self, config: PPOConfig, engines: ActorGroup, loader: Any) -> None:
        self.config = config
        self.engines = engines
        self.loader = loader
        self.batches: Iterator[list[PromptSample]] = iter(loader)
        self.next_group_id = 0
        self.pending: list | None = None  # async mode: the next step's generation, under way
        # ReMax: the reward of a greedy answer to each prompt is the baseline of its samples
        self.greedy_baseline = estimator_takes(config.algo.advantage.estimator, "baseline_rewards")

    def restart(self, data_state: Any, next_group_id: int) -> None:
        """Continue the prompt stream of a checkpoint."""
        self.loader.load_state_dict(data_state)
        self.batches = iter(self.loader)
        self.next_group_id = next_group_id

    def sampling(self, step: int) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(
            n=r.n_samples_per_prompt,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=max(r.top_k, 0),  # -1 (OpenRLHF) and 0 (ours) both mean off
            max_new_tokens=r.generate_max_len,
            seed=r.seed + step,
        )

    def submit(
        self, prompts: list[PromptSample], sampling: SamplingParams, *, for_training: bool = True
    ) -> list:
        """Split the prompts over the engines; futures of encoded records (with the greedy
        baseline's reward in each record when the estimator needs one and they are for training)."""
        size = math.ceil(len(prompts) / len(self.engines))
        futures = []
        for index, actor in enumerate(self.engines.actors):
            chunk = prompts[index * size : (index + 1) * size]
            if chunk:
                greedy = self.greedy_baseline and for_training
                futures.append(actor.generate.remote(encode(chunk), sampling, self.next_group_id, greedy))
                self.next_group_id += len(chunk)
        return futures

    @staticmethod
    def collect(futures: list) -> list[Trajectory]:
        import ray

        return [record for payload in ray.get(futures) for record in decode(payload, list[Trajectory])]

    def generate(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """The records of step `step` (DAPO-filtered if asked) and the filter's metrics."""
        r = self.config.rollout
        futures = self.pending or self.submit(next(self.batches), self.sampling(step))
        self.pending = None
        records = self.collect(futures)
        if r.async_train and step < self.config.train.max_steps:
            self.pending = self.submit(next(self.batches), self.sampling(step + 1))
        if not r.dynamic_filtering:
            return records, rollout_metrics(records)
        low, high = r.dynamic_filtering_reward_range
        kept, _ = filter_groups(records, low=low, high=high)
        seen = len(records) // r.n_samples_per_prompt
        for attempt in range(1, r.max_sampling_rounds):
            if len(kept) >= r.rollout_batch_size:
                break
            sampling = msgspec.structs.replace(self.sampling(step), seed=r.seed + step + 7919 * attempt)
            more = self.collect(self.submit(next(self.batches), sampling))
            kept += filter_groups(more, low=low, high=high)[0]
            seen += len(more) // r.n_samples_per_prompt
        if not kept:
            raise RuntimeError(
                f"dynamic filtering kept no group in {r.max_sampling_rounds} rounds (every group's mean reward "
                f"was outside {r.dynamic_filtering_reward_range}); widen rollout.dynamic_filtering_reward_range"
            )
        kept = kept[: r.rollout_batch_size]
        metrics = {"filter/groups_seen": float(seen), "filter/groups_kept": float(len(kept))}
        records = [record for group in kept for record in group]
        return records, metrics | rollout_metrics(records)

    def evaluate(self, data: Any) -> dict[str, float]:
        """Evaluation metrics on the evaluation prompts (`eval.*` sampling): mean reward and
        length, pass@k and mean@k for k = eval.n_samples_per_prompt > 1, per evaluation dataset
        when there are several (`rl_launch.evaluation`)."""
        cfg = self.config
        samples = [data[i] for i in range(len(data))]
        sampling = SamplingParams(
            n=cfg.eval.n_samples_per_prompt,
            temperature=cfg.eval.temperature,
            max_new_tokens=cfg.rollout.generate_max_len,
            seed=cfg.rollout.seed,
        )
        group_id = self.next_group_id
        records = self.collect(self.submit(samples, sampling, for_training=False))
        self.next_group_id = group_id  # evaluation does not consume group ids of the training stream
        return eval_metrics(
            records,
            k=cfg.eval.n_samples_per_prompt,
            threshold=cfg.eval.correct_threshold,
            labels=getattr(data, "labels", None),
        )
