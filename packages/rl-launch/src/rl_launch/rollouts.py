"""Generation for the step loop: the prompt stream, the engines' futures, DAPO filtering, eval.

`make_rollouts(config, engines, loader)` gives the rollouts of the run's mode (`rollout_mode`):
`SyncRollouts`, `AsyncRollouts` (whole steps ahead) or `StreamingRollouts` (a pool of groups),
over a `Rollouts` base that holds what they share (sampling, the engines' calls and their stall
deadlines, evaluation, the prompt stream's resume). `generate(step, version)` returns one step's
records: `rollout.rollout_batch_size` prompts x `rollout.n_samples_per_prompt` responses, scored
by the reward next to each engine. In every mode a finished group is trained on only when
`group_verdict` accepts it: not staler than `rollout.max_staleness` (async modes), its mean
reward inside the range under dynamic filtering.

Async mode (`rollout.async_train`, depth d = `rollout.async_depth`): once step t's records are
in, the generations of steps t+1 ... t+d are in flight, submitted on the weights the engines hold
then. An engine serves its calls in order, so the weights of step t's sync reach it after the
generations queued before them: in steady state a record is exactly d policy versions behind
the learner that trains on it. `rollout.max_staleness` drops records further behind than that
(whole groups: a group comes from one engine call). The steps in flight are part of a
checkpoint (`in_flight()`: step, first group id, dataset indices), and `restart` submits them
again on the restored weights, with the same seeds and group ids, so a resumed run trains on the
prompts an uninterrupted one would.

With dynamic filtering, groups whose mean reward is outside the range are dropped and more
prompts are sampled (at most `max_sampling_rounds`). Every round draws `rollout.prompts_per_round`
prompts (`rollout.generate_batch_size`, oversampling; else rollout_batch_size). The groups a
round accepts are kept while later rounds draw more (never dropped for a replacement); the step
takes the first rollout_batch_size accepted groups in stream order and drops the rest
(filter/groups_surplus). OpenRLHF instead keeps the surplus in a buffer for its next steps
(async only); here each step's records come from its own rounds, so a checkpoint needs no buffer.
Group ids count up across the run (evaluation does not consume them), so they are unique keys.

Streaming (`rollout.streaming`, with async_train): no step owns a generation call. The driver
keeps a pool of groups in flight (`StreamGroup`: one prompt, one `generate` call in the engines'
`GENERATE_GROUP`, on the engine with the fewest groups of the pool, sampler seed rollout.seed +
group id), drawn from the prompt stream in rounds of prompts_per_round prompts until the pool
holds (async_depth + 1) x prompts_per_round groups (fewer near the end: never more than the
remaining steps can train). A step takes finished groups (`ray.wait` over the pool in stream
order, which keeps that order) until it has rollout_batch_size of them, dropping those further behind than
max_staleness and, under dynamic filtering, those outside the reward range; when the pool runs
dry it draws another round (at most max_sampling_rounds − 1 per step). The groups it does not
take stay in flight for the next steps, then the pool is topped up. A checkpoint keeps every
group not yet trained (`in_flight()`: group id and dataset index each) and `restart` submits
them again with their group ids and seeds: a resumed run loses no prompt and trains none twice.
Which step takes which group depends on the order the engines finish, which is not reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from rl_data import PromptSample, Trajectory, decode, encode
from rl_rollout import SamplingParams, filter_groups, groups_in_order, tool_metrics

from .actors import ACTIVITY_GROUP, CALL_COUNTERS, GENERATE_GROUP, ActorGroup
from .components import estimator_needs
from .config import PPOConfig
from .evaluation import eval_metrics
from .health import EngineHung

__all__ = [
    "AsyncRollouts",
    "InFlight",
    "Rollouts",
    "StreamGroup",
    "StreamingRollouts",
    "SyncRollouts",
    "completion_rows",
    "drop_stale",
    "group_verdict",
    "make_rollouts",
    "rollout_metrics",
    "rollout_mode",
]


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
    rollout/episode_timeouts (those of them that the episode timeout ended, extra["episode_timeout"]),
    rollout/reward_fallbacks (#records with extra["reward_fallback"]), and rollout/agent/<key> =
    the mean of each numeric entry of the agent's extra_logs (its last step's). Records of
    tool-calling episodes (extra["tools"]) add `rl_rollout.tool_metrics`: rollout/tools/calls_mean,
    call_rate, limit_reached and errors/<kind>. The executors' counts of each generate call that
    no record carries (`rl_launch.actors.CALL_COUNTERS`: the agent server's refusals
    rollout/server_busy and rollout/server_unauthorized, rollout/loop_blocked), summed over the
    step's calls. Always `fallback_metrics`: reward/fallbacks, reward/fallback_fraction,
    reward/timeouts, reward/fallbacks/<source>.
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
        if any("episode_timeout" in r.extra for r in records):  # of those, ended by the episode timeout
            metrics["rollout/episode_timeouts"] = float(sum("episode_timeout" in r.extra for r in records))
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
    for record in records:
        for key, value in (record.extra.get("call_counters") or {}).items():
            if key in CALL_COUNTERS:
                metrics[key] = metrics.get(key, 0.0) + float(value)
    return metrics | tool_metrics(records) | fallback_metrics(records)


def fallback_sources(record: Trajectory) -> list[str]:
    """Why `record`'s reward is a fallback: the reward sources that failed on it (`function`,
    `remote_0`, ...; "reward" when the executor says so without naming one) and "episode" for a
    failed episode (multi-turn, tool-calling, agent executors); [] when its reward is its own."""
    extra = record.extra
    sources = list(extra.get("reward_fallback_sources") or [])
    if not sources and extra.get("reward_fallback"):
        sources.append("reward")
    if "episode_error" in extra:
        sources.append("episode")
    return sources


def fallback_metrics(records: list[Trajectory]) -> dict[str, float]:
    """reward/fallbacks (#records whose reward is a fallback), reward/fallback_fraction (their
    share: `health.max_fallback_fraction` stops a run that trains on them), reward/timeouts
    (#records a reward source timed out on) and reward/fallbacks/<source> per failing source."""
    if not records:
        return {}
    counts: dict[str, int] = {}
    fell_back = 0
    for record in records:
        sources = fallback_sources(record)
        fell_back += bool(sources)
        for source in sources:
            counts[source] = counts.get(source, 0) + 1
    metrics = {
        "reward/fallbacks": float(fell_back),
        "reward/fallback_fraction": fell_back / len(records),
        "reward/timeouts": float(sum(bool(r.extra.get("reward_timeout_sources")) for r in records)),
    }
    return metrics | {f"reward/fallbacks/{source}": float(count) for source, count in sorted(counts.items())}


@dataclass
class InFlight:
    """One step's generation under way (async mode): what a checkpoint needs to submit it again."""

    step: int
    group_id: int  # the first group id its prompts got
    indices: list[int]  # the prompts' positions in the training dataset (PromptSample.index)
    futures: list


@dataclass
class StreamGroup:
    """One group of a streaming run's pool: submitted, not yet trained."""

    group_id: int
    index: int  # the prompt's position in the training dataset (PromptSample.index)
    engine: int  # the engine generating it
    future: Any


def completion_rows(records: list[Trajectory], tokenizer: Any) -> list[dict[str, Any]]:
    """`log.completions` rows: what a record was asked and answered, how it scored, where its
    prompt came from (dataset source, row, index) and which policy versions wrote it (its first
    token's and its last token's: they differ when a weight sync landed mid-response), and each
    reward source's own reward of it (`reward_sources`: {"function": ..., "judge": ...})."""
    rows = []
    for record in records:
        sources = record.extra.get("reward_sources", {})
        rows.append(
            {
                "prompt": tokenizer.decode(record.prompt_ids.tolist()),
                "response": tokenizer.decode(record.response_ids.tolist()),
                "reward": float(record.reward),
                "finish_reason": record.finish_reason,
                "source": record.extra.get("source", ""),
                "row": int(record.extra.get("row", -1)),
                "index": int(record.extra.get("sample_index", -1)),
                "group_id": int(record.group_id),
                "policy_version": int(record.policy_version),
                "last_policy_version": int(record.versions()[-1])
                if record.response_ids.numel()
                else int(record.policy_version),
                **({"reward_sources": dict(sources)} if sources else {}),
            }
        )
    return rows


def drop_stale(
    records: list[Trajectory], version: int, max_staleness: int | None
) -> tuple[list[Trajectory], dict[str, float]]:
    """Keep the records at most `max_staleness` policy versions behind `version` (all when None).

    staleness_i = version − record_i.policy_version (its first token's version: the oldest
    weights that wrote any of it). Metrics: async/staleness_max (over the records generated),
    async/dropped_stale (#records dropped), and per action token t (partial rollout mixes
    versions within a response; `Trajectory.versions()`): async/token_staleness_mean and
    async/token_staleness_max of version − version_t over the records generated, and
    async/mixed_version_records (#records whose tokens come from more than one version).
    Dropping nothing is the rule: a steady async run is at most async_depth behind and config
    requires max_staleness >= depth.
    """
    staleness = [version - record.policy_version for record in records]
    kept = [record for record in records if not _too_stale(record, version, max_staleness)]
    token_lags = [version - record.versions()[record.action_mask] for record in records]
    actions = sum(int(lags.numel()) for lags in token_lags)
    metrics = {
        "async/staleness_max": float(max(staleness, default=0)),
        "async/dropped_stale": float(len(records) - len(kept)),
        "async/token_staleness_mean": float(sum(int(lags.sum()) for lags in token_lags)) / max(actions, 1),
        "async/token_staleness_max": float(
            max((int(lags.max()) for lags in token_lags if lags.numel()), default=0)
        ),
        "async/mixed_version_records": float(
            sum(
                r.token_versions is not None and int(r.token_versions[0]) != int(r.token_versions[-1])
                for r in records
            )
        ),
    }
    if records and not kept:
        raise RuntimeError(_every_record_stale(records, version, max_staleness))
    return kept, metrics


def _too_stale(record: Trajectory, version: int, max_staleness: int | None) -> bool:
    """Whether `record` is more than `max_staleness` policy versions behind `version` (never, None)."""
    return max_staleness is not None and version - record.policy_version > max_staleness


def _every_record_stale(records: Sequence[Trajectory], version: int, max_staleness: int | None) -> str:
    staleness = [version - record.policy_version for record in records]
    return (
        f"rollout.max_staleness = {max_staleness}: every record of this step was dropped (they are "
        f"{min(staleness)}-{max(staleness)} versions behind the learner's {version}); an engine "
        "has fallen behind the weight sync"
    )


def group_verdict(records: Sequence[Trajectory], version: int, rollout: Any) -> str | None:
    """The one rule a finished group passes to be trained on, in every rollout mode: "stale"
    when the run is async (`rollout.async_train`) and a record of it is more than
    `rollout.max_staleness` policy versions behind the learner's `version`, "filtered" under
    dynamic filtering when its mean reward is outside `rollout.dynamic_filtering_reward_range`
    (`rl_rollout.filter_groups`), None when it is accepted."""
    if rollout.async_train and any(_too_stale(record, version, rollout.max_staleness) for record in records):
        return "stale"
    if rollout.dynamic_filtering:
        low, high = rollout.dynamic_filtering_reward_range
        if not filter_groups(list(records), low=low, high=high)[0]:
            return "filtered"
    return None


def rollout_mode(config: PPOConfig) -> str:
    """ "sync", "async" (whole steps ahead, `rollout.async_train`) or "streaming" (`rollout.streaming`)."""
    r = config.rollout
    return "streaming" if r.streaming else "async" if r.async_train else "sync"


def make_rollouts(config: PPOConfig, engines: ActorGroup, loader: Any) -> Rollouts:
    """The rollouts of `config`'s mode (`rollout_mode`): `SyncRollouts`, `AsyncRollouts` or
    `StreamingRollouts`, over `engines` (the run's `EngineSupervisor` or `ActorGroup`)."""
    modes: dict[str, type[Rollouts]] = {
        "sync": SyncRollouts,
        "async": AsyncRollouts,
        "streaming": StreamingRollouts,
    }
    return modes[rollout_mode(config)](config, engines, loader)


class Rollouts:
    """The engines of a run, fed from a prompt loader: what every mode shares (sampling, the
    engines' calls and their stall deadlines, evaluation, the resume of the prompt stream). A mode
    says how a step's records are generated (`generate`), what a checkpoint keeps of what is in
    flight (`in_flight`) and how it is submitted again (`_resubmit`); `make_rollouts` picks it."""

    def __init__(self, config: PPOConfig, engines: ActorGroup, loader: Any) -> None:
        self.config = config
        self.engines = engines
        self.loader = loader
        self.batches: Iterator[list[PromptSample]] = iter(loader)
        self.next_group_id = 0
        # a generation call that stalls past health.engine_stall_warn_s: a line to `notify`
        self.notify: Callable[[str], None] | None = None
        self.log_dir: str | None = None
        self._engine_of: dict[int, int] = {}  # id(future) -> engine index, while it is pending
        # ReMax: the reward of a greedy answer to each prompt is the baseline of its samples
        self.greedy_baseline = estimator_needs(config.algo.advantage.estimator).greedy_baseline

    def generate(self, step: int, version: int) -> tuple[list[Trajectory], dict[str, float]]:
        """The records of step `step` for the learner at policy version `version`, and metrics."""
        raise NotImplementedError

    def in_flight(self) -> list[dict[str, Any]]:
        """What is under way, for a checkpoint (`restart` submits it again)."""
        return []

    def restart(
        self, data_state: Any, next_group_id: int, in_flight: Sequence[Mapping[str, Any]] = ()
    ) -> None:
        """Continue the prompt stream of a checkpoint: submit what it had in flight again (on the
        weights the engines hold now, with their seeds and group ids), then go on drawing. A
        streaming run takes a whole-step checkpoint's steps as groups; the reverse is refused."""
        self.loader.load_state_dict(data_state)
        self.batches = iter(self.loader)
        for entry in in_flight:
            self._resubmit(entry)
        self.next_group_id = next_group_id

    def _resubmit(self, entry: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def sampling(self, step: int) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(
            n=r.n_samples_per_prompt,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=max(r.top_k, 0),  # -1 (OpenRLHF) and 0 (ours) both mean off
            max_new_tokens=r.generate_max_len,
            seed=r.seed + step,
            min_new_tokens=r.min_new_tokens,
        )

    def engine_activity(self) -> dict[str, float]:
        """time/engine_idle_fraction: Σ idle / Σ wall over the engines since the last call
        (time with no generate call in flight; `rl_launch.actors.EngineActivity`)."""
        windows = self.engines.get(self.engines.submit("activity", concurrency_group=ACTIVITY_GROUP))
        wall = sum(wall for _, wall in windows)
        return {"time/engine_idle_fraction": sum(idle for idle, _ in windows) / wall} if wall > 0 else {}

    def submit(
        self, prompts: list[PromptSample], sampling: SamplingParams, *, for_training: bool = True
    ) -> list:
        """Split the prompts over the engines; futures of encoded records (with the greedy
        baseline's reward in each record when the estimator needs one and they are for training)."""
        size = math.ceil(len(prompts) / len(self.engines))
        futures = []
        for index in range(len(self.engines)):
            chunk = prompts[index * size : (index + 1) * size]
            if chunk:
                greedy = self.greedy_baseline and for_training
                futures.append(
                    self.engines.submit_to(
                        index, "generate", encode(chunk), sampling, self.next_group_id, greedy
                    )
                )
                self._engine_of[id(futures[-1])] = index
                self.next_group_id += len(chunk)
        return futures

    def collect(self, futures: list) -> list[Trajectory]:
        """The records of generation `futures`; a line to `notify` every
        `health.engine_stall_warn_s` seconds they keep the driver waiting, and once they have kept
        it `health.engine_stall_stop_s`, the engines they wait on are restarted as hung (their
        calls issued again, `rollout.engine_restarts`) or, with no restart left, `EngineHung`
        (the run stops, naming the engines)."""
        every = self._wait_slice()
        if every is not None:
            waited, pending = 0.0, list(futures)
            while pending:
                pending = self._still_running(pending, len(pending), every)
                if pending:
                    waited += every
                    if self._stalled(pending, waited):
                        waited = 0.0  # the restarted engines' calls: a new deadline
        try:
            # the engines' `get`: with `rl_launch.supervisor`, a dead engine's calls are issued again
            return [
                record
                for payload in self.engines.get(futures)
                for record in decode(payload, list[Trajectory])
            ]
        finally:
            for future in futures:
                self._engine_of.pop(id(future), None)

    def _wait_slice(self) -> float | None:
        """How long one `ray.wait` may block: the warning period (when a line has somewhere to
        go) or less, so that the stop deadline is seen on time; None: wait without a bound."""
        health = self.config.health
        warn = health.engine_stall_warn_s if self.notify is not None else None
        stop = health.engine_stall_stop_s
        slices = [value for value in (warn, stop) if value is not None]
        return min(slices) if slices else None

    def _current(self, future: Any) -> Any:
        """The call standing for generation `future` now: a restarted engine's re-issued call
        (`EngineSupervisor.current`), else `future` itself."""
        current = getattr(self.engines, "current", None)
        return current(future) if current is not None else future

    def _still_running(self, futures: list, num_returns: int, timeout: float | None) -> list:
        """`ray.wait` on the calls standing for `futures` now (never on a hung engine's abandoned
        call); the ones of `futures` it did not return (still running, or beyond `num_returns`),
        in their order."""
        import ray

        current = [self._current(future) for future in futures]
        _, running = ray.wait(current, num_returns=num_returns, timeout=timeout)
        still = {id(call) for call in running}
        return [future for future, call in zip(futures, current) if id(call) in still]

    def _stalled(self, pending: list, waited: float) -> bool:
        """`waited` seconds on `pending`: a warning line each warning period (when it falls due); at
        `health.engine_stall_stop_s` the engines of `pending` are restarted as hung (True: their
        calls were issued again) or, when `rollout.engine_restarts` cannot cover them, `EngineHung`."""
        health = self.config.health
        stop = health.engine_stall_stop_s
        if stop is not None and waited >= stop - 1e-9:
            self._restart_hung(pending, waited)
            return True
        warn = health.engine_stall_warn_s
        if warn is not None and self.notify is not None:
            due = math.floor(waited / warn + 1e-9) > math.floor((waited - self._wait_slice()) / warn + 1e-9)
            if due:
                self.notify(self.stall_line(pending, waited))
        return False

    def _restart_hung(self, pending: list, waited: float) -> None:
        """The engines `pending` waited `waited` s on are hung: each is killed, restarted, given the
        current weights and asked its calls again (`EngineSupervisor.restart`); `EngineHung` when
        the restarts left (`rollout.engine_restarts`) cannot cover them all."""
        stop = self.config.health.engine_stall_stop_s
        engines = sorted({self._engine_of.get(id(future), -1) for future in pending})
        left = getattr(self.engines, "restarts_left", 0)
        limit = self.config.rollout.engine_restarts
        if -1 in engines or len(engines) > left:
            spent = (
                f"rollout.engine_restarts = {limit} restarts are spent"
                if limit
                else "rollout.engine_restarts is 0 (a hung engine is not restarted)"
            )
            what = f"no generation answer for {waited:g} s (health.engine_stall_stop_s = {stop:g})"
            raise EngineHung(
                [index for index in engines if index >= 0],
                what,
                message=f"{self.stall_line(pending, waited, option='engine_stall_stop_s')}: the run stops, as a step "
                "whose generation never ends would hold it forever (a hung engine, a reward or an environment "
                f"that never returns; see that log), and {spent}. Raise rollout.engine_restarts to restart "
                "hung engines more often, or health.engine_stall_stop_s (or set it to none) when a step's "
                "generation legitimately takes longer",
            )
        for index in engines:
            self.engines.restart(
                index, f"hung: no generation answer for {waited:g} s (health.engine_stall_stop_s = {stop:g})"
            )

    def stall_line(self, pending: list, waited: float, option: str = "engine_stall_warn_s") -> str:
        """ "generation has waited 120 s on engine-0 ...; the last line of its log: ..." """
        from .diagnosis import log_tail

        engines = sorted({self._engine_of.get(id(future), -1) for future in pending})
        names = ", ".join(f"engine-{index}" if index >= 0 else "an engine" for index in engines)
        limit = getattr(self.config.health, option)
        head = "warning: generation has" if option == "engine_stall_warn_s" else "generation has"
        line = f"{head} waited {waited:g} s on {names} (health.{option} = {limit:g})"
        if self.log_dir is not None and engines and engines[0] >= 0:
            path = Path(self.log_dir).resolve() / f"engine-{engines[0]}.log"
            last = log_tail(path, 1)
            line += f"; last line of {path}: {last[0] if last else '(empty)'}"
        return line

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


class SyncRollouts(Rollouts):
    """Sync mode (and the base of async): a step's prompts are submitted when the step asks for
    them, or were before (a checkpoint's steps in flight, submitted again on resume; async mode's
    steps ahead), and its groups pass `group_verdict`; under dynamic filtering more rounds are
    drawn until rollout_batch_size groups pass (at most rollout.max_sampling_rounds)."""

    def __init__(self, config: PPOConfig, engines: ActorGroup, loader: Any) -> None:
        super().__init__(config, engines, loader)
        self.pending: dict[int, InFlight] = {}  # steps submitted before they are asked for, by step

    def in_flight(self) -> list[dict[str, Any]]:
        """The steps under way [{step, group_id, indices}], oldest first."""
        return [
            {"step": entry.step, "group_id": entry.group_id, "indices": entry.indices}
            for entry in self.pending.values()
        ]

    def _resubmit(self, entry: Mapping[str, Any]) -> None:
        if "step" not in entry:
            raise ValueError(
                "the checkpoint was written with rollout.streaming true (its in-flight entries are groups, "
                "not steps); resume it with --rollout.streaming true"
            )
        self.next_group_id = int(entry["group_id"])
        prompts = [self.loader.dataset[int(index)] for index in entry["indices"]]
        self.pending[int(entry["step"])] = self.submit_step(int(entry["step"]), prompts)

    def submit_step(self, step: int, prompts: list[PromptSample]) -> InFlight:
        """Submit the generation of step `step`'s batch."""
        group_id = self.next_group_id
        futures = self.submit(prompts, self.sampling(step))
        return InFlight(step, group_id, [sample.index for sample in prompts], futures)

    def generate(self, step: int, version: int) -> tuple[list[Trajectory], dict[str, float]]:
        """The records of step `step` for the learner at policy version `version`: the groups of
        its generation that `group_verdict` accepts (DAPO-filtered if asked; async: none staler
        than `rollout.max_staleness`), and metrics."""
        entry = self.pending.pop(step, None) or self.submit_step(step, next(self.batches))
        records = self.collect(entry.futures)
        self._submit_ahead(step)
        groups = groups_in_order(records)
        verdicts = {
            group_id: group_verdict(members, version, self.config.rollout)
            for group_id, members in groups.items()
        }
        stale = [record for record in records if verdicts[record.group_id] == "stale"]
        metrics = self._staleness(records, stale, version)
        if not self.config.rollout.dynamic_filtering:
            records = [record for record in records if verdicts[record.group_id] is None]
            return records, metrics | rollout_metrics(records)
        accepted = [members for group_id, members in groups.items() if verdicts[group_id] is None]
        fresh = sum(verdict != "stale" for verdict in verdicts.values())  # an episode may be several records
        records, filtered = self._filled(step, version, accepted, fresh)
        return records, metrics | filtered | rollout_metrics(records)

    def _submit_ahead(self, step: int) -> None:
        """Async mode submits the steps after `step` here; sync mode waits to be asked."""

    def _staleness(
        self, records: list[Trajectory], stale: list[Trajectory], version: int
    ) -> dict[str, float]:
        """Async mode's async/* metrics of a step's records (`stale`: those of stale groups); none in sync mode."""
        return {}

    def _filled(
        self, step: int, version: int, accepted: list[list[Trajectory]], seen: int
    ) -> tuple[list[Trajectory], dict[str, float]]:
        """Dynamic filtering: the step's `accepted` groups (of `seen` that were not stale), topped
        up by rounds drawn after it until rollout_batch_size groups pass (at most
        max_sampling_rounds in all), the first rollout_batch_size of them in stream order;
        filter/* metrics."""
        r = self.config.rollout
        kept = list(accepted)
        for attempt in range(1, r.max_sampling_rounds):
            if len(kept) >= r.rollout_batch_size:
                break
            sampling = msgspec.structs.replace(self.sampling(step), seed=r.seed + step + 7919 * attempt)
            more = groups_in_order(self.collect(self.submit(next(self.batches), sampling)))
            kept += [members for members in more.values() if group_verdict(members, version, r) is None]
            seen += len(more)
        if not kept:
            raise RuntimeError(
                f"dynamic filtering kept no group in {r.max_sampling_rounds} rounds (every group's mean reward "
                f"was outside {r.dynamic_filtering_reward_range}); widen rollout.dynamic_filtering_reward_range"
            )
        surplus = max(len(kept) - r.rollout_batch_size, 0)
        kept = kept[: r.rollout_batch_size]
        metrics = {
            "filter/groups_seen": float(seen),
            "filter/groups_kept": float(len(kept)),
            "filter/groups_surplus": float(surplus),
        }
        return [record for group in kept for record in group], metrics


class AsyncRollouts(SyncRollouts):
    """Async mode (`rollout.async_train`): once step t's records are in, the generations of steps
    t+1 ... t+async_depth are in flight; a step's groups staler than rollout.max_staleness are
    dropped (`group_verdict`), with the async/* staleness metrics of `drop_stale`."""

    def _submit_ahead(self, step: int) -> None:
        last = min(step + self.config.rollout.async_depth, self.config.train.max_steps)
        for ahead in range(step + 1, last + 1):
            if ahead not in self.pending:
                self.pending[ahead] = self.submit_step(ahead, next(self.batches))

    def _staleness(
        self, records: list[Trajectory], stale: list[Trajectory], version: int
    ) -> dict[str, float]:
        _, metrics = drop_stale(records, version, None)
        if records and len(stale) == len(records):
            raise RuntimeError(_every_record_stale(records, version, self.config.rollout.max_staleness))
        return metrics | {"async/dropped_stale": float(len(stale))}


class StreamingRollouts(Rollouts):
    """Streaming (`rollout.streaming`): a pool of groups in flight, each its own engine call; a step
    takes the first rollout_batch_size finished groups that `group_verdict` accepts."""

    def __init__(self, config: PPOConfig, engines: ActorGroup, loader: Any) -> None:
        super().__init__(config, engines, loader)
        self.pool: dict[int, StreamGroup] = {}  # the groups not yet trained, by group id (in stream order)

    def in_flight(self) -> list[dict[str, Any]]:
        """The groups not yet trained [{group_id, indices: [index]}], in stream order."""
        return [{"group_id": group.group_id, "indices": [group.index]} for group in self.pool.values()]

    def _resubmit(self, entry: Mapping[str, Any]) -> None:
        """A group again, or a whole-step checkpoint's step as its groups."""
        for offset, index in enumerate(entry["indices"]):
            self.submit_group(self.loader.dataset[int(index)], int(entry["group_id"]) + offset)

    def submit_group(self, sample: PromptSample, group_id: int) -> StreamGroup:
        """Streaming: submit one prompt's group to the engine with the fewest groups in the pool
        (the lowest index on a tie), sampler seed rollout.seed + group_id; it joins the pool."""
        load = [0] * len(self.engines)
        for group in self.pool.values():
            load[group.engine] += 1
        engine = load.index(min(load))
        sampling = msgspec.structs.replace(self.sampling(0), seed=self.config.rollout.seed + group_id)
        future = self.engines.submit_to(
            engine,
            "generate",
            encode([sample]),
            sampling,
            group_id,
            self.greedy_baseline,
            concurrency_group=GENERATE_GROUP,
        )
        self._engine_of[id(future)] = engine
        group = StreamGroup(group_id, sample.index, engine, future)
        self.pool[group_id] = group
        return group

    def draw_round(self) -> None:
        """Streaming: the next prompts_per_round prompts of the stream join the pool."""
        for sample in next(self.batches):
            self.submit_group(sample, self.next_group_id)
            self.next_group_id += 1

    def top_up(self, steps_left: int) -> None:
        """Streaming: draw rounds until the pool holds rollout.stream_pool_groups groups,
        or what `steps_left` steps of rollout_batch_size groups can still train."""
        r = self.config.rollout
        target = min(r.stream_pool_groups, steps_left * r.rollout_batch_size)
        while len(self.pool) < target:
            self.draw_round()

    def generate(self, step: int, version: int) -> tuple[list[Trajectory], dict[str, float]]:
        """Step `step`'s records, the first rollout_batch_size groups to finish that are
        at most max_staleness behind `version` (and inside the reward range under dynamic
        filtering); the pool topped up before and after. Metrics as `generate`'s, plus
        async/pool_groups (the pool when the step began to wait), async/dropped_stale_groups and
        async/rounds_added (rounds drawn because the pool ran dry: drops, filtering)."""
        r, steps = self.config.rollout, self.config.train.max_steps
        self.top_up(steps - step + 1)
        pool_size = len(self.pool)
        kept: list[list[Trajectory]] = []
        taken: list[Trajectory] = []
        seen = stale_groups = stale_records = rounds = 0
        every = self._wait_slice()
        waited = 0.0
        while len(kept) < r.rollout_batch_size:
            if not self.pool:
                if rounds >= r.max_sampling_rounds - 1:
                    break
                self.draw_round()
                rounds += 1
                continue
            futures = [group.future for group in self.pool.values()]
            wanted = min(r.rollout_batch_size - len(kept), len(futures))
            running = {id(future) for future in self._still_running(futures, wanted, every)}
            if len(running) == len(futures):
                waited += every
                if self._stalled(futures, waited):
                    waited = 0.0  # the restarted engines' groups: a new deadline
                continue
            waited = 0.0  # progress: a stall is counted from the last group that finished
            done = [group for group in self.pool.values() if id(group.future) not in running]
            by_group: dict[int, list[Trajectory]] = {group.group_id: [] for group in done}
            for record in self.collect([group.future for group in done]):  # one ray.get for them all
                by_group[record.group_id].append(record)
            for group in done:
                del self.pool[group.group_id]
                records = by_group[group.group_id]
                taken += records
                seen += 1
                verdict = group_verdict(records, version, r)
                if verdict == "stale":
                    stale_groups += 1
                    stale_records += len(records)
                elif verdict is None:
                    kept.append(records)
        if not kept:
            why = (
                f"every group's mean reward was outside {r.dynamic_filtering_reward_range}; widen "
                "rollout.dynamic_filtering_reward_range"
                if r.dynamic_filtering
                else f"every group was more than rollout.max_staleness = {r.max_staleness} versions behind"
            )
            raise RuntimeError(
                f"streaming: step {step} kept no group of the {seen} that finished ({rounds} rounds drawn "
                f"beyond the pool, rollout.max_sampling_rounds = {r.max_sampling_rounds}): {why}"
            )
        self.top_up(steps - step)
        kept.sort(key=lambda group: group[0].group_id)
        records = [record for group in kept for record in group]
        _, metrics = drop_stale(taken, version, None)
        metrics |= {
            "async/dropped_stale": float(stale_records),
            "async/dropped_stale_groups": float(stale_groups),
            "async/pool_groups": float(pool_size),
            "async/rounds_added": float(rounds),
        }
        if r.dynamic_filtering:
            metrics |= {"filter/groups_seen": float(seen), "filter/groups_kept": float(len(kept))}
        return records, metrics | rollout_metrics(records)
