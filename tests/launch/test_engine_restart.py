"""A rollout engine that dies mid-run is restarted in place (`rl_launch.supervisor`), on the toys.

The fakes' engine dies as a Ray actor does (`tests/launch/fakes.py`: every call then fails with
`RayActorError`); the loop must restart it, give it the current weights before it serves, issue
its lost generation calls again with the same prompts, seeds and group ids, and train every step
as an uninterrupted run would.
"""

from __future__ import annotations

import pytest

from rl_launch.config import PPOConfig
from rl_launch.options import load_config
from tests.launch.fakes import RayActorError, fake_run

pytestmark = pytest.mark.usefixtures("fake_ray_one_thread")


def config(**overrides) -> PPOConfig:
    """GRPO, 2 prompts x 2 samples per step, 4 steps, shm weight sync (a restarted engine joins alone)."""
    settings = {
        "preset": "arithmetic",  # validation only: nothing is prepared
        "rollout.rollout_batch_size": 2,
        "rollout.n_samples_per_prompt": 2,
        "rollout.generate_max_len": 8,
        "rollout.weight_sync": "shm",
        "algo.advantage.estimator": "grpo",
        "train.max_steps": 4,
        "train.micro_batch_tokens": 64,
        "log.progress_bar": False,
    }
    return load_config(PPOConfig, overrides={**settings, **{k: str(v) for k, v in overrides.items()}})


def trained(run) -> list[list]:
    """What the policy trained on, step by step: the groups and their sequences."""
    return [(step["groups"], step["sequences"]) for step in run.learners["policy"][0].trained]


def generate_calls(engine) -> list[tuple]:
    return [
        (call["indices"], call["first_group_id"], call["seed"], call["version"]) for call in engine.generated
    ]


def test_an_engine_killed_mid_step_is_restarted_resynced_and_the_run_trains_every_step_as_without_it():
    reference = fake_run(config())
    reference.fit()
    run = fake_run(config())
    run.engines[0].die_on_generate = 3  # step 3's generation: the engine dies with the call
    tracker = run.fit()

    assert tracker.steps() == [1, 2, 3, 4]
    assert run.roles.engines.replaced == [0]
    dead, new = run.engines[0], run.engines[1]
    assert dead.dead
    assert not new.dead
    # the new engine joined the sync and got version 2 (the weights of step 2's sync) before it
    # served step 3's prompts again: same prompts, group ids and seed as the lost call
    assert len(new.synced_with) == 1
    lost = generate_calls(reference.engines[0])[2]
    assert generate_calls(new)[0] == lost
    assert new.version == 4
    assert trained(run) == trained(reference)
    metrics = dict(tracker.logged)
    assert [metrics[step]["engine/restarts"] for step in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]
    assert metrics[3]["engine/restart_s"] >= 0.0
    assert metrics[4]["engine/restart_s"] == 0.0
    assert metrics[3]["policy_version"] == 3  # one sync per step, the restart's re-sync not counted
    died, restarted = tracker.warnings
    assert died.startswith("engine-0 died: The actor engine-0 died unexpectedly"), died  # the probe's words
    assert "restarting it (restart 1 of 3, rollout.engine_restarts)" in died
    assert restarted.startswith("engine-0 restarted in ")
    assert "weights of version 2 in" in restarted
    assert restarted.endswith("; 1 generation call issued again")


def test_with_engine_restarts_0_a_dead_engine_stops_the_run_after_saving_the_last_finished_step():
    run = fake_run(config(**{"rollout.engine_restarts": 0}), ckpt_root="/b/checkpoints")
    run.engines[0].die_on_generate = 3
    with pytest.raises(RayActorError):
        run.fit()
    assert run.tracker.steps() == [1, 2]
    assert run.trainer.saved_after_failure == 2
    assert run.roles.engines.replaced == []
    assert run.tracker.warnings == []


def test_once_the_restarts_are_spent_the_next_death_stops_the_run():
    run = fake_run(config(**{"rollout.engine_restarts": 1, "train.max_steps": 6}), ckpt_root="/b/checkpoints")
    run.engines[0].die_on_generate = 2
    make = run.roles.engines.make_worker

    def dying_engine():
        engine = make()
        engine.die_on_generate = 3  # the restarted engine dies too, two calls later
        return engine

    run.roles.engines.make_worker = dying_engine
    with pytest.raises(RayActorError) as stopped:
        run.fit()
    assert run.roles.engines.replaced == [0]
    assert run.tracker.steps() == [1, 2, 3]
    assert run.trainer.saved_after_failure == 3
    from rl_launch.ppo import _diagnosis

    assert (
        "  engine restarts: 1 of rollout.engine_restarts = 1 used in this run (engine-0)"
        in _diagnosis(stopped.value, run.roles, None, None).splitlines()
    )


def dies_in_sync(run, version: int, error: Exception) -> None:
    """`run`'s engine dies in the weight sync of `version`, its call failing with `error`."""
    engine = run.engines[0]
    original = engine.receive

    def receive(sent, payload=None):
        if sent == version:
            engine.dead = True
            raise error
        return original(sent, payload)

    engine.receive = receive


def test_an_engine_that_dies_in_the_weight_sync_is_restarted_and_the_version_sent_again():
    run = fake_run(config())
    dies_in_sync(run, 2, RayActorError("The actor died unexpectedly before finishing this task"))  # step 2's
    tracker = run.fit()
    assert tracker.steps() == [1, 2, 3, 4]
    new = run.engines[1]
    assert [call["version"] for call in new.generated] == [2, 3]  # steps 3 and 4, on the new weights
    assert "weights of version 2 in" in tracker.warnings[1]  # the sync, sent again
    assert dict(tracker.logged)[2]["health/sync_checksum_match"] == 1.0


def test_a_death_found_by_a_probe_is_reported_with_the_probes_words_not_the_failure_that_led_to_it():
    """A broadcast's learner side can fail on the lost peer (gloo's "Connection closed by peer",
    a task error) before Ray reports the engine dead: the probe finds the death, and the console
    says the engine died and why, as when Ray reports it first."""
    from tests.launch.fakes import RayError

    run = fake_run(config())
    dies_in_sync(run, 2, RayError("RuntimeError: Connection closed by peer [192.0.2.2]:8082"))
    tracker = run.fit()
    assert tracker.steps() == [1, 2, 3, 4]
    died, restarted = tracker.warnings
    assert died.startswith("engine-0 died: The actor engine-0 died unexpectedly"), died
    assert "Connection closed by peer" not in died
    assert restarted.startswith("engine-0 restarted in ")


def test_async_mode_issues_the_dead_engines_steps_in_flight_again_with_their_group_ids():
    settings = {"rollout.async_train": True, "rollout.async_depth": 1}
    reference = fake_run(config(**settings))
    reference.fit()
    run = fake_run(config(**settings))
    run.engines[0].die_on_generate = 3  # step 3's generation, submitted while step 2 trained
    tracker = run.fit()
    assert tracker.steps() == [1, 2, 3, 4]
    groups = [call[1] for call in generate_calls(run.engines[1])]
    assert groups[0] == generate_calls(reference.engines[0])[2][1]  # the lost call, again
    assert [step["groups"] for step in run.learners["policy"][0].trained] == [
        step["groups"] for step in reference.learners["policy"][0].trained
    ]


def test_a_hung_engine_handed_to_restart_is_replaced_and_its_calls_answer_from_the_new_one():
    from rl_data import encode
    from tests.launch.fakes import toy_prompts

    run = fake_run(config())
    supervisor = run.roles.supervisor
    sampling = run.rollouts.sampling(1)
    hung = supervisor.submit_to(0, "generate", encode(toy_prompts(1)), sampling, 0, False)
    hung.ready, hung.value = False, None  # a call that never answers
    record = supervisor.restart(0, "did not answer within 30 s (rollout generation deadline)")
    assert record.reissued == 1
    assert run.roles.engines.replaced == [0]
    (payload,) = supervisor.get([hung])
    assert payload is not None
    assert len(run.engines[1].generated) == 1
    assert run.tracker.warnings[0].startswith("engine-0 did not answer within 30 s")


def test_a_strategy_whose_group_needs_every_engine_starts_again_for_all_and_resends_the_version(monkeypatch):
    """`SyncStrategy.whole_group` (broadcast): the survivors and the sender join a new group with
    the restarted engine, and the last version goes to every engine before any serves again."""
    from rl_launch.components.weight_sync import SYNC_STRATEGIES, SyncStrategy

    starts = []

    def start(context, layout):
        starts.append(len(starts))
        return f"group-{len(starts)}", "a toy group"

    monkeypatch.setitem(SYNC_STRATEGIES, "toygroup", SyncStrategy(start=start, whole_group=True))
    run = fake_run(config(**{"rollout.weight_sync": "toygroup", "rollout.rollout_batch_size": 4}), engines=2)
    run.engines[1].die_on_generate = 2  # step 2's generation
    tracker = run.fit()
    assert tracker.steps() == [1, 2, 3, 4]
    survivor, new = run.engines[0], run.engines[2]
    assert starts == [0]  # once, for the restart (the fakes skip the run's first start)
    assert run.learners["policy"][0].synced_with == ["group-1"]
    assert survivor.synced_with == [("group-1", 1)]
    assert new.synced_with == [("group-1", 2)]
    # both got version 1 again before step 2's prompts of the dead engine were generated again
    assert [call["version"] for call in new.generated] == [1, 2, 3]
    assert survivor.version == new.version == 4


def test_streaming_issues_the_dead_engines_groups_in_the_pool_again():
    settings = {"rollout.async_train": True, "rollout.streaming": True}
    reference = fake_run(config(**settings))
    reference.fit()
    run = fake_run(config(**settings))
    run.engines[0].die_on_generate = 5  # a group of the pool, while earlier ones are not yet trained
    tracker = run.fit()
    assert tracker.steps() == [1, 2, 3, 4]
    assert tracker.warnings[1].startswith("engine-0 restarted in ")
    assert sorted(g for step in trained(run) for g in step[0]) == sorted(
        g for step in trained(reference) for g in step[0]
    )


def test_an_engine_whose_vllm_engine_core_died_is_restarted_though_its_actor_lives():
    import types

    class EngineDeadError(Exception):  # vLLM's, as Ray reports it from the actor (RayTaskError)
        actor_id = "e0"

    run = fake_run(config())
    run.roles.engines.actors[0]._actor_id = types.SimpleNamespace(hex=lambda: "e0")
    engine = run.engines[0]
    original = engine.generate

    def generate(*args):
        if len(engine.generated) == 1:
            raise EngineDeadError("EngineCore encountered an issue. See stack trace for the root cause.")
        return original(*args)

    engine.generate = generate
    tracker = run.fit()
    assert tracker.steps() == [1, 2, 3, 4]
    assert run.roles.engines.replaced == [0]
    assert tracker.warnings[0].startswith("engine-0 failed: EngineCore encountered an issue")


def test_a_hybrid_engine_that_died_before_its_sleep_is_restarted_synced_and_put_to_sleep():
    run = fake_run(config(**{"ray.colocate": "all"}), device="cuda")
    engine = run.engines[0]
    original = engine.sleep

    def sleep(level=1):
        if len(engine.generated) == 2:  # after step 2's generation
            engine.dead = True
            raise RayActorError("The actor died unexpectedly before finishing this task")
        return original(level)

    engine.sleep = sleep
    tracker = run.fit()
    assert tracker.steps() == [1, 2, 3, 4]
    new = run.engines[1]
    assert new.version == 4
    assert [call["version"] for call in new.generated] == [2, 3]
    assert "weights of version 1 in" in tracker.warnings[1]  # then the sleep call issued again
    assert not new.asleep  # awake after the last step's wake-up


def test_an_engine_whose_generation_never_returns_is_killed_restarted_resynced_and_the_step_completes():
    """`health.engine_stall_stop_s` on a hung engine (its call never answers, `ray.wait` never
    reports it, and a `ray.get` of it would fail the test): the engine is killed without its call
    being waited on again, a new one gets the current weights and the same call, and every step
    trains what an uninterrupted run trains. The fakes' waits take no time: the deadline is counted
    in wait slices, so the test waits for nothing."""
    stall = {"health.engine_stall_stop_s": 1.0}
    reference = fake_run(config(**stall))
    reference.fit()
    run = fake_run(config(**stall))
    run.engines[0].hang_on_generate = 3  # step 3's generation never returns
    tracker = run.fit()

    assert tracker.steps() == [1, 2, 3, 4]
    assert run.roles.engines.replaced == [0]
    hung, new = run.engines[0], run.engines[1]
    assert hung.killed
    assert len(hung.generated) == 2  # it served steps 1 and 2, then hung
    # the new engine joined the sync and got version 2 before it served step 3's call again
    assert len(new.synced_with) == 1
    assert generate_calls(new)[0] == generate_calls(reference.engines[0])[2]
    assert trained(run) == trained(reference)
    metrics = dict(tracker.logged)
    assert [metrics[step]["engine/restarts/hung"] for step in (1, 2, 3, 4)] == [0.0, 0.0, 1.0, 1.0]
    assert [metrics[step]["engine/restarts/dead"] for step in (1, 2, 3, 4)] == [0.0] * 4
    assert metrics[3]["engine/restarts"] == 1.0
    stuck, restarted = tracker.warnings
    assert stuck == (
        "engine-0 hung: no generation answer for 1 s (health.engine_stall_stop_s = 1); "
        "restarting it (restart 1 of 3, rollout.engine_restarts)"
    )
    assert "weights of version 2 in" in restarted
    assert restarted.endswith("; 1 generation call issued again")


def test_a_hung_engine_stops_the_run_naming_it_once_the_restarts_are_spent():
    from rl_launch.health import HealthError

    run = fake_run(config(**{"rollout.engine_restarts": 1, "health.engine_stall_stop_s": 2.0}))
    run.engines[0].hang_on_generate = 2
    make = run.roles.engines.make_worker

    def hanging_engine():
        engine = make()
        engine.hang_on_generate = 1  # the restarted engine hangs on its first call too
        return engine

    run.roles.engines.make_worker = hanging_engine
    with pytest.raises(HealthError) as stopped:
        run.fit()
    assert run.roles.engines.replaced == [0]
    assert run.tracker.steps() == [1]
    message = str(stopped.value)
    assert message.startswith(
        "generation has waited 2 s on engine-0 (health.engine_stall_stop_s = 2): the run stops"
    )
    assert "rollout.engine_restarts = 1 restarts are spent. Raise rollout.engine_restarts" in message
    # the learners saved the last finished step before the run stopped, and the message says so
    assert run.trainer.saved_after_failure == 1
    assert message.endswith(". checkpoint of step 1 saved: --ckpt.load_checkpoint true continues from it")


def test_streaming_restarts_a_hung_engine_and_trains_every_group_once():
    settings = {"rollout.async_train": True, "rollout.streaming": True, "health.engine_stall_stop_s": 1.0}
    reference = fake_run(config(**settings))
    reference.fit()
    run = fake_run(config(**settings))
    run.engines[0].hang_on_generate = 5  # a group of the pool
    tracker = run.fit()
    assert tracker.steps() == [1, 2, 3, 4]
    assert run.roles.engines.replaced == [0]
    assert tracker.warnings[0].startswith("engine-0 hung: no generation answer for 1 s")
    assert sorted(g for step in trained(run) for g in step[0]) == sorted(
        g for step in trained(reference) for g in step[0]
    )


def test_an_engine_whose_weight_sync_receipt_never_comes_is_restarted_and_the_version_sent_again():
    from tests.launch.fakes import HANG

    run = fake_run(config())
    engine = run.engines[0]
    original = engine.receive
    engine.receive = lambda version, payload=None: HANG if version == 2 else original(version, payload)
    tracker = run.fit()
    assert tracker.steps() == [1, 2, 3, 4]
    assert engine.killed
    new = run.engines[1]
    assert [call["version"] for call in new.generated] == [2, 3]  # steps 3 and 4, on the new weights
    assert tracker.warnings[0] == (
        "engine-0 hung: no weight-sync receipt within 1830 s (rollout.weight_sync_timeout_s = 1800 s + 30 s); "
        "restarting it (restart 1 of 3, rollout.engine_restarts)"
    )
    assert "weights of version 2 in" in tracker.warnings[1]
    metrics = dict(tracker.logged)
    assert metrics[2]["engine/restarts/hung"] == 1.0
    assert metrics[2]["health/sync_checksum_match"] == 1.0


def test_an_engine_that_never_answers_a_control_call_is_restarted_past_engine_stall_stop_s():
    from tests.launch.fakes import HANG

    run = fake_run(config(**{"health.engine_stall_stop_s": 60.0}))
    engine = run.engines[0]
    engine.activity = lambda: HANG  # the first step's activity call never answers
    tracker = run.fit()
    assert tracker.steps() == [1, 2, 3, 4]
    assert run.roles.engines.replaced == [0]
    assert tracker.warnings[0].startswith(
        "engine-0 hung: no answer to activity within 60 s (health.engine_stall_stop_s); restarting it"
    )
    assert dict(tracker.logged)[1]["time/engine_idle_fraction"] == 0.25  # the new engine's answer


def test_a_sync_that_fails_while_an_engine_answers_no_probe_restarts_that_engine_as_hung():
    from tests.launch.fakes import HANG, RayError

    run = fake_run(config())
    policy, engine = run.learners["policy"][0], run.engines[0]
    original = policy.sync

    def sync(version):
        if version == 2 and not engine.killed:  # the sender's collective times out on a hung peer
            raise RayError("the weight-sync collective timed out after 1800 s")
        return original(version)

    policy.sync = sync
    engine_alive = engine.alive
    engine.alive = lambda: HANG if len(engine.generated) == 2 else engine_alive()
    tracker = run.fit()
    assert tracker.steps() == [1, 2, 3, 4]
    assert engine.killed
    assert tracker.warnings[0].startswith(
        "engine-0 hung: no answer to a probe within 10 s after: the weight-sync collective timed out"
    )
    assert [call["version"] for call in run.engines[1].generated] == [2, 3]


def test_a_hung_engine_in_the_weight_sync_stops_the_run_naming_it_once_the_restarts_are_spent():
    from rl_launch.health import EngineHung
    from tests.launch.fakes import HANG

    run = fake_run(config(**{"rollout.engine_restarts": 0}))
    engine = run.engines[0]
    engine.receive = lambda version, payload=None: HANG
    with pytest.raises(EngineHung) as stopped:
        run.fit()
    assert str(stopped.value).startswith(
        "engine-0 hung: no weight-sync receipt within 1830 s (rollout.weight_sync_timeout_s = 1800 s + 30 s); "
        "the run stops, as rollout.engine_restarts is 0 (a hung engine is not restarted). Raise "
        "rollout.engine_restarts"
    )
