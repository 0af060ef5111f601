"""`cpu_kv_cache_bytes`: the KV cache a CPU engine asks vLLM for, sized from the run, not from RAM.

vLLM's CPU backend reads `gpu_memory_utilization` as a fraction of the machine's memory (0.6 of
24 GiB = 14 GiB for a model of a few MB), so a second run could not start beside the first.
"""

from __future__ import annotations

import json

import pytest

from rl_rollout.engines.vllm import CPU_KV_CACHE_FLOOR, check_kv_cache_bytes, cpu_kv_cache_bytes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-config")
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 512,
        "max_position_embeddings": 2048,
        "vocab_size": 485,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_small_run_gets_the_floor(model_dir):
    # 2 (K, V) x 2 layers x 2 KV heads x 32 dims x 4 bytes = 1 KiB per token; 512 x 256 tokens = 128 MiB
    assert cpu_kv_cache_bytes(model_dir, max_num_seqs=8, max_model_len=70) == CPU_KV_CACHE_FLOOR


def test_the_size_is_sequences_times_whole_blocks_times_bytes_per_token(model_dir):
    per_token = 2 * 2 * 2 * 32 * 4
    assert cpu_kv_cache_bytes(model_dir, max_num_seqs=512, max_model_len=70) == 512 * 256 * per_token
    assert cpu_kv_cache_bytes(model_dir, max_num_seqs=512, max_model_len=257) == 512 * 512 * per_token
    # 2-byte elements halve it; without a length the model's context length counts
    assert cpu_kv_cache_bytes(model_dir, max_num_seqs=512, max_model_len=70, dtype="bfloat16") == (
        512 * 256 * per_token // 2
    )
    assert cpu_kv_cache_bytes(model_dir, max_num_seqs=64, max_model_len=None) == 64 * 2048 * per_token


def test_a_long_context_is_capped_by_the_machine_but_always_holds_one_full_sequence(model_dir):
    per_token = 2 * 2 * 2 * 32 * 4
    one = 32768 * per_token  # 32 MiB: one sequence of 32768 tokens
    # 256 full sequences would take 8 GiB: capped at half of a 4 GiB machine
    assert (
        cpu_kv_cache_bytes(model_dir, max_num_seqs=256, max_model_len=32768, memory_bytes=4 * 2**30)
        == 2 * 2**30
    )
    # never less than one full-length sequence, whatever the machine
    assert (
        cpu_kv_cache_bytes(model_dir, max_num_seqs=256, max_model_len=131072, memory_bytes=2**20) == 4 * one
    )


def test_a_cache_smaller_than_one_sequence_is_refused_naming_the_sizes():
    check_kv_cache_bytes(2048 * 1024, per_token=1024, max_model_len=2048)  # exactly one sequence
    with pytest.raises(
        ValueError,
        match=r"^kv_cache_memory_bytes = 1048576 bytes \(1.0 MiB\) holds 1024 tokens at 1024 bytes per token, fewer than one sequence of max_model_len 2048 tokens \(at least 2097152 bytes, 2.0 MiB\)$",
    ):
        check_kv_cache_bytes(2**20, per_token=1024, max_model_len=2048)
