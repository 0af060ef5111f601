"""The step loop (`PPOTrainer.fit` over real `Roles` and `Rollouts`) on in-process toy actors.

No Ray, no engine, no DeepSpeed: `tests/launch/fakes.py` stands in for the actors, so each test
runs one to a few steps in milliseconds and pins what the loop does with them: the order of the
phases, dynamic filtering, the async depth, eval and checkpoint cadence, resume, the metrics.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_launch.config import ConfigError, PPOConfig
from rl_launch.options import load_config
from tests.launch.fakes import FakeRun, fake_run, toy_prompts

pytestmark = pytest.mark.usefixtures("fake_ray_one_thread")


def config(**overrides) -> PPOConfig:
    """A GRPO run of 2 prompts x 2 samples per step, 3 steps, no reference or critic."""
    settings = {
        "preset": "arithmetic",  # validation only: nothing is prepared
        "rollout.rollout_batch_size": 2,
        "rollout.n_samples_per_prompt": 2,
        "rollout.generate_max_len": 8,
        "rollout.weight_sync": "broadcast",
        "algo.advantage.estimator": "grpo",
        "train.max_steps": 3,
        "train.micro_batch_tokens": 64,
        "log.progress_bar": False,
    }
    return load_config(PPOConfig, overrides={**settings, **{k: str(v) for k, v in overrides.items()}})


def training_calls(run: FakeRun, engine: int = 0) -> list[dict]:
    """The engine's generate calls for training (eval asks for eval.n_samples_per_prompt = 1)."""
    n = run.trainer.config.rollout.n_samples_per_prompt
    return [call for call in run.engines[engine].generated if call["n"] == n]


def test_a_step_generates_then_scores_then_trains_then_syncs_then_saves():
    run = fake_run(
        config(**{"train.max_steps": 1, "algo.kl.init_kl_coef": 0.01, "algo.advantage.estimator": "gae"})
    )
    run.fit()
    assert run.log.methods() == [
        "engine.generate",
        "policy.logprobs",  # the experience: every role's forward at once
        "ref.logprobs",
        "critic.values",
        "critic.train_step",  # then both trained roles on the same mini-batch
        "policy.train_step",
        "policy.sync",
        "engine.receive",
        "engine.activity",  # the engines' idle time over the step, for its metrics line
        "policy.save",  # the last step always saves
        "critic.save",
    ]
    (trained,) = run.learners["policy"][0].trained
    assert trained["has_advantages"]
    assert trained["groups"] == [0, 1]


def test_the_next_step_generates_on_the_weights_of_the_last_sync():
    run = fake_run(config())
    run.fit()
    assert [call["version"] for call in training_calls(run)] == [0, 1, 2]
    assert [call["first_group_id"] for call in training_calls(run)] == [0, 2, 4]  # group ids count up
    assert [metrics["policy_version"] for _, metrics in run.tracker.logged] == [1.0, 2.0, 3.0]
    assert run.engines[0].version == 3
    assert run.wire.checksum == 3


def test_the_old_logprob_forward_runs_only_when_a_batch_gets_several_optimizer_steps():
    one_step = fake_run(config(**{"train.max_steps": 1}))
    one_step.fit()
    assert "policy.logprobs" not in one_step.log.methods()  # the training forward's own log-probs
    two_epochs = fake_run(config(**{"train.max_steps": 1, "train.max_epochs": 2}))
    two_epochs.fit()
    assert two_epochs.log.methods("policy")[:3] == [
        "policy.logprobs",
        "policy.train_step",
        "policy.train_step",
    ]


def test_mini_batches_cover_the_batch_once_per_epoch():
    run = fake_run(
        config(
            **{
                "train.max_steps": 1,
                "train.max_epochs": 2,
                "train.train_batch_size": 2,
                "rollout.rollout_batch_size": 4,
            }
        )
    )
    run.fit()
    steps = [step["sequences"] for step in run.learners["policy"][0].trained]
    assert len(steps) == 8
    assert all(len(mini) == 2 for mini in steps)
    first = [sequence for mini in steps[:4] for sequence in mini]
    second = [sequence for mini in steps[4:] for sequence in mini]
    assert sorted(first) == sorted(second)
    assert len(set(first)) == 8
    assert steps[:4] != steps[4:]  # in a new order


def test_a_batch_is_split_over_the_ranks_of_a_role():
    run = fake_run(config(**{"train.max_steps": 1, "rollout.rollout_batch_size": 4}), ranks=2)
    run.fit()
    per_rank = [learner.trained[0]["groups"] for learner in run.learners["policy"]]
    assert all(per_rank)
    assert sorted(per_rank[0] + per_rank[1]) == [0, 1, 2, 3]


def test_dynamic_filtering_keeps_accepted_groups_and_draws_more_prompts():
    def reward(prompt, sample):  # even prompts: every sample right (mean 1, filtered); odd: half right
        return 1.0 if prompt.index % 2 == 0 else float(sample % 2)

    settings = {"rollout.dynamic_filtering": "true", "rollout.rollout_batch_size": 4, "train.max_steps": 2}
    run = fake_run(config(**settings), reward=reward, shuffle=False)
    run.fit()
    calls = training_calls(run)
    assert [call["indices"] for call in calls[:2]] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # two rounds for step 1
    assert calls[1]["seed"] != calls[0]["seed"]  # the extra round samples with its own seed
    assert calls[2]["indices"] == [8, 9, 10, 11]  # step 2 goes on after the extra prompts
    step_1 = run.tracker.logged[0][1]
    assert (step_1["filter/groups_seen"], step_1["filter/groups_kept"]) == (8.0, 4.0)
    trained = run.learners["policy"][0].trained[0]["groups"]
    assert trained == [1, 3, 5, 7]  # the odd prompts' groups (group id = position in the stream)


def test_dynamic_filtering_stops_with_a_diagnosis_when_no_group_survives():
    run = fake_run(config(**{"rollout.dynamic_filtering": "true"}), reward=lambda prompt, sample: 1.0)
    with pytest.raises(RuntimeError, match="dynamic filtering kept no group in 4 rounds"):
        run.fit()
    assert len(training_calls(run)) == 4  # rollout.max_sampling_rounds


def test_oversampling_draws_generate_batch_size_prompts_per_round_and_drops_the_surplus():
    settings = {
        "rollout.dynamic_filtering": "true",
        "rollout.generate_batch_size": 4,
        "train.max_steps": 2,
    }
    # every group half right (mean 0.5): all accepted, so one round of 4 prompts fills a batch of 2
    run = fake_run(config(**settings), shuffle=False)
    run.fit()
    calls = training_calls(run)
    assert [call["indices"] for call in calls] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # one round per step
    step_1 = run.tracker.logged[0][1]
    assert (step_1["filter/groups_seen"], step_1["filter/groups_kept"], step_1["filter/groups_surplus"]) == (
        4.0,
        2.0,
        2.0,
    )
    trained = [step["groups"] for step in run.learners["policy"][0].trained]
    assert trained == [[0, 1], [4, 5]]  # the first accepted groups in stream order; 2, 3 dropped


def test_oversampling_keeps_the_groups_accepted_before_drawing_replacements():
    def reward(prompt, sample):  # only prompts 1, 5, 9, ... have a mixed group; the others all right
        return 1.0 if prompt.index % 4 != 1 else float(sample % 2)

    settings = {
        "rollout.dynamic_filtering": "true",
        "rollout.generate_batch_size": 4,
        "train.max_steps": 1,
    }
    run = fake_run(config(**settings), reward=reward, shuffle=False)
    run.fit()
    assert [call["indices"] for call in training_calls(run)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert run.learners["policy"][0].trained[0]["groups"] == [1, 5]  # round 1's group survived round 2
    step_1 = run.tracker.logged[0][1]
    assert (step_1["filter/groups_seen"], step_1["filter/groups_surplus"]) == (8.0, 0.0)


def test_generate_batch_size_below_the_batch_or_without_filtering_is_refused():
    from rl_launch.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"rollout\.generate_batch_size.*must be >= rollout\.rollout_batch_size"
    ):
        config(**{"rollout.dynamic_filtering": "true", "rollout.generate_batch_size": 1})
    with pytest.raises(ConfigError, match=r"rollout\.generate_batch_size.*needs rollout\.dynamic_filtering"):
        config(**{"rollout.generate_batch_size": 4})
    assert config(**{"rollout.generate_batch_size": 2}).rollout.prompts_per_round == 2


@pytest.mark.parametrize("depth", [1, 2])
def test_async_records_are_depth_versions_behind_in_steady_state(depth):
    steps = 5
    run = fake_run(
        config(**{"rollout.async_train": "true", "rollout.async_depth": depth, "train.max_steps": steps})
    )
    run.fit()
    staleness = [metrics["async/staleness_max"] for _, metrics in run.tracker.logged]
    assert staleness == [min(step - 1, depth) for step in range(1, steps + 1)]
    assert [metrics["health/policy_lag"] for _, metrics in run.tracker.logged] == staleness
    calls = training_calls(run)
    assert len(calls) == steps  # nothing is submitted beyond train.max_steps
    assert [call["version"] for call in calls] == [0] * (depth + 1) + list(range(1, steps - depth))


def test_async_sync_receipts_are_compared_once_in_and_all_at_the_last_step():
    run = fake_run(config(**{"rollout.async_train": "true"}))
    run.roles.engines.late = {"receive"}  # the engines are still generating the steps queued before
    run.engines[0].corrupt = True
    run.fit()
    logged = [metrics for _, metrics in run.tracker.logged]
    assert [metrics["sync/unsettled_versions"] for metrics in logged] == [1.0, 2.0, 0.0]
    assert ["health/sync_checksum_match" in metrics for metrics in logged] == [False, False, True]
    assert logged[-1]["health/sync_checksum_match"] == 0.0  # the corrupt receipts are found at the end


def test_a_sync_whose_checksums_differ_is_reported():
    run = fake_run(config(**{"train.max_steps": 2}))
    run.fit()
    assert [metrics["health/sync_checksum_match"] for _, metrics in run.tracker.logged] == [1.0, 1.0]
    broken = fake_run(config(**{"train.max_steps": 1}))
    broken.engines[0].corrupt = True
    broken.fit()
    assert broken.tracker.logged[0][1]["health/sync_checksum_match"] == 0.0


def test_eval_runs_at_start_every_eval_steps_and_at_the_last_step_without_using_group_ids():
    run = fake_run(config(**{"eval.eval_steps": 2, "train.max_steps": 5}), eval_prompts=toy_prompts(3))
    run.fit()
    evaluated = [
        step for step, metrics in run.tracker.logged if any(key.startswith("eval/") for key in metrics)
    ]
    assert evaluated == [0, 2, 4, 5]
    assert [call["first_group_id"] for call in training_calls(run)] == [0, 2, 4, 6, 8]


def test_checkpoints_every_save_steps_and_at_the_last_step_with_the_loop_state():
    run = fake_run(config(**{"ckpt.save_steps": 2, "train.max_steps": 5}), ckpt_root="/ckpt")
    run.fit()
    saved = sorted(tag for root, tag, _ in run.checkpoints)
    assert saved == ["global_step2", "global_step4", "global_step5"]
    state = run.learners["policy"][0].load("/ckpt/policy", "global_step4")
    assert (state.step, state.consumed_samples, state.policy_version) == (4, 16, 4)
    assert state.extra["next_group_id"] == 8
    assert state.extra["run_id"] == "fake"
    none_between = fake_run(config(**{"train.max_steps": 3}))
    none_between.fit()
    assert sorted(tag for _, tag, _ in none_between.checkpoints) == ["global_step3"]


class _Killed(Exception):
    pass


def _fit_until_killed_after(run, *, step: int) -> None:
    """Fit `run` until the line of `step` is logged, then stop it as a kill would (no more steps)."""
    log = run.tracker.log

    def log_then_die(logged_step, metrics):
        log(logged_step, metrics)
        if logged_step == step:
            raise _Killed

    run.tracker.log = log_then_die
    with pytest.raises(_Killed):
        run.fit()


def test_a_run_killed_between_a_checkpoint_and_its_metrics_line_gets_the_line_back_on_resume():
    """The checkpoint of a step is written before the step's metrics line; it keeps the line, and
    the resumed run writes it (all but the step's timings) when the kill came between the two."""
    settings = {"ckpt.save_steps": 2, "train.max_steps": 3}
    whole = fake_run(config(**settings), ckpt_root="/a/checkpoints")
    whole.fit()
    first = fake_run(config(**settings), ckpt_root="/b/checkpoints")
    original_log = first.tracker.log

    def die_before_step_2s_line(step, metrics):
        if step == 2:
            raise _Killed
        original_log(step, metrics)

    first.tracker.log = die_before_step_2s_line
    with pytest.raises(_Killed):
        first.fit()
    assert first.tracker.steps() == [1]

    resumed = fake_run(
        config(**settings),
        ckpt_root="/b/checkpoints",
        resume_from={"policy": Path("/b/checkpoints/policy/global_step2")},
        checkpoints=first.checkpoints,
    )
    resumed.fit(resumed.trainer.resume())
    ((step, line),) = resumed.tracker.restored
    assert step == 2
    logged = dict(whole.tracker.logged)[2]
    assert line == {key: value for key, value in logged.items() if key in line}
    assert {key.split("/")[0] for key in set(logged) - set(line)} == {"time", "throughput"}
    assert line["policy_version"] == 2.0
    assert resumed.tracker.steps() == [3]


def test_a_resumed_async_run_trains_on_the_prompts_an_uninterrupted_one_would():
    settings = {"rollout.async_train": "true", "ckpt.save_steps": 2, "train.max_steps": 4}
    whole = fake_run(config(**settings), ckpt_root="/a/checkpoints")
    whole.fit()

    first = fake_run(config(**settings), ckpt_root="/b/checkpoints")
    _fit_until_killed_after(first, step=2)

    resumed = fake_run(
        config(**settings),
        ckpt_root="/b/checkpoints",
        resume_from={"policy": Path("/b/checkpoints/policy/global_step2")},
        checkpoints=first.checkpoints,
    )
    start = resumed.trainer.resume()
    assert (start.step, resumed.trainer.version, resumed.engines[0].version) == (2, 2, 2)
    resumed.fit(start)

    def without_version(calls):
        return [{key: value for key, value in call.items() if key != "version"} for call in calls]

    assert without_version(training_calls(resumed)) == without_version(training_calls(whole)[2:])
    assert resumed.learners["policy"][0].trained == whole.learners["policy"][0].trained[2:]
    assert resumed.tracker.steps() == [3, 4]


def test_the_greedy_baseline_is_asked_for_training_but_not_for_eval():
    run = fake_run(
        config(**{"algo.advantage.estimator": "remax", "train.max_steps": 1}), eval_prompts=toy_prompts(2)
    )
    run.fit()
    assert [call["greedy_baseline"] for call in run.engines[0].generated] == [False, True, False]
    assert run.tracker.logged[-1][1]["reward/greedy_baseline_mean"] == 0.0  # sample 0's reward


def test_the_hybrid_engine_sleeps_for_training_and_learners_offload_for_generation():
    # the learners offload their states only on GPU runs
    run = fake_run(config(**{"ray.colocate": "all", "train.max_steps": 2}), device="cuda")
    run.fit()
    step = [
        "engine.generate",
        "engine.sleep",
        "policy.reload_states",
        "policy.train_step",
        "engine.wake_up",
        "policy.sync",
        "engine.receive",
        "policy.offload_states",
    ]
    assert run.log.methods() == [
        "policy.offload_states",
        *step,
        "engine.activity",
        *step,
        "engine.activity",
        "policy.reload_states",
        "policy.save",
        "policy.offload_states",
    ]


def test_a_step_logs_rewards_lengths_training_sync_timing_and_version():
    run = fake_run(config(**{"train.max_steps": 1, "log.completions": 1}))
    run.fit()
    ((step, metrics),) = run.tracker.logged
    assert step == 1
    assert metrics["reward/mean"] == 0.5  # samples alternate 0 and 1
    assert metrics["response_length/mean"] == 3.0
    assert metrics["rollout/action_tokens_mean"] == 3.0
    assert metrics["policy/loss"] == 1.0
    assert metrics["policy/grad_norm"] == 0.5
    assert metrics["sync/gigabytes"] == 16 / 1e9
    assert metrics["health/sync_checksum_match"] == 1.0
    assert metrics["kl/coef"] == 0.0
    assert metrics["health/policy_lag"] == 0.0
    assert metrics["policy_version"] == 1.0
    assert 0.0 <= metrics["time/engine_idle_fraction"] <= 1.0  # a fraction, beside the phases' seconds
    phases = [key for key in metrics if key.startswith("time/") and key != "time/engine_idle_fraction"]
    assert phases == [
        "time/generation",
        "time/experience",
        "time/training",
        "time/sync",
        "time/checkpoint",
        "time/step",
    ]
    assert metrics["throughput/samples_per_s"] > 0
    ((logged_step, rows),) = run.tracker.completions
    assert logged_step == 1
    assert len(rows) == 1
    assert rows[0]["group_id"] == 0


def test_num_episodes_become_steps_once_the_prompts_are_loaded():
    from rl_launch.learner_settings import learner_settings
    from rl_launch.ppo import steps_of_episodes

    config = load_config(
        PPOConfig,
        None,
        {"train.num_episodes": "3", "rollout.rollout_batch_size": "4", "preset": "arithmetic"},
    )
    assert steps_of_episodes(config, 10).train.max_steps == 6  # 3 × ⌊10 / 4⌋
    assert steps_of_episodes(config, 2).train.max_steps == 1  # fewer prompts than a batch: one step
    config = load_config(
        PPOConfig,
        None,
        {"train.deepspeed_config.zero_optimization.overlap_comm": "true", "preset": "arithmetic"},
    )
    settings = learner_settings(config.model, config.train, dtype="fp32", lr=1e-6)
    assert settings.deepspeed.extra == {"zero_optimization": {"overlap_comm": True}}


def test_reward_normalisation_logs_running_statistics_and_resumes_them_exactly():
    def reward(prompt, sample):  # a different reward per prompt and sample: the statistics move
        return float(prompt.index * 3 + sample)

    settings = {"reward.normalize": "running", "ckpt.save_steps": 2, "train.max_steps": 4}
    whole = fake_run(config(**settings), reward=reward, ckpt_root="/a/checkpoints", shuffle=False)
    whole.fit()
    logged = [metrics for _, metrics in whole.tracker.logged]
    # step 1: prompts 0, 1 x samples 0, 1 -> rewards 0, 1, 3, 4: mean 2, population std sqrt(2.5)
    assert logged[0]["reward/running_mean"] == 2.0
    assert logged[0]["reward/running_std"] == pytest.approx(2.5**0.5)
    assert logged[0]["reward/mean"] == 2.0  # reward/mean stays the raw reward's
    assert logged[1]["reward/running_mean"] == 5.0  # prompts 0-3: rewards 0, 1, 3, 4, 6, 7, 9, 10

    first = fake_run(config(**settings), reward=reward, ckpt_root="/b/checkpoints", shuffle=False)
    _fit_until_killed_after(first, step=2)
    resumed = fake_run(
        config(**settings),
        reward=reward,
        ckpt_root="/b/checkpoints",
        resume_from={"policy": Path("/b/checkpoints/policy/global_step2")},
        checkpoints=first.checkpoints,
        shuffle=False,
    )
    resumed.fit(resumed.trainer.resume())
    for key in ("reward/running_mean", "reward/running_std"):
        assert [m[key] for _, m in resumed.tracker.logged] == [m[key] for m in logged[2:]]


def test_without_reward_normalisation_nothing_is_logged_or_saved():
    run = fake_run(config(**{"train.max_steps": 1}))
    run.fit()
    assert "reward/running_mean" not in run.tracker.logged[0][1]
    assert run.trainer.reward_moments is None


def test_reward_normalisation_model_scales_only_the_reward_models_score(tmp_path):
    import json

    from rl_launch.algorithm import score_normalization
    from tests.launch.fakes import FakeGroup, ToyLearner

    (tmp_path / "config.json").write_text(json.dumps({"mean": 0.25, "std": 0.5}))
    assert score_normalization(tmp_path) == (0.25, 0.5)
    (tmp_path / "config.json").write_text(json.dumps({"mean": 0.25}))
    assert score_normalization(tmp_path) is None  # no std: the scores stay raw

    def reward(prompt, sample):
        return float(sample)  # the function's part: 0 or 1

    settings = {"train.max_steps": 1, "reward.clip": "null"}
    raw = fake_run(config(**settings), reward=reward)
    run = fake_run(config(**settings), reward=reward)
    for each in (raw, run):  # a reward model scoring 0.5 for every sample
        each.roles.groups["reward_model"] = FakeGroup(
            "reward_model", [ToyLearner("reward_model", 0, each.wire, {})], each.log
        )
    run.trainer.score_normalization = (0.25, 0.5)
    raw.fit()
    run.fit()
    assert raw.tracker.logged[0][1]["reward/mean"] == 0.5 + 0.5  # mean function reward + score
    assert run.tracker.logged[0][1]["reward/mean"] == 0.5 + (0.5 - 0.25) / 0.5
    assert run.tracker.logged[0][1]["reward/model_mean"] == 0.5  # logged raw


def test_reward_normalisation_model_needs_a_reward_model():
    from rl_launch.config import ConfigError

    with pytest.raises(ConfigError, match=r"reward\.normalize.*needs model\.reward_pretrain"):
        config(**{"reward.normalize": "model"})


def test_rollout_min_new_tokens_reaches_the_training_sampling():
    assert fake_run(config(**{"rollout.min_new_tokens": 8})).rollouts.sampling(2).min_new_tokens == 8
    assert fake_run(config()).rollouts.sampling(0).min_new_tokens == 0  # off by default
    with pytest.raises(ConfigError, match=r"rollout.min_new_tokens.*at most rollout.generate_max_len \(8\)"):
        config(**{"rollout.min_new_tokens": 9})


# ----------------------------------------------------------------------------------------------
# Streaming (rollout.streaming): a pool of groups, a step takes the first to finish


def streaming(**overrides) -> PPOConfig:
    """Streaming, 2 prompts x 2 samples per step, rounds of 4 prompts (oversampling): the pool
    holds (depth 1 + 1) x 4 = 8 groups."""
    settings = {
        "rollout.async_train": "true",
        "rollout.streaming": "true",
        "rollout.generate_batch_size": 4,
        "train.max_steps": 3,
    }
    return config(**{**settings, **overrides})


def test_streaming_trains_the_first_groups_to_finish_and_keeps_the_rest_in_flight():
    run = fake_run(streaming(), shuffle=False)  # group id g is prompt g
    run.roles.engines.slow = lambda rank, args: args[2] in (0, 2)  # groups 0 and 2 run long
    run.fit()
    calls = training_calls(run)
    # one call per group, each with its own seed: rollout.seed + group id
    assert [(call["indices"], call["first_group_id"]) for call in calls] == [([g], g) for g in range(8)]
    assert [call["seed"] for call in calls] == [1234 + g for g in range(8)]
    trained = [step["groups"] for step in run.learners["policy"][0].trained]
    assert trained == [[1, 3], [4, 5], [6, 7]]  # never waiting for 0 and 2
    assert [entry["group_id"] for entry in run.rollouts.in_flight()] == [0, 2]
    logged = [metrics for _, metrics in run.tracker.logged]
    assert [metrics["async/pool_groups"] for metrics in logged] == [8.0, 6.0, 4.0]  # no top-up: 3 steps x 2
    assert [metrics["async/staleness_max"] for metrics in logged] == [0.0, 1.0, 2.0]
    assert all(metrics["time/engine_idle_fraction"] == 0.25 for metrics in logged)


def test_streaming_draws_rounds_to_keep_the_pool_full_and_only_what_the_steps_can_train():
    run = fake_run(streaming(**{"train.max_steps": 5}), shuffle=False)
    run.fit()
    logged = [metrics for _, metrics in run.tracker.logged]
    # 8 at first; after each step of 2 the pool is topped up in rounds of 4 while below
    # min(8, steps left x 2) (6 < 8 after step 1: one round, 10)
    assert [metrics["async/pool_groups"] for metrics in logged] == [8.0, 10.0, 8.0, 6.0, 4.0]
    assert len(training_calls(run)) == 12
    trained = [step["groups"] for step in run.learners["policy"][0].trained]
    assert trained == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_streaming_drops_the_groups_that_finish_too_stale_and_draws_when_the_pool_runs_dry():
    run = fake_run(streaming(**{"rollout.max_staleness": 1}), shuffle=False)
    run.roles.engines.slow = lambda rank, args: args[2] == 0
    run.fit()
    trained = [step["groups"] for step in run.learners["policy"][0].trained]
    # step 3 trains at version 2: what is left of the first pool (0, 5, 6, 7, generated at
    # version 0) is dropped, so the pool runs dry and a round of 4 is drawn at version 2
    assert trained == [[1, 2], [3, 4], [8, 9]]
    step_3 = run.tracker.logged[2][1]
    assert (step_3["async/dropped_stale_groups"], step_3["async/dropped_stale"]) == (4.0, 8.0)
    assert (step_3["async/rounds_added"], step_3["async/staleness_max"]) == (1.0, 2.0)


def test_streaming_with_dynamic_filtering_waits_for_accepted_groups_and_draws_when_the_pool_is_dry():
    def reward(prompt, sample):  # only prompts 3, 7, 11, ... have a mixed group
        return 1.0 if prompt.index % 4 != 3 else float(sample % 2)

    run = fake_run(
        streaming(**{"rollout.dynamic_filtering": "true", "train.max_steps": 1}), reward=reward, shuffle=False
    )
    run.fit()
    assert run.learners["policy"][0].trained[0]["groups"] == [3, 7]
    step_1 = run.tracker.logged[0][1]
    # one step: the pool is one round (what one step can train); its 4 groups give group 3, the
    # pool runs dry and one more round gives group 7
    assert (step_1["filter/groups_seen"], step_1["filter/groups_kept"], step_1["async/rounds_added"]) == (
        8.0,
        2.0,
        1.0,
    )
    dry = fake_run(
        streaming(
            **{"rollout.dynamic_filtering": "true", "train.max_steps": 1, "rollout.max_sampling_rounds": 2}
        ),
        reward=lambda prompt, sample: 1.0,
        shuffle=False,
    )
    with pytest.raises(
        RuntimeError, match=r"streaming: step 1 kept no group of the 8 that finished \(1 rounds"
    ):
        dry.fit()


def test_a_resumed_streaming_run_generates_the_groups_not_yet_trained_again_and_trains_the_same():
    settings = {"ckpt.save_steps": 2, "train.max_steps": 4}
    slow = lambda rank, args: args[2] % 5 == 0  # noqa: E731 - groups 0, 5, 10 run long
    whole = fake_run(streaming(**settings), ckpt_root="/a/checkpoints")
    whole.roles.engines.slow = slow
    whole.fit()

    first = fake_run(streaming(**settings), ckpt_root="/b/checkpoints")
    first.roles.engines.slow = slow
    _fit_until_killed_after(first, step=2)
    state = first.trainer.training_state(2, 0)
    pool = state.extra["in_flight"]
    assert [entry["group_id"] for entry in pool] == [0, 5, 6, 7]  # 0 and 5 still running
    assert all(set(entry) == {"group_id", "indices"} and len(entry["indices"]) == 1 for entry in pool)

    resumed = fake_run(
        streaming(**settings),
        ckpt_root="/b/checkpoints",
        resume_from={"policy": Path("/b/checkpoints/policy/global_step2")},
        checkpoints=first.checkpoints,
    )
    resumed.roles.engines.slow = slow
    resumed.fit(resumed.trainer.resume())
    again = training_calls(resumed)[: len(pool)]  # the pool, submitted again in stream order
    assert [(call["first_group_id"], call["indices"]) for call in again] == [
        (entry["group_id"], entry["indices"]) for entry in pool
    ]
    assert resumed.learners["policy"][0].trained == whole.learners["policy"][0].trained[2:]
    trained = [g for step in first.learners["policy"][0].trained for g in step["groups"]]
    trained += [g for step in resumed.learners["policy"][0].trained for g in step["groups"]]
    assert len(trained) == len(set(trained))  # no group trained twice


def test_a_whole_step_run_refuses_a_streaming_checkpoint():
    settings = {"ckpt.save_steps": 1, "train.max_steps": 1}
    first = fake_run(streaming(**settings), ckpt_root="/c/checkpoints")
    first.fit()
    whole_steps = {"rollout.dynamic_filtering": "true", "rollout.generate_batch_size": 4}  # the same loader
    resumed = fake_run(
        config(**{"rollout.async_train": "true", **whole_steps, **settings, "train.max_steps": 2}),
        ckpt_root="/c/checkpoints",
        resume_from={"policy": Path("/c/checkpoints/policy/global_step1")},
        checkpoints=first.checkpoints,
    )
    with pytest.raises(ValueError, match=r"written with rollout\.streaming true.*--rollout\.streaming true"):
        resumed.trainer.resume()
