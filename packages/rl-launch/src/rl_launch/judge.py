"""The judge of a run (`reward.judge_pretrain`): a frozen model on an engine of its own, a reward source.

    rl-launch ppo --reward.judge_pretrain path/to/judge --reward.judge_parser score_tag \\
        --reward.judge_template judge.txt --reward.judge_engine vllm

`rl_launch.judge_worker.JudgeWorker` is a Ray actor of its own (the role "judge", resources `ray.judge`), started before
the rollout engines: it holds the judge's engine (`reward.judge_engine` from
`rl_launch.components.ENGINES`, options `reward.judge_engine_options` verbatim over the run's) and
answers `generate` calls. It is not a rollout engine: nothing syncs weights to it, puts it to sleep
or counts it among `rollout.num_engines`. Each rollout actor gets a judge's handle (engine i asks
judge i mod `ray.judge.num_actors`) and scores its samples with `rl_rollout.JudgeReward` over
`RemoteJudgeEngine`: the template is rendered and tokenized there with the judge's tokenizer, the
call has the deadline `reward.judge_timeout_s` and follows `reward.on_error`, so a dead or hung
judge costs the step its judge rewards (or stops the run), never hangs it. This module is the
rollout actors' side (`rl_launch.actors` imports it); the actor is `rl_launch.judge_worker`'s.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["RemoteJudgeEngine", "build_judge"]

_GRACE_S = 5.0
"""Seconds a judge call may outlive `reward.judge_timeout_s`: the reward's own deadline fires first
(a counted timeout), the thread it abandons ends at this one."""


class RemoteJudgeEngine:
    """The engine protocol's `generate` over a `JudgeWorker` handle, bounded by `timeout_s` (+ a
    grace): past it the request is cancelled and TimeoutError raised, so no thread waits forever."""

    name = "judge"

    def __init__(self, handle: Any, timeout_s: float) -> None:
        self.handle, self.timeout_s = handle, timeout_s

    def generate(self, prompts: list[list[int]], params: Any) -> list[list[Any]]:
        import ray

        future = self.handle.generate.remote([list(prompt) for prompt in prompts], params)
        try:
            return ray.get(future, timeout=self.timeout_s + _GRACE_S)
        except ray.exceptions.GetTimeoutError:
            with contextlib.suppress(Exception):  # best effort: a running call may not stop
                ray.cancel(future)
            raise TimeoutError(f"the judge did not answer within {self.timeout_s + _GRACE_S:g} s") from None


def build_judge(spec: Any, engine: Any) -> Any:
    """The reward source "judge": `rl_rollout.JudgeReward` over `engine` (a `RemoteJudgeEngine`, or
    any engine), with the judge's tokenizer, the `reward.judge_*` options, the deadline
    `reward.judge_timeout_s` and the policy `reward.on_error` / `reward.fallback`."""
    from transformers import AutoTokenizer

    from rl_rollout import JudgeReward

    reward = spec.reward
    return JudgeReward(
        engine,
        AutoTokenizer.from_pretrained(reward.judge_pretrain),
        reward.judge_template,
        parser=reward.judge_parser,
        max_new_tokens=reward.judge_max_new_tokens,
        chat_template=reward.judge_chat_template,
        scale=reward.judge_scale,
        timeout_s=reward.judge_timeout_s,
        on_error=reward.on_error,
        fallback=reward.fallback,
        name=f"reward.judge_pretrain {reward.judge_pretrain}",
    )
