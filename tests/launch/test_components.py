"""Components of `rl-launch ppo` (no Ray): each found by name, each given its own config section
verbatim, an option it does not take refused with the dotted name, bad combinations refused
before anything starts, and the objective the learners get."""

from __future__ import annotations

import time

import pytest
import torch
import yaml

from rl_algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from rl_data import ExperienceBatch, Trajectory, build_experience
from rl_launch.algorithm import score_batch
from rl_launch.cli import main
from rl_launch.components import (
    ENGINES,
    REWARDS,
    check_components,
    describe_components,
    list_components,
)
from rl_launch.components.objective import old_logprobs_from_training, policy_loss_config
from rl_launch.components.weight_sync import SyncPlacement, choose_weight_sync
from rl_launch.config import ConfigError
from tests.launch.configs import ppo_config

BASE = {
    "model.pretrain": "/models/never-loaded",
    "data.prompt_data": "/data/never-read.jsonl",
    "algo.advantage.estimator": "grpo",
    "rollout.rollout_batch_size": "8",
    "rollout.n_samples_per_prompt": "4",
}


def config(**overrides: str):
    return ppo_config(BASE, **overrides)


def refused(pattern: str, **overrides: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        config(**overrides)


# ---------------------------------------------------------------------------- options verbatim


@pytest.mark.parametrize(
    ("loss", "options"),
    [
        ("ppo", {"epsilon_low": 0.1, "epsilon_high": 0.28, "dual_clip": 3.0}),
        ("gspo", {"epsilon_high": 5e-4}),
        ("sapo", {"tau_positive": 0.5, "tau_negative": 2.0}),
        ("clip_cov", {"clip_cov_ratio": 0.01}),
        ("kl_cov", {"kl_cov_ratio": 0.01, "ppo_kl_coef": 2.0}),
    ],
)
def test_the_loss_section_reaches_the_learner_verbatim(loss, options):
    overrides = {f"algo__policy__options__{key}": str(value) for key, value in options.items()}
    cfg = config(algo__policy__loss=loss, **overrides)
    learner = policy_loss_config(cfg, kl_coef=0.0)
    assert (learner.name, learner.options) == (loss, options)


def test_the_moe_aux_loss_coefficient_reaches_the_learner_and_is_off_by_default():
    assert policy_loss_config(config(), kl_coef=0.0).aux_loss_coef == 0.0
    assert policy_loss_config(config(algo__policy__aux_loss_coef="0.001"), kl_coef=0.0).aux_loss_coef == 0.001
    refused(r"algo\.policy\.aux_loss_coef", algo__policy__aux_loss_coef="-1")


@pytest.mark.parametrize("loss", ["gspo", "gmpo", "cispo", "sapo", "reinforce"])
def test_a_loss_without_options_runs_with_its_own_defaults(loss):
    # Nothing of another component (PPO's 0.2) is passed: GSPO keeps 3e-4 / 4e-4, GMPO 0.4, ...
    assert policy_loss_config(config(algo__policy__loss=loss), kl_coef=0.0).options == {}
    assert "loss sapo(tau_positive=1.0, tau_negative=1.05)," in describe_components(
        config(algo__policy__loss="sapo")
    )


def test_the_start_up_line_shows_each_component_with_the_options_it_runs_with():
    line = describe_components(config(algo__policy__loss="gspo", algo__policy__options__epsilon_high="5e-4"))
    assert "loss gspo(epsilon_low=0.0003, epsilon_high=0.0005)" in line
    line = describe_components(config(algo__advantage__estimator="gae"))
    assert "advantages gae(gamma=1.0, lam=1.0, whiten=True)" in line


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            {"algo__policy__loss": "gspo", "algo__policy__options__dual_clip": "3"},
            r"^algo\.policy\.options\.dual_clip: not an option of policy loss 'gspo'; it takes epsilon_high, epsilon_low$",
        ),
        (
            {"algo__policy__options__eps_clip": "0.2"},
            r"^algo\.policy\.options\.eps_clip: not an option of policy loss 'ppo'; it takes dual_clip, epsilon_high, epsilon_low$",
        ),
        (
            {"algo__advantage__options__gamma": "0.9"},
            r"^algo\.advantage\.options\.gamma: not an option of advantage estimator 'grpo'; it takes centre, "
            r"epsilon, preset, scale, singleton, unbiased$",
        ),
        (
            {"algo__advantage__estimator": "rloo", "algo__advantage__options__whiten": "true"},
            r"^algo\.advantage\.options\.whiten: not an option of advantage estimator 'rloo'; it takes singleton$",
        ),
        (
            {"algo__kl__loss_options__clamp": "3"},
            r"^algo\.kl\.loss_options\.clamp: not an option of KL penalty 'kl_penalty'; it takes importance_weight_cap, "
            r"log_ratio_clamp, unbiased_gradient, value_clamp \(did you mean value_clamp\?\)$",
        ),
        (
            {"algo__kl__reward_options__unbiased_gradient": "true"},
            r"^algo\.kl\.reward_options\.unbiased_gradient: not an option of KL penalty",
        ),
        (
            {"rollout__engine": "hf", "rollout__engine_options__max_batch": "8"},
            r"^rollout\.engine_options\.max_batch: not an option of rollout engine 'hf'; it takes .*max_batch_size",
        ),
    ],
)
def test_an_option_the_component_does_not_take_is_refused_naming_it(overrides, pattern):
    refused(pattern, **overrides)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            {"algo__policy__options__epsilon_low": "1.0"},
            r"^algo\.policy\.options: policy loss 'ppo' refused.*epsilon_low must be in \(0, 1\)",
        ),
        ({"algo__policy__options__dual_clip": "0.5"}, r"^algo\.policy\.options: .*dual_clip must be > 1"),
        (
            {"algo__advantage__options__singleton": "maybe"},
            r"^algo\.advantage\.options: advantage estimator 'grpo' refused",
        ),
        (
            {"algo__advantage__estimator": "gae", "algo__advantage__options__lam": "2"},
            r"^algo\.advantage\.options: .*lam",
        ),
        (
            {"algo__kl__loss_options__value_clamp": "-1"},
            r"^algo\.kl\.loss_options: KL estimator 'k3' refused",
        ),
    ],
)
def test_a_bad_option_value_fails_in_the_dry_run_with_the_section_name(overrides, pattern):
    refused(pattern, **overrides)


# ---------------------------------------------------------------------------- combinations


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            {
                "algo__kl__init_kl_coef": "0.01",
                "algo__kl__use_kl_loss": "true",
                "algo__kl__loss_estimator": "k1",
            },
            r"^algo\.kl\.loss_estimator: 'k1' as a loss term has zero expected gradient; use 'k3' or 'low_var_kl'",
        ),
        (
            {"algo__kl__kl_target": "0.1"},
            r"^algo\.kl\.kl_target: 0\.1 needs algo\.kl\.init_kl_coef > 0",
        ),
        (
            {"algo__kl__init_kl_coef": "0.01"},
            r"^algo\.kl\.init_kl_coef: 0\.01 puts the KL into the reward, but estimator 'grpo'",
        ),
        (
            {"algo__advantage__estimator": "remax", "model__reward_pretrain": "/rm"},
            r"^algo\.advantage\.estimator: 'remax' takes the rule / remote reward of a greedy answer",
        ),
        (
            {"algo__policy__correction": "truncate", "algo__policy__correction_options__gating": "binary_kl"},
            r"^algo\.policy\.correction_options\.gating: not an option of rollout correction 'truncate'; "
            r"it takes high, level, low",
        ),
        (
            {"algo__policy__correction": "mask", "algo__policy__correction_options__gating": "tv"},
            r"^algo\.policy\.correction_options: rollout correction 'mask' refused its options: .*upper bound only",
        ),
        (
            {"algo__policy__correction": "none", "algo__policy__correction_options__low": "0.1"},
            r"^algo\.policy\.correction_options: .* given, but algo\.policy\.correction is none",
        ),
        ({"rollout__engine": "sglang"}, r"^rollout\.engine: 'sglang' is not one of hf, http, vllm"),
        ({"reward__function": "made_up"}, r"^reward\.function: 'made_up' is neither a registered reward"),
    ],
)
def test_combinations_that_cannot_work_fail_before_anything_starts(overrides, pattern):
    refused(pattern, **overrides)


@pytest.mark.parametrize("name", ["k1", "kl"])
def test_k1_as_a_loss_is_refused_under_either_name_but_its_plus_variant_is_not(name):
    loss_kl = {"algo__kl__init_kl_coef": "0.01", "algo__kl__use_kl_loss": "true"}
    refused(r"zero expected gradient", **loss_kl, algo__kl__loss_estimator=name)
    assert policy_loss_config(
        config(**loss_kl, algo__kl__loss_estimator=f"{name}+"), kl_coef=0.01
    ).kl_estimator == (f"{name}+")


def test_a_plus_variant_is_refused_in_the_reward_which_has_no_gradient():
    refused(r"^algo\.kl\.reward_estimator: 'k3\+' is not one of", algo__kl__reward_estimator="k3+")


@pytest.mark.parametrize(
    ("overrides", "correction", "options"),
    [
        ({}, "none", {}),
        ({"rollout__async_train": "true"}, "tis", {}),
        ({"rollout__async_train": "true", "algo__policy__correction_options__high": "2"}, "tis", {"high": 2}),
        (
            {"algo__policy__correction_options__high": "2"},
            "none",
            {},
        ),  # auto picked none: tis's options unused
        (
            {"algo__policy__correction": "icepop", "algo__policy__correction_options__level": "sequence"},
            "icepop",
            {"level": "sequence"},
        ),
        ({"algo__policy__correction": "seq-mask-tis"}, "seq-mask-tis", {}),
    ],
)
def test_the_correction_and_its_options_reach_the_learner_verbatim(overrides, correction, options):
    learner = policy_loss_config(config(**overrides), kl_coef=0.0)
    assert (learner.correction, learner.correction_options) == (correction, options)


def test_k1_in_the_reward_and_k3_in_the_loss_are_the_defaults_and_each_side_is_its_own():
    cfg = config(algo__kl__init_kl_coef="0.01", algo__kl__use_kl_loss="true")
    assert policy_loss_config(cfg, kl_coef=0.01).kl_estimator == "k3"
    cfg = config(
        algo__kl__init_kl_coef="0.01",
        algo__kl__use_kl_loss="true",
        algo__kl__loss_estimator="k3+",
        algo__kl__loss_options__unbiased_gradient="true",
    )
    learner = policy_loss_config(cfg, kl_coef=0.01)
    assert (learner.kl_estimator, learner.kl_options, learner.kl_coef) == (
        "k3+",
        {"unbiased_gradient": True},
        0.01,
    )
    assert config(algo__kl__reward_estimator="k2").algo.kl.reward_estimator == "k2"


def test_the_whole_check_is_fast():
    cfg = config()
    began = time.perf_counter()
    for _ in range(20):
        check_components(cfg)
    assert time.perf_counter() - began < 20  # a sanity bound: twenty passes, not a benchmark


def test_the_cli_refuses_a_bad_component_option_with_exit_code_2(capsys):
    args = ["ppo", *[f"--{k}={v}" for k, v in BASE.items()], "--algo.policy.options.epsilon", "0.2"]
    assert main(args) == 2
    assert "algo.policy.options.epsilon: not an option of policy loss 'ppo'" in capsys.readouterr().err


def test_the_cli_takes_dict_entries_in_both_spellings(capsys):
    args = [
        "ppo",
        *[f"--{k}={v}" for k, v in BASE.items()],
        "--print-config",
        "--algo.policy.options.epsilon_high",
        "0.28",
        "--algo.policy.options.dual_clip=3",
    ]
    assert main(args) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["algo"]["policy"]["options"] == {"epsilon_high": 0.28, "dual_clip": 3}


# ---------------------------------------------------------------------------- the advantages


def _records(rewards, groups):
    return [
        Trajectory(
            prompt_ids=torch.tensor([1, 2]),
            response_ids=torch.tensor([3, 4, 5]),
            reward=float(r),
            group_id=g,
            rollout_logprobs=torch.full((3,), -1.0),
        )
        for r, g in zip(rewards, groups, strict=True)
    ]


def test_score_batch_passes_the_estimator_its_options_verbatim():
    batch = build_experience(_records([1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1]))
    cfg = config(algo__advantage__options__scale="none")  # grpo without the std division
    score_batch(cfg, batch, batch.rewards.clone(), kl_coef=0.0)
    first = batch.response_view(batch.advantages)[:, 0]
    assert first.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])


@pytest.mark.parametrize(
    ("estimator", "options"),
    [("group_reward_to_go", {"algo__advantage__options__preset": "group_norm"}), ("flash_reinforce", {})],
)
def test_an_estimator_taking_token_rewards_accepts_the_kl_in_the_reward_and_the_kl_moves_it(
    estimator, options
):
    # grpo refuses β > 0 in the reward (test above); these take token_rewards, so check_components
    # accepts it. k1 KL = old − ref = 0.5 on each of the 3 response tokens, β = 0.01: −0.005 per
    # token, so the reward-to-go moves by −0.015, −0.01, −0.005 along each response.
    cfg = config(algo__advantage__estimator=estimator, algo__kl__init_kl_coef="0.01", **options)
    records = _records([1.0, 0.0, 1.0, 0.5], [0, 0, 1, 1])

    def advantages(kl_coef: float) -> torch.Tensor:
        batch = build_experience(records)
        batch.old_logprobs = batch.from_response_view(torch.full((4, 3), -1.0))
        batch.ref_logprobs = batch.from_response_view(torch.full((4, 3), -1.5))
        score_batch(cfg, batch, batch.rewards.clone(), kl_coef=kl_coef)
        return batch.response_view(batch.advantages)

    without, with_kl = advantages(0.0), advantages(0.01)
    torch.testing.assert_close(without, without[:, :1].expand(4, 3))  # the outcome on every token
    torch.testing.assert_close(with_kl - without, torch.tensor([[-0.015, -0.01, -0.005]]).expand(4, 3))


def test_gae_whitens_its_advantages_by_default_and_not_when_told():
    records = _records([1.0, 0.0, 1.0, 0.5], [0, 1, 2, 3])
    for whiten, expect_unit in (("true", True), ("false", False)):
        batch: ExperienceBatch = build_experience(records)
        batch.values = batch.from_response_view(torch.zeros(4, 3))
        cfg = config(algo__advantage__estimator="gae", algo__advantage__options__whiten=whiten)
        score_batch(cfg, batch, batch.rewards.clone(), kl_coef=0.0)
        adv = batch.response_view(batch.advantages)
        assert (abs(float(adv.std(unbiased=False)) - 1.0) < 1e-3) is expect_unit


def test_old_logprobs_come_from_the_training_forward_only_with_one_update_per_batch():
    assert old_logprobs_from_training(config())
    assert not old_logprobs_from_training(config(train__train_batch_size="16"))  # 2 mini-batches
    assert not old_logprobs_from_training(config(train__max_epochs="2"))
    kl = {"algo__kl__init_kl_coef": "0.01", "algo__kl__use_kl_loss": "true"}
    assert not old_logprobs_from_training(config(**kl))  # the KL needs them before training
    assert policy_loss_config(config(), kl_coef=0.0).old_logprobs_from_forward


# ---------------------------------------------------------------------------- the registries


def test_rl_launch_components_lists_every_registered_name_with_its_options(capsys):
    assert main(["components"]) == 0
    out = capsys.readouterr().out
    for name in [*ADVANTAGE_ESTIMATORS, *POLICY_LOSSES, *ENGINES, *REWARDS]:
        assert name in out
    assert "gspo(epsilon_low=0.0003, epsilon_high=0.0004)" in out
    assert list_components() == out


def test_a_vllm_engine_option_is_checked_against_vllms_own_engine_arguments():
    cfg = config(
        rollout__engine_options__enable_prefix_caching="false",
        rollout__engine_options__max_num_batched_tokens="512",
    )
    assert cfg.rollout.engine_options == {"enable_prefix_caching": False, "max_num_batched_tokens": 512}
    refused(
        r"^rollout\.engine_options\.enable_prefix_cachin: not an option of rollout engine 'vllm'",
        rollout__engine_options__enable_prefix_cachin="false",
    )


def test_vllms_engine_argument_names_are_read_without_importing_vllm():
    """The launcher checks `rollout.engine_options` before it starts anything; importing vLLM
    for that took 10-13 s of the driver's start-up. The names read from vLLM's source are the
    dataclass fields vLLM itself lists, and `rl-launch ppo --print-config` with a vLLM engine
    option (checked, then printed) leaves vLLM unimported."""
    import dataclasses
    import subprocess
    import sys

    from vllm.engine.arg_utils import EngineArgs

    from rl_rollout.engines.vllm import engine_arg_names

    assert engine_arg_names() == {field.name for field in dataclasses.fields(EngineArgs)}
    script = (
        "import sys\n"
        "from rl_launch.cli import main\n"
        "code = main(['ppo', '--rollout.engine_options.max_num_batched_tokens', '512', '--print-config'])\n"
        "assert code == 0, code\n"
        "print('vllm imported:', 'vllm' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "max_num_batched_tokens: 512" in done.stdout
    assert done.stdout.strip().endswith("vllm imported: False"), done.stdout[-500:]


def test_the_engine_section_reaches_the_engine_verbatim(tiny_checkpoint):
    from rl_launch.actors import EngineSpec

    spec = EngineSpec(
        kind="hf",
        options={"max_batch_size": 3},
        model_path=str(tiny_checkpoint),
        dtype="fp32",
        max_model_len=64,
        seed=0,
    )
    engine = ENGINES[spec.kind].build(spec, **spec.options)
    try:
        assert engine.max_batch_size == 3
        assert engine.max_model_len == 64
    finally:
        getattr(engine, "close", lambda: None)()


@pytest.mark.parametrize(
    ("name", "response", "label", "expected"),
    [
        ("arithmetic", " 5 apples", "5", 1.0),
        ("numeric", " so it is 5", "5", 1.0),
        ("exact_match", "5", "5", 1.0),
        ("arithmetic", " 6", "5", 0.0),
        ("numeric", " 4", "5", 0.0),
        ("exact_match", "6", "5", 0.0),
    ],
)
def test_every_registered_reward_builds_in_the_actor_and_scores(name, response, label, expected):
    reward = REWARDS[name]()
    prompt = "What is 4 + 1?"
    assert reward([prompt + response], [prompt], [label]).rewards == [expected]


def test_a_weight_sync_is_a_registered_strategy_or_auto_or_none(capsys):
    for name in ("auto", "none", "broadcast", "shm", "file", "ipc"):
        config(rollout__weight_sync=name)
    refused(
        r"^rollout\.weight_sync: 'nccl' is not one of auto, none, broadcast, file, ipc, shm$",
        rollout__weight_sync="nccl",
    )
    assert main(["components"]) == 0
    out = capsys.readouterr().out
    assert "weight-sync strategies" in out
    assert "  ipc" in out
    assert "  file" in out


def test_ipc_weight_sync_on_a_cpu_run_is_refused_naming_both_options():
    refused(
        r"^rollout\.weight_sync: ipc \(CUDA IPC\) needs GPUs, but ray\.device is cpu",
        rollout__weight_sync="ipc",
        ray__device="cpu",
    )


def _placement(device="cuda", receives=True, same_gpu=False, same_node=True):
    return SyncPlacement(
        device=device,
        engine_receives=receives,
        engines_on_policy_gpus=same_gpu,
        engines_on_policy_node=same_node,
    )


@pytest.mark.parametrize(
    ("placement", "expected"),
    [
        (_placement(receives=False, same_gpu=True), "none"),  # an http engine: nothing can reach it
        (_placement(device="cpu", receives=False), "none"),
        (_placement(same_gpu=True), "ipc"),  # ray.colocate all: the engines map the policy's buffers
        (_placement(same_gpu=False, same_node=True), "broadcast"),  # other GPUs of the node: NCCL
        (_placement(same_gpu=False, same_node=False), "broadcast"),
        (_placement(device="cpu", same_node=True), "shm"),  # one CPU node: /dev/shm
        (_placement(device="cpu", same_node=False), "broadcast"),  # CPU nodes: gloo
    ],
)
def test_auto_weight_sync_follows_the_placement(placement, expected):
    assert choose_weight_sync(placement) == expected


# ---------------------------------------------------------------------------- shared prefixes


@pytest.mark.parametrize(
    ("attention", "share", "expected"),
    [
        ("sdpa", None, True),
        ("eager", None, True),
        ("flash_attention_2", None, False),
        ("sdpa", "false", False),
        ("sdpa", "true", True),
    ],
)
def test_model_share_prefix_reaches_every_learner_verbatim(attention, share, expected):
    from types import SimpleNamespace

    from rl_launch.algorithm import learners_share_prefix
    from rl_launch.specs import learner_specs

    overrides = {"model__attn_implementation": attention}
    if share is not None:
        overrides["model__share_prefix"] = share
    cfg = config(**overrides)
    inputs = SimpleNamespace(model_path="/m", critic_path="/c", reward_model_path="/r", teacher_path="/t")
    specs = learner_specs(cfg, inputs, dtype="fp32", use_gpus=False, total_steps=1)
    for role, spec in specs.items():
        assert spec.deepspeed.share_prefix == (None if share is None else share == "true"), role
        assert spec.deepspeed.shares_prefix is expected, role
    assert learners_share_prefix(cfg) is expected


def test_share_prefix_with_flash_attention_is_refused_before_anything_starts():
    refused(
        r"^model\.share_prefix: True needs model\.attn_implementation sdpa or eager",
        model__attn_implementation="flash_attention_2",
        model__share_prefix="true",
    )
