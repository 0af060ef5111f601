"""One validation pass (`rl_launch.validation.prepare`): a config decodes without its plugins and
without any registry; the names of its components are checked once, after the plugins are
imported, naming the option, the given value and the registered names; `check_components` runs
once per command line; and a group estimator with the KL in the reward has one meaning whichever
spelling set the coefficient. Fast: no Ray, no model."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml

import rl_launch.cli
import rl_launch.components
from rl_algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, StraightThroughKL
from rl_launch.cli import main, resolve_ppo_config
from rl_launch.config import ConfigError
from rl_launch.validation import kl_in_reward_form, prepare

OWN = {"model.pretrain": "/models/never-loaded", "data.prompt_data": "/data/x.jsonl"}
NO_PRESET = ["--preset", "none", "--model.pretrain", OWN["model.pretrain"]]
NO_PRESET += ["--data.prompt_data", OWN["data.prompt_data"]]
PACKAGES = pathlib.Path(__file__).resolve().parents[2] / "packages"


def decoded(**overrides: str):
    return resolve_ppo_config(None, {**OWN, **{key.replace("__", "."): v for key, v in overrides.items()}})


# ---------------------------------------------------------------------------- decoding


def test_a_config_decodes_without_its_plugins_and_prepare_imports_them():
    names = {
        "algo.advantage.estimator": "plugin_only_estimator",
        "algo.policy.loss": "plugin_only_loss",
        "algo.policy.correction": "plugin_only_correction",
        "algo.kl.reward_estimator": "plugin_only_kl",
        "algo.kl.loss_estimator": "plugin_only_kl",
        "algo.distill.estimator": "plugin_only_kl",
        "model.teacher_pretrain": "/models/teacher",  # algo.distill needs a teacher
        "rollout.engine": "plugin_only_engine",
    }
    # a plugin that does not exist: decoding does not import it, so it cannot fail on it
    config = resolve_ppo_config(None, {**OWN, **names, "plugins": "no_such_plugin_module_43"})
    assert config.algo.advantage.estimator == "plugin_only_estimator"
    assert config.algo.policy.loss == "plugin_only_loss"
    assert config.rollout.engine == "plugin_only_engine"
    with pytest.raises(ConfigError, match=r"^plugins\[0\]: no_such_plugin_module_43: no module named"):
        prepare(config)


def _registered(names) -> str:
    return ", ".join(sorted(names))


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("algo.advantage.estimator", "bogus", lambda: _registered(ADVANTAGE_ESTIMATORS)),
        ("algo.policy.loss", "vanila", lambda: _registered(POLICY_LOSSES)),
        ("algo.kl.loss_estimator", "k4", lambda: _registered(KL_ESTIMATORS)),
        ("algo.distill.estimator", "k4", lambda: _registered(KL_ESTIMATORS)),
        (
            "algo.kl.reward_estimator",
            "k3+",  # no straight-through variant in a reward, which carries no gradient
            lambda: _registered(n for n, e in KL_ESTIMATORS.items() if not isinstance(e, StraightThroughKL)),
        ),
    ],
)
def test_prepare_names_the_option_the_given_value_and_the_registered_names(key, value, allowed):
    teacher = {"model.teacher_pretrain": "/models/teacher"} if key.startswith("algo.distill") else {}
    config = decoded(**{key: value}, **teacher)  # decodes: no registry consulted
    with pytest.raises(ConfigError) as refused:
        prepare(config)
    assert str(refused.value) == f"{key}: {value!r} is not one of {allowed()}"


def test_a_bad_correction_name_lists_auto_none_and_the_registered_ones():
    with pytest.raises(
        ConfigError, match=r"^algo\.policy\.correction: 'tiss' is not one of auto, none, icepop, "
    ):
        prepare(decoded(algo__policy__correction="tiss"))


def test_registry_dependent_combinations_are_checked_in_the_pass():
    # whether the run has a critic is the estimator's to say: checked after decoding
    config = decoded(**{"algo.advantage.estimator": "grpo", "train.critic_warmup_steps": "2"})
    with pytest.raises(ConfigError, match=r"^train\.critic_warmup_steps: 2 needs a critic, and .* grpo"):
        prepare(config)
    sp = {"model.sequence_parallel_size": "2", "ray.policy.num_actors": "2"}
    with pytest.raises(ConfigError, match=r"^ray\.critic\.num_actors: 1 must be a multiple of model\.seq"):
        prepare(decoded(**sp, **{"algo.advantage.estimator": "gae"}))
    prepare(decoded(**sp, **{"algo.advantage.estimator": "grpo"}))  # no critic, nothing to split


def test_the_trained_learners_own_checks_run_in_the_pass():
    # `Positive` admits inf: rl-learner's OptimizerConfig refuses it, here and not after Ray starts
    muon = {"train.actor_optimizer": "muon", "train.actor_muon_learning_rate": "1e400"}
    with pytest.raises(
        ConfigError, match=r"^train \(actor learner\): OptimizerConfig\.muon_lr: inf is not a finite"
    ):
        prepare(decoded(**muon))
    critic = {"algo.advantage.estimator": "gae", "train.critic_learning_rate": "1e400"}
    with pytest.raises(
        ConfigError, match=r"^train \(critic learner\): OptimizerConfig\.lr: inf is not a finite"
    ):
        prepare(decoded(**critic))
    prepare(decoded(**{**critic, "algo.advantage.estimator": "grpo"}))  # no critic is trained


# ---------------------------------------------------------------------------- one check pass


def _count_checks(monkeypatch) -> list[object]:
    calls: list[object] = []
    real = rl_launch.components.check_components

    def counting(config):
        calls.append(config)
        return real(config)

    monkeypatch.setattr(rl_launch.components, "check_components", counting)
    return calls


def test_the_command_line_checks_the_components_once_for_print_config_and_for_a_run(monkeypatch, capsys):
    calls = _count_checks(monkeypatch)
    assert main(["ppo", *NO_PRESET, "--print-config"]) == 0
    assert len(calls) == 1
    ran: list[object] = []
    monkeypatch.setattr(rl_launch.cli, "_run_ppo", lambda config: ran.append(config) or 0)
    assert main(["ppo", *NO_PRESET]) == 0
    assert len(calls) == 2
    assert ran == [calls[1]]  # the run gets the config checked, unchanged
    capsys.readouterr()


def test_check_components_has_one_call_site_in_the_packages():
    sites = [
        f"{path.relative_to(PACKAGES)}:{number}"
        for path in PACKAGES.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if re.search(r"(?<!def )\bcheck_components\(", line)
    ]
    assert sites == ["rl-launch/src/rl_launch/validation.py:" + sites[0].rsplit(":", 1)[1]], sites


# ---------------------------------------------------------------------------- one meaning


def test_both_spellings_of_the_kl_coefficient_give_one_config_with_a_note(capsys, tmp_path):
    estimator = "group_norm"
    common = [*NO_PRESET, "--algo.advantage.estimator", estimator]
    spelled = {
        "openrlhf": [*common, "--algo.kl.init_coef", "0.01"],
        "own": [*common, "--algo.kl.init_kl_coef", "0.01"],
    }
    path = tmp_path / "run.yaml"
    path.write_text("algo:\n  kl:\n    init_kl_coef: 0.01\n")
    spelled["file"] = [*common, "--config", str(path)]
    outputs = {}
    for name, argv in spelled.items():
        assert main(["ppo", *argv, "--print-config"]) == 0, name
        captured = capsys.readouterr()
        outputs[name] = yaml.safe_load(captured.out)
        assert (
            f"rl-launch ppo: algo.advantage.estimator {estimator} with the KL in the reward "
            "(algo.kl.init_kl_coef 0.01, algo.kl.use_kl_loss false) runs as algo.advantage.estimator "
            f"group_reward_to_go with algo.advantage.options.preset {estimator}"
        ) in captured.err, name
    assert outputs["openrlhf"] == outputs["own"] == outputs["file"]
    advantage = outputs["own"]["algo"]["advantage"]
    assert (advantage["estimator"], advantage["options"]) == ("group_reward_to_go", {"preset": estimator})


@pytest.mark.parametrize("estimator", ["group_norm", "rloo", "dr_grpo"])
def test_a_group_estimator_with_the_kl_in_the_reward_is_its_reward_to_go_form(estimator):
    config, note = kl_in_reward_form(
        decoded(**{"algo.advantage.estimator": estimator, "algo.kl.init_kl_coef": "0.01"})
    )
    assert (config.algo.advantage.estimator, config.algo.advantage.options) == (
        "group_reward_to_go",
        {"preset": estimator},
    )
    assert f"algo.advantage.options.preset {estimator}" in (note or "")
    assert prepare(config, say=pytest.fail) == config  # its own form passes the checks, no second note


def test_without_the_kl_in_the_reward_a_group_estimator_stays_as_given_without_a_note():
    for overrides in ({}, {"algo.kl.init_kl_coef": "0.01", "algo.kl.use_kl_loss": "true"}):
        config = decoded(**{"algo.advantage.estimator": "rloo", **overrides})
        assert kl_in_reward_form(config) == (config, None)
    config = decoded(**{"algo.advantage.estimator": "grpo", "algo.kl.init_kl_coef": "0.01"})
    assert kl_in_reward_form(config) == (config, None)  # rl-launch's grpo: refused by the KL check


def test_an_option_the_preset_would_replace_is_refused_not_overridden():
    config = decoded(
        **{
            "algo.advantage.estimator": "group_norm",
            "algo.kl.init_kl_coef": "0.01",
            "algo.advantage.options.epsilon": "1e-6",
        }
    )
    with pytest.raises(
        ConfigError, match=r"^algo\.advantage\.options\.epsilon: 1e-06 cannot be combined with"
    ):
        kl_in_reward_form(config)
    kept = decoded(
        **{
            "algo.advantage.estimator": "group_norm",
            "algo.kl.init_kl_coef": "0.01",
            "algo.advantage.options.singleton": "raw",
        }
    )
    translated, _ = kl_in_reward_form(kept)
    assert translated.algo.advantage.options == {"singleton": "raw", "preset": "group_norm"}
