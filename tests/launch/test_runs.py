"""rl_launch.runs: one run per folder, explicit resume with a compatible configuration, and only
from checkpoints the run wrote itself (checked from training_state.json, without loading them)."""

from __future__ import annotations

import copy
import json

import msgspec
import pytest

from rl_launch import runs
from rl_launch.runs import (
    ABSENT,
    RESUMABLE_KEYS,
    RunFolderError,
    checkpoint_extra,
    config_differences,
    config_fingerprint,
    is_resumable,
    prepare_run_folder,
    read_run_manifest,
    select_checkpoint,
)
from rl_learner.checkpoint import CHECKPOINT_FORMAT, Manifest, TrainingState

CONFIG = {
    "preset": "arithmetic",
    "algo": {"advantage": {"estimator": "gae", "gamma": 1.0}, "value_clip": 0.5},
    "train": {"max_steps": 10, "actor_learning_rate": 1e-6, "adam_betas": [0.9, 0.95]},
    "ray": {"address": None, "num_cpus": None, "policy": {"num_actors": 1}},
    "ckpt": {"path": None, "save_steps": 2, "load_checkpoint": False},
    "log": {"output_dir": "runs/a", "progress_bar": True},
}
ROLES = ["policy", "critic"]


def changed(config: dict, **dotted) -> dict:
    """A deep copy of `config` with dotted keys set (`algo__advantage__estimator="grpo"`)."""
    config = copy.deepcopy(config)
    for key, value in dotted.items():
        *parents, leaf = key.split("__")
        section = config
        for name in parents:
            section = section[name]
        section[leaf] = value
    return config


def write_checkpoint(ckpt_root, role: str, step: int, *, extra: dict | None, manifest: bool = True):
    """A checkpoint folder as rl_learner.save_checkpoint leaves it, minus the engines' files."""
    folder = ckpt_root / role / f"step_{step:08d}"
    folder.mkdir(parents=True)
    state = TrainingState(step=step, extra={} if extra is None else extra)
    (folder / "training_state.json").write_bytes(msgspec.json.encode(state))
    if manifest:
        written = Manifest(
            format=CHECKPOINT_FORMAT,
            tag=folder.name,
            step=step,
            sequence=step,
            saved_at=0.0,
            world_size=1,
            engines={},
            files=[],
        )
        (folder / "manifest.json").write_bytes(msgspec.json.encode(written))
    return folder


def prepare(output_dir, config, *, resume, ckpt_root=None, roles=ROLES):
    return prepare_run_folder(
        output_dir,
        config,
        resume=resume,
        ckpt_root=output_dir / "checkpoints" if ckpt_root is None else ckpt_root,
        roles=roles,
    )


def started_run(tmp_path, config=CONFIG, steps=(2, 4), roles=ROLES):
    """A run folder after a run saved checkpoints at `steps` for `roles` and logged metrics up to the last."""
    output_dir = tmp_path / "run"
    plan = prepare(output_dir, config, resume=False)
    for step in steps:
        for role in roles:
            write_checkpoint(plan.ckpt_root, role, step, extra={"kl_coef": 0.1, **checkpoint_extra(plan)})
    last = max(steps, default=0)
    (output_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": step, "time": 1.0}) + "\n" for step in range(1, last + 2))
    )
    return output_dir, plan


# ----------------------------------------------------------------------------------------------
# Configurations


def test_fingerprint_is_stable_under_resumable_changes():
    resumable = changed(
        CONFIG,
        train__max_steps=500,
        log__output_dir="elsewhere",
        log__progress_bar=False,
        ray__address="auto",
        ckpt__save_steps=10,
        ckpt__load_checkpoint=True,
    )
    resumable["log"]["use_wandb"] = True  # a new key under a resumable section
    assert config_differences(CONFIG, resumable) == []
    assert config_fingerprint(resumable) == config_fingerprint(CONFIG)


@pytest.mark.parametrize(
    "dotted",
    [
        {"algo__advantage__estimator": "grpo"},
        {"train__actor_learning_rate": 2e-6},
        {"ray__policy__num_actors": 2},
        {"ckpt__path": "/elsewhere"},
        {"train__adam_betas": [0.9, 0.99]},
        {"algo__value_clip": 1},  # 0.5 -> 1: an int where a float was
    ],
)
def test_fingerprint_differs_when_a_non_resumable_key_changes(dotted):
    other = changed(CONFIG, **dotted)
    assert config_fingerprint(other) != config_fingerprint(CONFIG)
    assert config_differences(CONFIG, other)


def test_values_compare_as_json_so_int_and_float_or_bool_differ_and_tuples_equal_lists():
    assert config_differences({"a": 1}, {"a": 1.0}) == [("a", 1, 1.0)]
    assert config_differences({"a": True}, {"a": 1}) == [("a", True, 1)]
    assert config_differences({"a": [0.9, 0.95]}, {"a": (0.9, 0.95)}) == []
    assert config_fingerprint({"a": [0.9, 0.95]}) == config_fingerprint({"a": (0.9, 0.95)})


def test_config_differences_names_dotted_keys_and_marks_keys_present_on_one_side_only():
    saved = {"algo": {"advantage": {"estimator": "gae", "lambd": 0.95}}, "log": {"x": 1}}
    current = {"algo": {"advantage": {"estimator": "grpo"}, "new_option": 3}, "log": {"x": 2}}
    assert config_differences(saved, current) == [
        ("algo.advantage.estimator", "gae", "grpo"),
        ("algo.advantage.lambd", 0.95, ABSENT),
        ("algo.new_option", ABSENT, 3),
    ]
    assert repr(ABSENT) == "<absent>"
    # An option added to an empty options dict is that option, not the dict.
    assert config_differences({"policy": {"options": {}}}, {"policy": {"options": {"eps": 0.3}}}) == [
        ("policy.options.eps", ABSENT, 0.3)
    ]
    assert config_fingerprint(saved) != config_fingerprint(current)


def test_resumable_keys_match_whole_names_only():
    assert is_resumable("log")
    assert is_resumable("log.output_dir")
    assert is_resumable("ray.address")
    assert is_resumable("train.max_steps")
    assert not is_resumable("logging.level")
    assert not is_resumable("ray.policy.num_actors")
    assert not is_resumable("train.max_steps_per_epoch")
    assert not is_resumable("ckpt.path")


def test_every_resumable_key_names_a_field_of_ppo_config():
    from rl_launch.config import PPOConfig

    tree = msgspec.to_builtins(PPOConfig(preset="arithmetic"))
    for key in RESUMABLE_KEYS:
        node = tree
        for name in key.split("."):
            assert name in (node if isinstance(node, dict) else {}), f"{key} is not a field of PPOConfig"
            node = node[name]


def test_ppo_config_fingerprint_follows_resumable_and_algorithm_changes():
    from rl_launch.config import AdvantageConfig, PPOConfig, TrainConfig

    base = PPOConfig(preset="arithmetic")
    longer = msgspec.structs.replace(base, train=TrainConfig(max_steps=base.train.max_steps * 2))
    other_estimator = msgspec.structs.replace(
        base, algo=msgspec.structs.replace(base.algo, advantage=AdvantageConfig(estimator="grpo"))
    )
    fingerprint = config_fingerprint(msgspec.to_builtins(base))
    assert config_fingerprint(msgspec.to_builtins(longer)) == fingerprint
    assert config_fingerprint(msgspec.to_builtins(other_estimator)) != fingerprint


# ----------------------------------------------------------------------------------------------
# Fresh runs


def test_fresh_run_in_a_missing_folder_writes_run_json(tmp_path):
    output_dir = tmp_path / "new" / "run"
    plan = prepare(output_dir, CONFIG, resume=False)
    manifest = read_run_manifest(output_dir)
    assert manifest is not None
    assert (plan.run_id, plan.fingerprint) == (manifest.run_id, manifest.fingerprint)
    assert len(plan.run_id) == 32
    assert int(plan.run_id, 16) >= 0
    assert manifest.config == CONFIG
    assert manifest.fingerprint == config_fingerprint(CONFIG)
    assert manifest.version == runs.__version__
    assert manifest.resumes == []
    assert (plan.resume, plan.step, plan.checkpoints) == (False, 0, {})
    assert plan.output_dir == output_dir
    assert plan.output_dir.is_absolute()
    assert checkpoint_extra(plan) == {"run_id": plan.run_id, "config_fingerprint": plan.fingerprint}


def test_fresh_run_in_an_empty_folder_is_fine(tmp_path):
    (tmp_path / "run" / "checkpoints" / "policy").mkdir(parents=True)  # empty folders hold no run
    plan = prepare(tmp_path / "run", CONFIG, resume=False)
    assert not plan.resume


def test_starting_a_run_twice_is_refused_with_both_ways_out(tmp_path):
    output_dir, first = started_run(tmp_path)
    before = (output_dir / "run.json").read_bytes()
    with pytest.raises(RunFolderError) as caught:
        prepare(output_dir, CONFIG, resume=False)
    message = str(caught.value)
    assert str(output_dir) in message
    assert "last step 5" in message  # metrics.jsonl
    assert first.run_id[:8] in message  # run.json
    assert "policy at step 4" in message  # checkpoints
    assert "--ckpt.load_checkpoint true" in message
    assert "--log.output_dir" in message
    assert (output_dir / "run.json").read_bytes() == before


@pytest.mark.parametrize("leftover", ["metrics.jsonl", "config.yaml", "run.json"])
def test_fresh_run_refuses_a_folder_with_any_output_of_a_run(tmp_path, leftover):
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    (output_dir / leftover).write_text('{"step": 1}\n' if leftover == "metrics.jsonl" else "{}")
    with pytest.raises(RunFolderError, match=leftover):
        prepare(output_dir, CONFIG, resume=False)


def test_fresh_run_refuses_a_checkpoint_folder_outside_the_run_folder_that_holds_files(tmp_path):
    shared = tmp_path / "shared-checkpoints"
    write_checkpoint(shared, "policy", 3, extra={"run_id": "someone-else"})
    with pytest.raises(RunFolderError, match="policy at step 3"):
        prepare(tmp_path / "run", CONFIG, resume=False, ckpt_root=shared)
    assert not (tmp_path / "run" / "run.json").exists()


def test_exclusive_run_manifest_write_refuses_an_existing_one(tmp_path):
    plan = prepare(tmp_path / "run", CONFIG, resume=False)
    manifest = read_run_manifest(tmp_path / "run")
    other = msgspec.structs.replace(manifest, run_id="f" * 32)
    with pytest.raises(RunFolderError, match="another run is starting"):
        runs.write_run_manifest(tmp_path / "run", other, exclusive=True)
    assert read_run_manifest(tmp_path / "run").run_id == plan.run_id
    assert [path.name for path in (tmp_path / "run").iterdir()] == ["run.json"]  # no temporary left


def test_unreadable_run_json_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{not json")
    with pytest.raises(RunFolderError, match=r"run\.json is not a valid run manifest"):
        prepare(tmp_path / "run", CONFIG, resume=True)
    (tmp_path / "run" / "run.json").write_text('{"run_id": 3}')
    with pytest.raises(RunFolderError, match=str(tmp_path / "run" / "run.json")):
        read_run_manifest(tmp_path / "run")


# ----------------------------------------------------------------------------------------------
# Resume


def test_resume_on_an_empty_folder_starts_fresh(tmp_path):
    output_dir = tmp_path / "run"
    plan = prepare(output_dir, CONFIG, resume=True)
    assert (plan.resume, plan.step, plan.checkpoints) == (False, 0, {})
    assert plan.message == f"no checkpoint in {output_dir / 'checkpoints'}: starting at step 0"
    assert read_run_manifest(output_dir).run_id == plan.run_id


def test_resume_continues_from_the_newest_checkpoint_with_changed_resumable_keys(tmp_path):
    output_dir, first = started_run(tmp_path)
    created = read_run_manifest(output_dir).created
    longer = changed(CONFIG, train__max_steps=20, log__progress_bar=False, ckpt__load_checkpoint=True)
    plan = prepare(output_dir, longer, resume=True)
    assert plan.resume
    assert plan.step == 4
    assert (plan.run_id, plan.fingerprint) == (first.run_id, first.fingerprint)
    assert plan.checkpoints == {role: output_dir / "checkpoints" / role / "step_00000004" for role in ROLES}
    assert plan.message == f"resuming run {first.run_id[:8]} from step 4: {output_dir / 'checkpoints'}"
    assert ("train.max_steps", 10, 20) in plan.changes
    manifest = read_run_manifest(output_dir)
    assert (manifest.run_id, manifest.created) == (first.run_id, created)
    assert manifest.config == longer
    assert len(manifest.resumes) == 1
    assert manifest.resumes[0].step == 4
    assert manifest.resumes[0].changed["train.max_steps"] == [10, 20]
    # A second resume appends, and still accepts the checkpoints (same fingerprint).
    prepare(output_dir, longer, resume=True)
    assert len(read_run_manifest(output_dir).resumes) == 2


def test_resume_with_a_changed_estimator_is_refused_naming_the_key_and_values(tmp_path):
    output_dir, _ = started_run(tmp_path)
    before = (output_dir / "run.json").read_bytes()
    other = changed(CONFIG, algo__advantage__estimator="grpo", train__actor_learning_rate=3e-6)
    with pytest.raises(RunFolderError) as caught:
        prepare(output_dir, other, resume=True)
    message = str(caught.value)
    assert "algo.advantage.estimator: 'gae' -> 'grpo'" in message
    assert "train.actor_learning_rate: 1e-06 -> 3e-06" in message
    assert "--log.output_dir" in message
    assert "train.max_steps" in message  # what may change
    assert (output_dir / "run.json").read_bytes() == before


def test_resume_refuses_a_checkpoint_written_by_another_run(tmp_path):
    output_dir, _ = started_run(tmp_path)
    foreign = write_checkpoint(
        output_dir / "checkpoints",
        "critic",
        6,
        extra={"run_id": "0" * 32, "config_fingerprint": config_fingerprint(CONFIG)},
    )
    write_checkpoint(output_dir / "checkpoints", "policy", 6, extra=checkpoint_extra_of(output_dir))
    with pytest.raises(RunFolderError) as caught:
        prepare(output_dir, CONFIG, resume=True)
    message = str(caught.value)
    assert str(foreign) in message
    assert "0" * 32 in message
    assert "only checkpoints it wrote" in message
    assert "pickles" in message


def test_resume_refuses_a_checkpoint_that_names_no_run(tmp_path):
    output_dir, _ = started_run(tmp_path)
    bare = write_checkpoint(output_dir / "checkpoints", "policy", 1, extra=None)
    with pytest.raises(RunFolderError, match=f"checkpoint {bare} does not name the run"):
        prepare(output_dir, CONFIG, resume=True)


def test_resume_refuses_a_checkpoint_of_this_run_under_another_fingerprint(tmp_path):
    output_dir, first = started_run(tmp_path)
    write_checkpoint(
        output_dir / "checkpoints",
        "policy",
        8,
        extra={"run_id": first.run_id, "config_fingerprint": "ab" * 32},
    )
    with pytest.raises(RunFolderError, match="under another configuration"):
        prepare(output_dir, CONFIG, resume=True)


def test_resume_with_run_json_but_no_checkpoint_starts_again_under_the_same_run_id(tmp_path):
    output_dir, first = started_run(tmp_path, steps=())
    plan = prepare(output_dir, CONFIG, resume=True)
    assert (plan.resume, plan.step, plan.run_id) == (False, 0, first.run_id)
    assert "starting run" in plan.message
    assert "at step 0" in plan.message


def test_resume_without_run_json_refuses_the_outputs_of_an_unknown_run(tmp_path):
    output_dir, _ = started_run(tmp_path)
    (output_dir / "run.json").unlink()
    with pytest.raises(RunFolderError, match="nothing ties them to a run"):
        prepare(output_dir, CONFIG, resume=True)
    assert not (output_dir / "run.json").exists()


def test_resume_of_a_run_that_reached_max_steps_is_refused(tmp_path):
    output_dir, _ = started_run(tmp_path, steps=(10,))
    with pytest.raises(RunFolderError, match=r"nothing to train.*--train\.max_steps"):
        prepare(output_dir, CONFIG, resume=True)


# ----------------------------------------------------------------------------------------------
# Checkpoint selection


def checkpoint_extra_of(output_dir) -> dict:
    manifest = read_run_manifest(output_dir)
    return {"run_id": manifest.run_id, "config_fingerprint": manifest.fingerprint}


def test_the_newest_step_complete_for_every_role_is_chosen(tmp_path):
    root = tmp_path / "checkpoints"
    extra = {"run_id": "a" * 32, "config_fingerprint": "f" * 64}
    for step in (2, 4, 6):
        write_checkpoint(root, "policy", step, extra=extra)
    for step in (2, 4):
        write_checkpoint(root, "critic", step, extra=extra)
    write_checkpoint(root, "critic", 6, extra=extra, manifest=False)  # a save that did not finish
    (root / "critic" / ".tmp-step_00000008").mkdir()
    selected = select_checkpoint(root, ROLES, run_id="a" * 32, fingerprint="f" * 64)
    assert selected.step == 4
    assert selected.folders == {role: root.absolute() / role / "step_00000004" for role in ROLES}
    only_policy = select_checkpoint(root, ["policy"], run_id="a" * 32, fingerprint="f" * 64)
    assert only_policy.step == 6


def test_roles_without_a_common_step_are_refused(tmp_path):
    root = tmp_path / "checkpoints"
    extra = {"run_id": "a" * 32, "config_fingerprint": "f" * 64}
    write_checkpoint(root, "policy", 4, extra=extra)
    with pytest.raises(RunFolderError, match="policy: 4; critic: none"):
        select_checkpoint(root, ROLES, run_id="a" * 32, fingerprint="f" * 64)


def test_no_checkpoint_at_all_selects_nothing(tmp_path):
    assert select_checkpoint(tmp_path / "missing", ROLES, run_id="a", fingerprint="f") is None


# ----------------------------------------------------------------------------------------------
# Older run.json formats


def format_1_run(tmp_path, policy: dict, *, steps=(2, 4)):
    """A run folder as rl-launch wrote it before run format 2 (the correction in four keys), by hand."""
    output_dir = tmp_path / "run"
    output_dir.mkdir()
    old_config = changed(CONFIG)
    old_config["algo"]["policy"] = {"loss": "ppo", **policy}
    old_fingerprint = config_fingerprint(old_config)
    run_id = "c" * 32
    manifest = {
        "run_id": run_id,
        "created": "2025-01-01T00:00:00+00:00",
        "version": "0.1.0",
        "fingerprint": old_fingerprint,
        "config": old_config,
        "resumes": [],
        "format": 1,
    }
    (output_dir / "run.json").write_text(json.dumps(manifest, indent=2))
    for step in steps:
        for role in ROLES:
            write_checkpoint(
                output_dir / "checkpoints",
                role,
                step,
                extra={"run_id": run_id, "config_fingerprint": old_fingerprint},
            )
    return output_dir, old_fingerprint


FORMAT_1_POLICY = {
    "is_correction": "tis",
    "is_correction_level": "sequence",
    "is_correction_gating": "ratio",
    "is_correction_bounds": [0.5, 2.0],
}


def test_a_format_1_run_json_is_read_with_the_corrections_new_keys(tmp_path):
    output_dir, old_fingerprint = format_1_run(tmp_path, FORMAT_1_POLICY)
    manifest = read_run_manifest(output_dir)
    assert manifest.format == 1
    assert manifest.config["algo"]["policy"] == {
        "loss": "ppo",
        "correction": "tis",
        "correction_options": {"level": "sequence", "low": 0.5, "high": 2.0},
    }
    assert manifest.fingerprint == config_fingerprint(manifest.config)
    assert manifest.earlier_fingerprints == [old_fingerprint]


def test_a_format_1_run_folder_resumes_from_its_checkpoints_and_is_rewritten_as_format_2(tmp_path):
    output_dir, old_fingerprint = format_1_run(tmp_path, FORMAT_1_POLICY)
    current = changed(CONFIG, ckpt__load_checkpoint=True)
    current["algo"]["policy"] = {
        "loss": "ppo",
        "correction": "tis",
        "correction_options": {"level": "sequence", "low": 0.5, "high": 2.0},
    }
    plan = prepare(output_dir, current, resume=True)
    assert (plan.resume, plan.step, plan.run_id) == (True, 4, "c" * 32)
    assert plan.fingerprint == config_fingerprint(current)
    assert "run.json of format 1 read with its former option names" in plan.message
    written = json.loads((output_dir / "run.json").read_text())
    assert written["format"] == runs.RUN_FORMAT == 2
    assert written["earlier_fingerprints"] == [old_fingerprint]
    assert "is_correction" not in written["config"]["algo"]["policy"]
    # Resumed again before a new save: the old checkpoints are still this run's.
    again = prepare(output_dir, current, resume=True)
    assert (again.resume, again.step) == (True, 4)
    assert "format 1" not in again.message


def test_reading_a_format_1_run_json_does_not_import_the_openrlhf_table(tmp_path):
    import subprocess
    import sys

    output_dir, _ = format_1_run(tmp_path, FORMAT_1_POLICY)
    probe = (
        "import sys; from rl_launch.runs import read_run_manifest; "
        f"assert read_run_manifest({str(output_dir)!r}).format == 1; "
        "print('rl_launch.aliases' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_format_1_run_folder_refuses_another_correction_on_resume(tmp_path):
    output_dir, _ = format_1_run(tmp_path, FORMAT_1_POLICY)
    current = changed(CONFIG, ckpt__load_checkpoint=True)
    current["algo"]["policy"] = {"loss": "ppo", "correction": "tis", "correction_options": {}}
    with pytest.raises(RunFolderError, match=r"algo\.policy\.correction_options"):
        prepare(output_dir, current, resume=True)


def test_a_run_json_of_an_unknown_format_is_refused(tmp_path):
    output_dir, _ = format_1_run(tmp_path, FORMAT_1_POLICY, steps=())
    data = json.loads((output_dir / "run.json").read_text())
    (output_dir / "run.json").write_text(json.dumps({**data, "format": 9}))
    with pytest.raises(RunFolderError, match=r"has format 9; this rl-launch .* reads formats 1, 2"):
        read_run_manifest(output_dir)
