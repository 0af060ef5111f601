"""`rl-launch ppo` against the real PPOConfig: help, --print-config, rejected configs, light imports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types

import msgspec
import pytest
import yaml

from rl_launch.cli import main
from rl_launch.config import PPOConfig
from rl_launch.options import dump_config, iter_options, load_config

# A complete configuration without a preset, so the tests need no preset build.
NO_PRESET = ["--preset", "none", "--model.pretrain", "some/model", "--data.prompt_data", "prompts.jsonl"]
HEAVY_MODULES = ("ray", "vllm", "deepspeed", "transformers")


def expected_default(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) if value else "[]"
    return str(value)


def help_entries(text: str) -> dict[str, str]:
    """Option name -> its (whitespace-normalised) help entry, from argparse help output."""
    flat = " ".join(text.split())
    entries = {}
    for chunk in re.split(r"(?:^| )--", flat)[1:]:
        name, _, rest = chunk.partition(" ")
        entries[name] = rest
    return entries


def leaf_options():
    return [option for option in iter_options(PPOConfig) if not option.is_section]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rl_launch.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_ppo_help_lists_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["ppo", "--help"])
    assert exit_info.value.code == 0
    entries = help_entries(capsys.readouterr().out)
    for option in leaf_options():
        assert option.name in entries, option.name
        assert f"(default: {expected_default(option.default)})" in entries[option.name], option.name
    assert "{dr_grpo" not in entries["algo.advantage.estimator"]
    assert entries["train.zero_stage"].startswith("{0,1,2,3} DeepSpeed ZeRO stage")
    assert "~30% more compute" in entries["model.gradient_checkpointing"]


def test_ppo_help_as_a_module_subprocess():
    result = run_cli("ppo", "--help")
    assert result.returncode == 0, result.stderr
    entries = help_entries(result.stdout)
    assert entries["algo.advantage.estimator"].endswith("(default: gae)")
    assert (
        entries["ray.policy.num_actors"]
        == "INT Ray actors (data-parallel ranks) of this role. [>= 1] (default: 1)"
    )
    assert "ray.policy:" in result.stdout


def test_top_level_help_lists_subcommands_and_no_subcommand_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert re.search(r"^\s+ppo\s+Train a policy", capsys.readouterr().out, re.M)
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_print_config_shows_overrides_and_round_trips(capsys, tmp_path):
    code = main(
        [
            "ppo",
            *NO_PRESET,
            "--print-config",
            "--algo.advantage.estimator",
            "grpo",
            "--train.adam_betas",
            "0.8,0.99",
            "--ray.policy.num_actors",
            "2",
            "--ckpt.load_checkpoint",
            "false",
            "--log.progress_bar",
            "off",
            "--train.zero_stage=3",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)
    assert printed["algo"]["advantage"]["estimator"] == "grpo"
    assert printed["train"]["adam_betas"] == [0.8, 0.99]
    assert printed["train"]["zero_stage"] == 3
    assert printed["ray"]["policy"]["num_actors"] == 2
    assert printed["ray"]["critic"]["num_actors"] == 1
    assert printed["ckpt"]["load_checkpoint"] is False
    assert printed["log"]["progress_bar"] is False
    assert printed["model"]["pretrain"] == "some/model"
    path = tmp_path / "printed.yaml"
    path.write_text(out)
    config = load_config(PPOConfig, str(path))
    assert config.train.adam_betas == (0.8, 0.99)
    # The printed file reproduces the same output.
    assert main(["ppo", "--config", str(path), "--print-config"]) == 0
    assert capsys.readouterr().out == out


def test_config_file_is_layered_under_command_line_options(capsys, tmp_path):
    path = tmp_path / "run.json"
    path.write_text(
        json.dumps(
            {
                "preset": "none",
                "model": {"pretrain": "file/model"},
                "data": {"prompt_data": "file.jsonl"},
                "train": {"max_steps": 7, "actor_learning_rate": 3e-6},
            }
        )
    )
    assert main(["ppo", "--config", str(path), "--train.max_steps", "9", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["max_steps"] == 9
    assert printed["train"]["actor_learning_rate"] == 3e-6
    assert printed["model"]["pretrain"] == "file/model"
    assert printed["preset"] == "none"


def test_the_files_preset_is_used_and_the_flag_overrides_it(capsys, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: none\n")
    assert main(["ppo", "--config", str(path), "--print-config"]) == 2
    assert (
        "model.pretrain: None is required without a preset (or pass --preset arithmetic)"
        in capsys.readouterr().err
    )
    path.write_text("preset: arithmetic\nmodel:\n  pretrain: m\ndata:\n  prompt_data: d\n")
    assert main(["ppo", "--config", str(path), "--preset", "none", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["preset"] == "none"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--algo.advantage.estimator", "bogus"],
            "algo.advantage.estimator: 'bogus' is not one of dr_grpo, flash_reinforce, gae, ",
        ),
        (
            ["--algo.advantage.estimatr", "grpo"],
            "algo.advantage.estimatr: unknown option; allowed: estimator, options (did you mean estimator?)",
        ),
        (
            ["--algo.advantge.estimator", "grpo"],
            "algo.advantge: unknown option; allowed: advantage, kl, policy, distill, value_clip (did you mean advantage?)",
        ),
        (["--train.max_norm", "abc"], "train.max_norm: expected float, got 'abc'"),
        (["--ray.device", "gpu"], "ray.device: 'gpu' is not one of auto, cpu, cuda"),
        (["--ray.critic.num_actors", "0"], "ray.critic.num_actors: 0 must be >= 1"),
        (["--train.zero_stage", "4"], "train.zero_stage: '4' is not one of 0, 1, 2, 3"),
        (
            [
                "--rollout.rollout_batch_size",
                "4",
                "--rollout.n_samples_per_prompt",
                "2",
                "--train.train_batch_size",
                "3",
            ],
            "train.train_batch_size: 3 must divide rollout.rollout_batch_size x rollout.n_samples_per_prompt = 8",
        ),
        (["--preset", "cooking"], "preset: 'cooking' is not one of auto, arithmetic, colours, none"),
        (["--algo", "x"], "algo: is a section, not an option"),
    ],
)
def test_bad_options_exit_2_with_a_clear_message(capsys, args, message):
    assert main(["ppo", *NO_PRESET, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"rl-launch ppo: error: {message}")
    assert len(captured.err.strip().splitlines()) == 1


def test_preset_none_without_a_model_is_rejected(capsys):
    assert main(["ppo", "--preset", "none", "--data.prompt_data", "d.jsonl"]) == 2
    assert (
        capsys.readouterr().err
        == "rl-launch ppo: error: model.pretrain: None is required without a preset (or pass --preset arithmetic)\n"
    )


def test_bad_config_files_are_rejected(capsys, tmp_path):
    missing = tmp_path / "missing.yaml"
    assert main(["ppo", "--config", str(missing)]) == 2
    assert capsys.readouterr().err == f"rl-launch ppo: error: config file {missing}: not found\n"
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("preset: none\ntrain:\n  max_setps: 3\n")
    assert main(["ppo", "--config", str(unknown)]) == 2
    assert "train.max_setps: unknown option; allowed: max_steps, " in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("preset: none\nmodel: {pretrain: m\n")
    assert main(["ppo", "--config", str(broken)]) == 2
    assert f"config file {broken}, line 3" in capsys.readouterr().err


def test_a_missing_option_value_is_an_argparse_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["ppo", "--train.max_norm"])
    assert exit_info.value.code == 2
    assert "argument --train.max_norm: expected one argument" in capsys.readouterr().err


def test_parsing_and_errors_import_no_heavy_module():
    script = (
        "import sys, io, contextlib\n"
        "from rl_launch.cli import main\n"
        f"args = {NO_PRESET!r}\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    codes = [main(['ppo', *args, '--print-config']), main(['ppo', *args, '--train.max_norm', 'x'])]\n"
        f"heavy = sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules)\n"
        "print(codes, heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[0, 2] []"


def install_fake_run(monkeypatch, run) -> None:
    module = types.ModuleType("rl_launch.ppo")
    module.run = run
    monkeypatch.setitem(sys.modules, "rl_launch.ppo", module)


def test_the_run_gets_the_resolved_config_and_its_exit_code_is_returned(monkeypatch):
    received = []

    def run(config):
        received.append(config)
        return 3

    install_fake_run(monkeypatch, run)
    assert main(["ppo", *NO_PRESET, "--train.max_steps", "5"]) == 3
    (config,) = received
    assert isinstance(config, PPOConfig)
    assert config.train.max_steps == 5


def test_keyboard_interrupt_exits_130(monkeypatch, capsys):
    def run(config):
        raise KeyboardInterrupt

    install_fake_run(monkeypatch, run)
    assert main(["ppo", *NO_PRESET]) == 130
    assert "interrupted" in capsys.readouterr().err


def _has_preset_settings() -> bool:
    try:
        from rl_launch import presets
    except ImportError:
        return False
    return hasattr(presets, "preset_settings")


@pytest.mark.skipif(not _has_preset_settings(), reason="rl_launch.presets.preset_settings is not there yet")
def test_default_preset_settings_sit_under_the_command_line(capsys):
    from rl_launch.presets import preset_settings

    assert main(["ppo", "--print-config", "--train.max_steps", "11"]) == 0
    printed = capsys.readouterr().out
    expected = load_config(
        PPOConfig,
        overrides={"train.max_steps": "11", "preset": "arithmetic"},
        base=preset_settings("arithmetic"),
    )
    assert printed == dump_config(expected)
    assert yaml.safe_load(printed)["preset"] == "arithmetic"


def test_a_run_that_names_its_own_model_or_data_gets_nothing_from_the_preset(capsys, tmp_path):
    defaults = msgspec.convert(
        {"preset": "none", "model": {"pretrain": "m"}, "data": {"prompt_data": "d"}}, PPOConfig
    )
    for own in (["--model.pretrain", "m", "--data.prompt_data", "d"],):
        assert main(["ppo", *own, "--print-config"]) == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        assert printed["preset"] == "none"
        assert printed == json.loads(
            msgspec.json.encode(defaults)
        )  # lr, lengths, steps, reward: all the defaults
    path = tmp_path / "run.yaml"
    path.write_text("data: {prompt_data: d}\n")  # named in the file: the same
    assert main(["ppo", "--config", str(path), "--model.pretrain", "m", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["preset"] == "none"
    assert main(["ppo", "--data.prompt_data", "d"]) == 2  # no preset to borrow a model from
    assert "model.pretrain: None is required without a preset" in capsys.readouterr().err
    # asking for the preset explicitly still layers it under one's own model
    assert main(["ppo", "--preset", "arithmetic", "--model.pretrain", "m", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["max_steps"] == 16
    assert printed["model"]["pretrain"] == "m"
    # no arguments at all: the demo
    assert main(["ppo", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["preset"] == "arithmetic"
