"""HFEngine: the shared engine contract, plus what is specific to the transformers fallback engine.

Specific here: left padding and batch composition do not change a prompt's output, top-k = 1 is
greedy, agenerate batches concurrent callers, tied weights and unknown names in weight sync,
weight sync by gloo broadcast from a sender subprocess, and sleep (CUDA only).
"""

from __future__ import annotations

import asyncio
import pathlib
import subprocess
import sys

import pytest
import torch

from rl_data import WeightSyncReport, compare_checksums, decode, pack_bucket, plan_buckets
from rl_data.sync import WeightSyncSpec
from rl_data.sync.broadcast import free_port
from rl_data.sync.file import write_buckets
from rl_rollout.engines.hf import HFEngine
from rl_rollout.protocol import EngineError, SamplingParams
from tests.rollout.engine_contract import EngineContract, reference_logprobs

WORKER = pathlib.Path(__file__).with_name("_worker_hf_sender.py")
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


class TestHFEngine(EngineContract):
    logprob_atol = 2e-5
    supports_weight_sync = True
    supports_partial_rollout = True

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, checkpoint):
        engine = HFEngine(checkpoint, dtype="float32", max_model_len=128, max_batch_size=16, seed=0)
        yield engine
        engine.close()


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    engine = HFEngine(tiny_checkpoint, dtype="float32", max_model_len=128, max_batch_size=16, seed=0)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ("Hi", "What is 12 + 30? Think step by step.", "The quick brown fox jumps over the lazy dog")
    return [tokenizer(text)["input_ids"] for text in texts]


def test_left_padding_does_not_change_a_prompt_output(engine, prompts):
    alone = engine.generate(prompts[:1], GREEDY)[0][0]
    batched = engine.generate(prompts, GREEDY)[0][0]
    assert batched.token_ids == alone.token_ids
    assert max(abs(a - b) for a, b in zip(batched.logprobs, alone.logprobs)) < 1e-5


def test_seeded_samples_do_not_depend_on_the_batch(engine, prompts):
    params = SamplingParams(temperature=1.0, n=3, max_new_tokens=12, seed=42, ignore_eos=True)
    alone = engine.generate([prompts[1]], params)[0]
    batch = engine.generate([prompts[0], prompts[1], prompts[2]], params)
    assert [s.token_ids for s in batch[1]] == [s.token_ids for s in alone]
    # and the other prompts of the batch, with the same seed, drew other samples (`prompt_seed`)
    assert batch[0][0].token_ids[:4] != alone[0].token_ids[:4] != batch[2][0].token_ids[:4]


def test_small_max_batch_size_gives_the_same_results(tiny_checkpoint, engine, prompts):
    small = HFEngine(tiny_checkpoint, dtype="float32", max_model_len=128, max_batch_size=1)
    params = SamplingParams(temperature=0.8, n=2, max_new_tokens=8, seed=3)
    assert [[s.token_ids for s in p] for p in small.generate(prompts, params)] == [
        [s.token_ids for s in p] for p in engine.generate(prompts, params)
    ]


def test_top_k_one_is_greedy_with_untruncated_logprobs(engine, prompts):
    greedy = engine.generate(prompts, GREEDY)
    top1 = engine.generate(
        prompts, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=12, seed=9, ignore_eos=True)
    )
    tiny_p = engine.generate(
        prompts, SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=12, seed=9, ignore_eos=True)
    )
    for g, k, p in zip(greedy, top1, tiny_p):
        assert k[0].token_ids == g[0].token_ids == p[0].token_ids
        # log softmax(z) of the whole distribution, not of the truncated one (which would be 0)
        assert k[0].logprobs == pytest.approx(g[0].logprobs, abs=1e-6)
        assert max(k[0].logprobs) < -1


def test_top_p_sampling_stays_inside_the_nucleus(engine, prompts, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float64).eval()
    params = SamplingParams(temperature=1.0, top_p=0.05, n=4, max_new_tokens=10, seed=1, ignore_eos=True)
    for prompt, samples in zip(prompts, engine.generate(prompts, params)):
        for sample in samples:
            _, rows = reference_logprobs(reference, prompt, sample.token_ids)
            for step, token in enumerate(sample.token_ids):
                probs = rows[step].exp()
                above = probs[probs > probs[token]].sum().item()
                assert above < 0.05 + 1e-6, f"token {token} at step {step} lies outside the top-p nucleus"


def test_stop_strings_need_a_tokenizer(tiny_checkpoint, prompts):
    from transformers import AutoModelForCausalLM

    bare = HFEngine(AutoModelForCausalLM.from_pretrained(tiny_checkpoint), eos_token_ids=[2], pad_token_id=0)
    assert bare.max_model_len == 2048
    with pytest.raises(EngineError, match="need a tokenizer"):
        bare.generate(prompts[:1], SamplingParams(max_new_tokens=2, stop=("x",)))


def test_eos_token_ids_argument_ends_responses(tiny_checkpoint, engine, prompts):
    baseline = engine.generate(prompts[:1], GREEDY)[0][0].token_ids
    custom = HFEngine(tiny_checkpoint, dtype="float32", max_model_len=128, eos_token_ids=[baseline[3]])
    result = custom.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=12))[0][0]
    cut = baseline.index(baseline[3]) + 1
    assert (result.token_ids, result.finish_reason) == (baseline[:cut], "stop")
    through = custom.generate(prompts[:1], GREEDY)[0][0]
    assert through.token_ids == baseline


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"dtype": "float8"}, "dtype"),
        ({"max_model_len": 1}, "max_model_len"),
    ],
)
def test_constructor_rejects_bad_arguments(tiny_checkpoint, kwargs, match):
    with pytest.raises(ValueError, match=match):
        HFEngine(tiny_checkpoint, **kwargs)


def test_sleep_contract_refuses_work_while_asleep_and_wake_restores_identical_generations(
    tiny_checkpoint, prompts, tmp_path
):
    """The hybrid engine's order (rl_launch.roles): generate, sleep, ..., wake, receive, generate.
    On CPU nothing moves, but the contract is the one the GPU path keeps: no generation and no
    weight sync while asleep (a sync must follow `wake_up`, as vLLM needs its weights in place)."""
    from rl_data.sync.file import write_buckets

    sleeper = HFEngine(tiny_checkpoint, dtype="float32", max_model_len=128, seed=0)
    try:
        assert sleeper.supports("sleep") is True
        before = sleeper.generate(prompts, GREEDY)
        layout = _layout(sleeper.model)
        directory = tmp_path / "sync"
        state = {name: p.detach().clone() for name, p in sleeper.model.named_parameters()}
        write_buckets(directory, layout, lambda b, out: pack_bucket(b, state, out=out), version=1)
        sleeper.init_weight_sync(WeightSyncSpec(transport="file", layout=layout, directory=str(directory)), 1)
        sleeper.sleep(1)
        sleeper.sleep(1)  # idempotent
        assert sleeper.asleep is True
        with pytest.raises(
            EngineError, match=r"HFEngine\.generate: the engine is asleep; call wake_up\(\) first"
        ):
            sleeper.generate(prompts, GREEDY)
        with pytest.raises(EngineError, match="receive_weights: the engine is asleep"):
            sleeper.receive_weights(1)
        assert sleeper.policy_version == 0  # the refused sync changed nothing
        with pytest.raises(ValueError, match="level must be 1 or 2"):
            sleeper.sleep(3)
        sleeper.wake_up()
        sleeper.wake_up()  # idempotent
        assert sleeper.receive_weights(1).version == 1
        after = sleeper.generate(prompts, GREEDY)
        assert [p[0].token_ids for p in after] == [p[0].token_ids for p in before]
        assert after[0][0].policy_version == 1
    finally:
        sleeper.close()


@pytest.mark.gpu
def test_sleep_moves_weights_off_the_gpu_and_back(tiny_checkpoint, prompts):
    gpu = HFEngine(tiny_checkpoint, dtype="float32", device="cuda", max_model_len=128)
    before = gpu.generate(prompts, GREEDY)
    held = torch.cuda.memory_allocated()
    gpu.sleep()
    assert next(gpu.model.parameters()).device.type == "cpu"
    assert torch.cuda.memory_allocated() < held  # the weights left the GPU
    with pytest.raises(EngineError, match="asleep"):
        gpu.generate(prompts, GREEDY)
    gpu.wake_up()
    assert next(gpu.model.parameters()).device.type == "cuda"
    assert [p[0].token_ids for p in gpu.generate(prompts, GREEDY)] == [p[0].token_ids for p in before]


class _CountingEngine(HFEngine):
    """Records the number of prompts of every generate call (to see agenerate's batching)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        return super().generate(prompts, params)


def test_agenerate_batches_concurrent_callers_and_isolates_bad_prompts(tiny_checkpoint, prompts):
    counting = _CountingEngine(tiny_checkpoint, dtype="float32", max_model_len=128, batch_wait_s=0.2)
    many = [prompts[index % 3] for index in range(9)]

    async def run_all():
        good = [counting.agenerate(prompt, GREEDY) for prompt in many]
        return await asyncio.gather(*good, counting.agenerate([], GREEDY), return_exceptions=True)

    try:
        results = asyncio.run(run_all())
    finally:
        counting.close()
    assert isinstance(results[-1], EngineError)
    assert "prompt 0 is empty" in str(results[-1])
    expected = counting.generate(many, GREEDY)
    assert [r[0].token_ids for r in results[:-1]] == [e[0].token_ids for e in expected]
    assert max(counting.calls[:-1]) > 1, f"no batching happened: generate calls of sizes {counting.calls}"


# --- weight sync --------------------------------------------------------------------------------


def _layout(model):
    return plan_buckets(
        ((name, torch.float32, p.shape) for name, p in model.named_parameters()), bucket_bytes=1 << 16
    )


def test_tied_weights_sync_and_unknown_names_are_rejected(tokenizer, tmp_path):
    from rl_data.tiny import build_tiny_model

    model = build_tiny_model(tokenizer, tie_word_embeddings=True)
    engine = HFEngine(model, tokenizer, max_model_len=64)
    layout = _layout(model)
    assert "lm_head.weight" not in layout.names()
    new = {name: p.detach() * 1.5 for name, p in model.named_parameters()}
    spec = WeightSyncSpec(transport="file", layout=layout, directory=str(tmp_path / "tied"))
    engine.init_weight_sync(spec, 1)
    write_buckets(spec.directory, layout, lambda b, out: pack_bucket(b, new, out=out), version=3)
    engine.receive_weights(3)
    assert engine.policy_version == 3
    assert torch.equal(engine.model.lm_head.weight, new["model.embed_tokens.weight"])

    bogus = {"model.not_a_layer.weight": torch.ones(4)}
    layout = plan_buckets([("model.not_a_layer.weight", torch.float32, (4,))])
    spec = WeightSyncSpec(transport="file", layout=layout, directory=str(tmp_path / "bogus"))
    engine.init_weight_sync(spec, 1)
    write_buckets(spec.directory, layout, lambda b, out: pack_bucket(b, bogus, out=out), version=4)
    with pytest.raises(EngineError, match=r"'model.not_a_layer.weight' is not in the model"):
        engine.receive_weights(4)
    assert engine.policy_version == 3


def test_receive_weights_before_init_raises(engine):
    fresh = HFEngine(engine.model, engine.tokenizer, max_model_len=64)
    with pytest.raises(EngineError, match="init_weight_sync"):
        fresh.receive_weights(1)


@pytest.mark.slow  # a sender process and a gloo group
@pytest.mark.parametrize(
    "backend",
    [
        "gloo",
        pytest.param(
            "nccl",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(
                    torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU: needs 2 GPUs"
                ),
            ],
        ),
    ],
)
def test_weight_update_by_broadcast_from_a_sender_process(tiny_checkpoint, tmp_path, prompts, backend):
    from transformers import AutoModelForCausalLM

    device = "cuda:1" if backend == "nccl" else "cpu"  # the sender broadcasts from cuda:0
    receiver_engine = HFEngine(tiny_checkpoint, dtype="float32", max_model_len=128, device=device)
    layout = _layout(receiver_engine.model)
    port = free_port()
    sender = subprocess.Popen(
        [sys.executable, str(WORKER), str(tiny_checkpoint), str(port), str(tmp_path), backend],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        spec = WeightSyncSpec(
            transport="broadcast", layout=layout, port=port, world_size=2, timeout_s=120, backend=backend
        )
        receiver_engine.init_weight_sync(spec, 1)
        report = receiver_engine.receive_weights(5)
        output, _ = sender.communicate(timeout=180)
    finally:
        if sender.poll() is None:
            sender.kill()
            sender.wait()
        receiver_engine.close()
    assert sender.returncode == 0, output.decode(errors="replace")
    sent = decode((tmp_path / "sent.msgpack").read_bytes(), WeightSyncReport)
    assert compare_checksums(sent, report) == []
    assert receiver_engine.policy_version == 5
    expected = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    for name, param in expected.named_parameters():
        perturbed = param.detach() + 0.01 * (torch.arange(param.numel()).reshape(param.shape) % 7)
        assert torch.equal(receiver_engine.model.get_parameter(name).cpu(), perturbed), name
    result = receiver_engine.generate(prompts[:1], GREEDY)[0][0]
    assert result.policy_version == 5
