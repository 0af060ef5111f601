"""rl-launch's former option names for the rollout correction (`algo.policy.is_correction*`),
rewritten with a note on the command line and in config files; no Ray. Format-1 run folders are
in test_runs.py."""

from __future__ import annotations

import pytest
import yaml

from rl_launch.cli import main
from rl_launch.former import expand_former_options, migrate_former_keys

BASE = ["--model.pretrain", "/m", "--data.prompt_data", "/d.jsonl", "--algo.advantage.estimator", "grpo"]


def test_former_flags_become_the_correction_and_its_options_in_place():
    argv, notes = expand_former_options(
        [
            "--train.max_steps",
            "3",
            "--algo.policy.is_correction",
            "tis",
            "--algo.policy.is_correction_level=sequence",
            "--algo.policy.is_correction_bounds",
            "0.5,2",
            "--seed",
            "1",
        ]
    )
    assert argv == [
        *("--train.max_steps", "3", "--algo.policy.correction", "tis"),
        *("--algo.policy.correction_options.level", "sequence"),
        *("--algo.policy.correction_options.low", "0.5", "--algo.policy.correction_options.high", "2.0"),
        *("--seed", "1"),
    ]
    assert notes == [
        "--algo.policy.is_correction tis → --algo.policy.correction tis",
        "--algo.policy.is_correction_level sequence → --algo.policy.correction_options.level sequence",
        "--algo.policy.is_correction_bounds 0.5,2 → --algo.policy.correction_options.low 0.5 "
        "--algo.policy.correction_options.high 2.0",
    ]


@pytest.mark.parametrize(
    ("former", "policy"),
    [
        ({"is_correction": "tis"}, {"correction": "tis"}),
        ({"is_correction": "truncate", "is_correction_level": "token"}, {"correction": "truncate"}),
        (
            {"is_correction": "mask", "is_correction_gating": "tv", "is_correction_bounds": [0.0, 0.1]},
            {"correction": "mask", "correction_options": {"gating": "tv", "low": 0.0, "high": 0.1}},
        ),
        (
            {
                "is_correction": "seq-mask",
                "is_correction_level": "sequence",
                "is_correction_bounds": [0.5, 2],
            },
            {"correction": "seq-mask", "correction_options": {"low": 0.5, "high": 2.0}},
        ),
        (
            # a format-1 run.json holds every key, at its default
            {
                "is_correction": "auto",
                "is_correction_level": "token",
                "is_correction_gating": "ratio",
                "is_correction_bounds": [0.5, 5.0],
            },
            {"correction": "auto"},
        ),
        ({"is_correction": "none", "is_correction_bounds": [0.1, 0.2]}, {"correction": "none"}),
        ({"is_correction_level": "geometric"}, {"correction_options": {"level": "geometric"}}),
    ],
)
def test_former_keys_of_a_nested_config_keep_what_ran(former, policy):
    migrated, notes = migrate_former_keys({"algo": {"policy": {"loss": "ppo", **former}}, "seed": 1})
    assert migrated == {"algo": {"policy": {"loss": "ppo", **policy}}, "seed": 1}
    assert len(notes) == len(former)


def test_former_and_current_name_together_are_refused():
    with pytest.raises(ValueError, match=r"give correction .* once, not both"):
        migrate_former_keys({"algo": {"policy": {"is_correction": "tis", "correction": "icepop"}}})


def test_former_flags_parse_with_the_real_parser_and_print_a_note(capsys):
    argv = ["--algo.policy.is_correction", "icepop", "--algo.policy.is_correction_bounds", "0.5,2"]
    assert main(["ppo", *BASE, *argv, "--print-config"]) == 0
    captured = capsys.readouterr()
    policy = yaml.safe_load(captured.out)["algo"]["policy"]
    assert (policy["correction"], policy["correction_options"]) == ("icepop", {"low": 0.5, "high": 2.0})
    assert (
        "rl-launch ppo: former option --algo.policy.is_correction icepop → --algo.policy.correction icepop"
        in (captured.err)
    )


def test_former_keys_in_a_config_file_are_rewritten_with_a_note(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(
        "algo:\n  policy:\n    is_correction: mask\n    is_correction_level: geometric\n"
        "    is_correction_bounds: [0.5, 2.0]\n"
    )
    assert main(["ppo", *BASE, "--config", str(path), "--print-config"]) == 0
    captured = capsys.readouterr()
    policy = yaml.safe_load(captured.out)["algo"]["policy"]
    assert policy["correction"] == "mask"
    assert policy["correction_options"] == {"level": "geometric", "low": 0.5, "high": 2.0}
    assert f"former option in {path}: algo.policy.is_correction 'mask'" in captured.err


def test_a_wrong_correction_option_fails_before_anything_starts_naming_the_key(capsys):
    argv = ["--algo.policy.correction", "seq-mask", "--algo.policy.correction_options.level", "token"]
    assert main(["ppo", *BASE, *argv, "--print-config"]) == 2
    assert (
        "algo.policy.correction_options.level: not an option of rollout correction 'seq-mask'; it takes high, low"
        in capsys.readouterr().err
    )
