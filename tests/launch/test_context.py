"""Long context in rl-launch ppo: data.prompt_max_len + rollout.generate_max_len against the
context of the run's models (`rl_launch.preflight.model_context` / `check_context`), checked before
anything starts. Model folders here hold only their config files."""

from __future__ import annotations

import json

import pytest

from rl_launch.config import PPOConfig
from rl_launch.options import load_config
from rl_launch.placement import EngineReady, Placement
from rl_launch.preflight import PreflightError, Resolved, check_context, model_context


def _model(tmp_path, name: str, config: dict, tokenizer: dict | None = None) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", **config}))
    if tokenizer is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return str(folder)


@pytest.mark.parametrize(
    ("config", "tokenizer", "expected"),
    [
        (
            {"max_position_embeddings": 32768},
            None,
            (32768, "max_position_embeddings 32768 in its config.json"),
        ),
        (  # the tokenizer's bound is smaller: vLLM takes the smaller one
            {"max_position_embeddings": 32768},
            {"model_max_length": 2048},
            (2048, "model_max_length 2048 in its tokenizer_config.json"),
        ),
        (  # transformers' "no bound" value
            {"max_position_embeddings": 4096},
            {"model_max_length": int(1e30)},
            (4096, "max_position_embeddings 4096 in its config.json"),
        ),
        (  # GPT-2's key
            {"n_positions": 1024},
            None,
            (1024, "n_positions 1024 in its config.json"),
        ),
        (  # linear RoPE scaling multiplies the context
            {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}},
            None,
            (16384, "max_position_embeddings 4096 in its config.json, x RoPE scaling factor 4"),
        ),
        (  # transformers 5's per-layer-type rope_parameters
            {
                "max_position_embeddings": 4096,
                "rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}},
            },
            None,
            (8192, "max_position_embeddings 4096 in its config.json, x RoPE scaling factor 2"),
        ),
        (  # YaRN's max_position_embeddings already counts the factor
            {"max_position_embeddings": 131072, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
            None,
            (131072, "max_position_embeddings 131072 in its config.json"),
        ),
        (  # a multimodal model: its text model's context
            {"text_config": {"max_position_embeddings": 65536}, "vision_config": {"image_size": 224}},
            None,
            (65536, "max_position_embeddings 65536 in its config.json"),
        ),
        ({"hidden_size": 8}, None, None),  # no length key: nothing to check against
    ],
    ids=[
        "plain",
        "tokenizer-bound",
        "tokenizer-unbounded",
        "n_positions",
        "linear",
        "per-layer",
        "yarn",
        "text_config",
        "none",
    ],
)
def test_model_context_follows_the_config_and_the_tokenizer(tmp_path, config, tokenizer, expected):
    assert model_context(_model(tmp_path, "m", config, tokenizer)) == expected


def test_the_tiny_checkpoint_reports_the_context_it_was_built_with(tmp_path):
    from rl_data.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(
        tmp_path / "long",
        max_position_embeddings=32768,
        hidden_size=32,
        num_heads=1,
        num_kv_heads=1,
        intermediate_size=32,
        num_layers=1,
    )
    assert model_context(str(path)) == (32768, "max_position_embeddings 32768 in its config.json")


def _config(**overrides: str) -> PPOConfig:
    base = {"preset": "none", "model.pretrain": "m", "data.prompt_data": "d.jsonl"}
    base.update({key.replace("__", "."): value for key, value in overrides.items()})
    return load_config(PPOConfig, overrides=base)


def _inputs(model: str, *, critic: str | None = None, reward_model: str | None = None) -> Resolved:
    return Resolved(
        model_path=model,
        critic_path=critic or model,
        reward_model_path=reward_model,
        prompt_data=("d.jsonl",),
        eval_data=None,
        reward_function=None,
        apply_chat_template=True,
    )


def test_a_run_that_fits_the_context_says_nothing(tmp_path):
    model = _model(tmp_path, "m", {"max_position_embeddings": 32768})
    config = _config(data__prompt_max_len="1024", rollout__generate_max_len="31744")
    assert check_context(config, _inputs(model)) is None


def test_a_run_longer_than_the_context_is_refused_naming_both_options_and_the_limit(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    model = _model(tmp_path, "m", {"max_position_embeddings": 32768})
    config = _config(data__prompt_max_len="1024", rollout__generate_max_len="32000")
    with pytest.raises(PreflightError) as error:
        check_context(config, _inputs(model))
    assert str(error.value) == (
        f"data.prompt_max_len (1024) + rollout.generate_max_len (32000) = 33024 tokens is more than the "
        f"context of model.pretrain {model}: 32768 tokens (max_position_embeddings 32768 in its config.json); "
        "lower rollout.generate_max_len to at most 31744 (or data.prompt_max_len), or use a model with a "
        "longer context (e.g. RoPE scaling in its config.json); VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 goes past "
        "the model's context at your own risk"
    )
    # vLLM's own way past its check goes past ours too, and the run says so
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    note = check_context(config, _inputs(model))
    assert note == (
        f"model.pretrain {model}'s context is 32768 (max_position_embeddings 32768 in its config.json); "
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN is set, so it goes on"
    )


def test_the_critic_and_the_reward_model_must_hold_the_sequences_too(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    policy = _model(tmp_path, "policy", {"max_position_embeddings": 32768})
    short = _model(tmp_path, "short", {"max_position_embeddings": 4096})
    config = _config(rollout__generate_max_len="8192")  # gae: a critic
    with pytest.raises(
        PreflightError, match=r"= 9216 tokens is more than the context of model.critic_pretrain"
    ):
        check_context(config, _inputs(policy, critic=short))
    grpo = _config(rollout__generate_max_len="8192", algo__advantage__estimator="grpo")
    assert check_context(grpo, _inputs(policy, critic=short)) is None  # no critic in this run
    with pytest.raises(PreflightError, match=r"context of model.reward_pretrain .*: 4096 tokens"):
        check_context(grpo, _inputs(policy, reward_model=short))


def test_an_engine_max_model_len_cuts_responses_and_must_leave_room_for_one(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    model = _model(tmp_path, "m", {"max_position_embeddings": 32768})
    config = _config(rollout__generate_max_len="32768", rollout__engine_options__max_model_len="20000")
    assert check_context(config, _inputs(model)) == (
        "rollout.engine_options.max_model_len 20000: responses are cut where prompt + response reach it "
        "(finish reason length), before data.prompt_max_len (1024) + rollout.generate_max_len (32768) = "
        "33792 tokens"
    )
    too_long = _config(rollout__engine_options__max_model_len="40000")
    with pytest.raises(
        PreflightError, match=r"^rollout.engine_options.max_model_len \(40000 tokens\) is more than"
    ):
        check_context(too_long, _inputs(model))
    no_room = _config(rollout__engine_options__max_model_len="1024")
    with pytest.raises(
        PreflightError, match=r"max_model_len: 1024 leaves no room for a response to a prompt"
    ):
        check_context(no_room, _inputs(model))


def test_the_start_up_line_says_the_engines_context_and_how_many_sequences_their_cache_holds():
    vllm = EngineReady(sync_size=1, kv_cache_bytes=272 * 2**20, max_model_len=17408, kv_cache_tokens=34816)
    placement = Placement.of("cuda", [vllm, vllm], [("node-0", ("0",))])
    assert placement.describe_engine_context() == (
        "max_model_len 17408; KV cache 272 MiB each; 34816 tokens: 2.00 sequences of 17408 tokens at once"
    )
    hf = EngineReady(sync_size=1, max_model_len=17408)  # hf: no paged cache
    assert Placement.of("cpu", [hf], [("node-0", ())]).describe_engine_context() == "max_model_len 17408"


def test_a_kv_cache_too_small_for_one_sequence_is_refused_before_the_engines_start(tmp_path):
    # 2 (K, V) x 2 layers x 2 KV heads x 32 dims x 4 bytes (fp32) = 1 KiB per token
    model = _model(
        tmp_path,
        "m",
        {
            "max_position_embeddings": 32768,
            "hidden_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
        },
    )
    options = {"model__dtype": "fp32", "rollout__generate_max_len": "16384"}  # 17408 tokens
    fits = _config(**options, rollout__engine_options__kv_cache_memory_bytes=str(17408 * 1024))
    assert check_context(fits, _inputs(model)) is None
    small = _config(**options, rollout__engine_options__kv_cache_memory_bytes=str(16 * 2**20))
    with pytest.raises(PreflightError) as error:
        check_context(small, _inputs(model))
    assert str(error.value) == (
        "rollout.engine_options.kv_cache_memory_bytes = 16777216 bytes (16.0 MiB) holds 16384 tokens at 1024 "
        "bytes per token, fewer than one sequence of max_model_len 17408 tokens (at least 17825792 bytes, "
        "17.0 MiB); raise it, or lower data.prompt_max_len + rollout.generate_max_len"
    )
    hf = _config(**options, rollout__engine="hf", rollout__engine_options__max_batch_size="2")
    assert check_context(hf, _inputs(model)) is None  # no such option there
