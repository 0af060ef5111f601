"""Role layout and colocation (`rl_launch.cluster.plan_roles`): which actors a run starts and where."""

from __future__ import annotations

import msgspec
import pytest

from rl_launch.cluster import _bundles, plan_roles
from rl_launch.config import ConfigError, PPOConfig


def _config(**sections) -> PPOConfig:
    return msgspec.convert(
        {"preset": "none", "model": {"pretrain": "m"}, "data": {"prompt_data": "d"}, **sections}, PPOConfig
    )


def test_grpo_without_kl_starts_only_the_policy_and_the_engines():
    config = _config(algo={"advantage": {"estimator": "grpo"}})
    assert [layout.role for layout in plan_roles(config, use_gpus=True)] == ["policy", "engine"]


def test_ppo_with_kl_and_a_reward_model_starts_every_role():
    config = _config(algo={"kl": {"init_kl_coef": 0.01}}, model={"pretrain": "m", "reward_pretrain": "r"})
    roles = {layout.role for layout in plan_roles(config, use_gpus=True)}
    assert roles == {"policy", "ref", "critic", "reward_model", "engine"}


def test_colocated_roles_share_one_group_and_split_each_bundle_gpu():
    config = _config(
        algo={"kl": {"init_kl_coef": 0.01}},
        ray={"colocate": "policy_ref", "policy": {"num_actors": 4}, "ref": {"num_actors": 4}},
        rollout={"num_engines": 2, "tensor_parallel_size": 2},
    )
    layouts = {layout.role: layout for layout in plan_roles(config, use_gpus=True)}
    assert layouts["policy"].group == layouts["ref"].group == "policy+ref"
    assert layouts["policy"].num_gpus == layouts["ref"].num_gpus == 0.5
    bundles = _bundles(list(layouts.values()))
    assert bundles["policy+ref"] == [{"CPU": 1.0, "GPU": 1.0}] * 4  # two roles on 4 GPUs, not 8
    assert bundles["engine"] == [{"CPU": 1.0, "GPU": 2.0}] * 2
    assert bundles["critic"] == [{"CPU": 1.0, "GPU": 1.0}]


def test_cpu_mode_asks_for_no_gpus():
    config = _config(ray={"colocate": "all"})
    assert all(layout.num_gpus == 0.0 for layout in plan_roles(config, use_gpus=False))


def test_colocated_roles_with_different_actor_counts_are_refused():
    config = _config(
        algo={"kl": {"init_kl_coef": 0.01}}, ray={"colocate": "policy_ref", "policy": {"num_actors": 2}}
    )
    with pytest.raises(ConfigError, match=r"ray.colocate: 'policy_ref' puts policy, ref on the same bundles"):
        plan_roles(config, use_gpus=True)


# --------------------------------------------------------------------------------------------
# Which cluster a run uses: ray.address, "local", or RAY_ADDRESS (what `ray job submit` sets)


def _resolved_address(capsys, monkeypatch, environ: str | None, *args: str) -> tuple[object, str]:
    """(ray.address of `rl-launch <args> --print-config`, its stderr) with RAY_ADDRESS = `environ`."""
    import yaml

    from rl_launch.cli import main

    if environ is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", environ)
    assert main([*args, "--print-config"]) == 0
    captured = capsys.readouterr()
    return yaml.safe_load(captured.out)["ray"]["address"], captured.err


@pytest.mark.parametrize("command", ["ppo", "sft"])
def test_a_run_joins_the_cluster_ray_address_names_and_says_so(command, capsys, monkeypatch):
    address, err = _resolved_address(capsys, monkeypatch, "10.0.0.1:6379", command)
    assert address == "10.0.0.1:6379"
    assert "ray.address 10.0.0.1:6379: from RAY_ADDRESS (ray job submit sets it" in err
    assert "--ray.address local starts a local Ray instead" in err


def test_ray_address_local_or_given_wins_over_ray_address_in_the_environment(capsys, monkeypatch, tmp_path):
    assert _resolved_address(capsys, monkeypatch, "10.0.0.1:6379", "ppo", "--ray.address", "local") == (
        None,
        "",
    )
    given = _resolved_address(capsys, monkeypatch, "10.0.0.1:6379", "ppo", "--ray.address", "10.0.0.2:6379")
    assert given == ("10.0.0.2:6379", "")
    config = tmp_path / "run.yaml"
    config.write_text("ray:\n  address: local\n")
    assert _resolved_address(capsys, monkeypatch, "10.0.0.1:6379", "ppo", "--config", str(config)) == (
        None,
        "",
    )
    assert _resolved_address(capsys, monkeypatch, None, "ppo") == (None, "")


@pytest.mark.parametrize("command", ["ppo", "sft"])
def test_a_session_folder_for_a_joined_cluster_is_refused_naming_both(command, capsys, monkeypatch):
    from rl_launch.cli import main

    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert main([command, "--ray.temp_dir", "/tmp/rlt-x", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "ray.temp_dir: '/tmp/rlt-x' is the session folder of a local Ray" in err
    assert "joins the cluster at ray.address '10.0.0.1:6379'" in err
    assert "--ray.address local" in err


def test_the_variables_a_submitted_job_sets_are_left_to_the_job():
    from rl_launch.cluster import ClusterError, forwarded_env

    environ = {"HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "HOME": "/root", "PYTHONPATH": "/src"}
    assert forwarded_env(environ) == {"HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": "/src"}
    job = '{"runtime_env": {"working_dir": "/w", "env_vars": {"HF_HUB_OFFLINE": "1", "OTHER": "x"}}}'
    submitted = {**environ, "RAY_JOB_CONFIG_JSON_ENV_VAR": job}
    assert forwarded_env(submitted) == {"DS_ACCELERATOR": "cpu", "PYTHONPATH": "/src"}
    assert forwarded_env(
        {**environ, "RAY_JOB_CONFIG_JSON_ENV_VAR": '{"runtime_env": null}'}
    ) == forwarded_env(environ)
    with pytest.raises(ClusterError, match="RAY_JOB_CONFIG_JSON_ENV_VAR is not the JSON job config"):
        forwarded_env({**environ, "RAY_JOB_CONFIG_JSON_ENV_VAR": "{not json"})


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed once the block ends: nothing listens there


def test_a_cluster_address_nothing_answers_at_is_refused_at_once():
    import socket

    from rl_launch.preflight import PreflightError, check_ray_address

    port = _closed_port()
    with pytest.raises(
        PreflightError, match=rf"ray.address 127.0.0.1:{port}: nothing accepts a connection there"
    ):
        check_ray_address(f"127.0.0.1:{port}")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_ray_address(f"127.0.0.1:{server.getsockname()[1]}")
    for left_to_ray in (None, "auto", "ray://127.0.0.1:1"):
        check_ray_address(left_to_ray)


@pytest.mark.parametrize("command", ["ppo", "sft"])
def test_a_run_refuses_a_dead_cluster_address_before_its_run_folder(command, tmp_path, capsys, in_process):
    from rl_launch.cli import main

    port = _closed_port()
    args = [command, "--ray.address", f"127.0.0.1:{port}", "--log.output_dir", str(tmp_path / "run")]
    if command == "sft":
        args += ["--ray.learner.num_actors", "2"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert f"ray.address 127.0.0.1:{port}: nothing accepts a connection there" in err
    assert not (tmp_path / "run").exists()
