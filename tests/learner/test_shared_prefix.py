"""Shared prefixes: a packed forward that runs each group's prompt once gives the unshared values and gradients."""

from __future__ import annotations

import itertools
import pathlib
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_data import ExperienceBatch, Trajectory, build_experience
from rl_data.tiny import build_tiny_model
from rl_learner.models import (
    load_value_model,
    packed_logprobs,
    packed_model_inputs,
    packed_scores,
    packed_values,
    shared_prefix,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _helpers_core import experience


def grouped(prompts: int = 3, n: int = 3, *, seed: int = 0, vocab: int = 400) -> ExperienceBatch:
    """`prompts` prompts × `n` samples, groups interleaved in the row, with an environment token
    in some responses, plus one sequence with a prompt of its own and one without action tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = [
        torch.randint(3, vocab, (int(torch.randint(3, 9, (1,), generator=generator)),), generator=generator)
        for _ in range(prompts)
    ]
    records = []
    for sample in range(n):
        for index, prompt in enumerate(prompt_ids):
            length = int(torch.randint(1, 7, (1,), generator=generator))
            mask = torch.ones(length, dtype=torch.bool)
            if length > 2 and sample == 1:
                mask[1] = False
            records.append(
                Trajectory(
                    prompt_ids=prompt,
                    response_ids=torch.randint(3, vocab, (length,), generator=generator),
                    action_mask=mask,
                    reward=float(sample % 2),
                    group_id=index,
                )
            )
    records.append(
        Trajectory(prompt_ids=torch.tensor([5, 6, 7]), response_ids=torch.tensor([8, 9]), group_id=99)
    )
    records.append(
        Trajectory(
            prompt_ids=prompt_ids[0],
            response_ids=torch.tensor([11, 12]),
            action_mask=torch.zeros(2, dtype=torch.bool),
            group_id=0,
        )
    )
    return build_experience(records)


def _model(tokenizer, attention: str, dtype: torch.dtype = torch.float64):
    model = build_tiny_model(tokenizer, dtype=dtype)
    model.config._attn_implementation = attention
    return model


def test_groups_run_their_prompt_once():
    batch = grouped(prompts=3, n=4)
    sharing = shared_prefix(batch)
    assert sharing is not None
    bounds = batch.cu_seqlens.tolist()
    prompt_lengths = [
        int(torch.nonzero(batch.action_mask[a:b])[0]) for a, b in itertools.pairwise(bounds[:4])
    ]
    # three of the four samples of each prompt skip it; the action-free sequence's prefix is all of
    # it (prompt 0 and two more tokens), which no other sequence has
    assert sharing.saved_tokens == 3 * sum(prompt_lengths)
    # every token reads a compressed token holding the same id at the same position
    compressed_ids = batch.input_ids[sharing.keep]
    compressed_positions = batch.position_ids[sharing.keep]
    assert torch.equal(compressed_ids[sharing.own], batch.input_ids)
    assert torch.equal(compressed_positions[sharing.own], batch.position_ids)
    assert torch.equal(sharing.own[sharing.keep], torch.arange(sharing.keep.numel()))


def test_no_two_prompts_alike_shares_nothing():
    distinct = [
        Trajectory(prompt_ids=torch.tensor([3, 4]), response_ids=torch.tensor([5, 6])),
        Trajectory(prompt_ids=torch.tensor([3, 7]), response_ids=torch.tensor([5, 6])),
        Trajectory(prompt_ids=torch.tensor([3]), response_ids=torch.tensor([4, 5])),
    ]
    assert shared_prefix(build_experience(distinct)) is None
    assert shared_prefix(experience(1)) is None
    assert shared_prefix(ExperienceBatch.empty()) is None


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("only_actions", [False, True])
def test_log_probs_entropy_and_gradients_equal_the_unshared_forward(
    tokenizer, attention, only_actions, monkeypatch
):
    # Qwen2's RMSNorm computes in float32 even in a float64 model: its backward then rounds the sum
    # of a shared prefix's n gradients to float32 where the unshared forward rounds each of them
    # (1e-7 relative). In float64 throughout, the two gradients agree to rounding.
    from transformers.models.qwen2 import modeling_qwen2

    def rms_norm(self, hidden):
        variance = hidden.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", rms_norm)
    batch = grouped(seed=1)
    results = {}
    for share in (False, True):
        model = _model(tokenizer, attention)
        logprobs, entropy = packed_logprobs(
            model, batch, with_entropy=True, temperature=0.7, only_actions=only_actions, share_prefix=share
        )
        ((logprobs * batch.action_mask).sum() + 0.1 * entropy.sum()).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results[share] = (logprobs.detach(), entropy.detach(), grads)
    (lp, ent, grads), (lp_s, ent_s, grads_s) = results[False], results[True]
    # transformers' eager attention takes its softmax in float32, even for a float64 model.
    atol = 1e-10 if attention == "sdpa" else 1e-6
    torch.testing.assert_close(lp_s, lp, rtol=0, atol=atol)
    torch.testing.assert_close(ent_s, ent, rtol=0, atol=atol)
    assert lp.abs().max() > 1.0
    for name, grad in grads.items():
        torch.testing.assert_close(grads_s[name], grad, rtol=0, atol=atol, msg=name)


def test_float32_log_probs_within_1e5(tokenizer):
    batch = grouped(prompts=4, n=8, seed=2)
    model = _model(tokenizer, "sdpa", torch.float32)
    with torch.no_grad():
        plain = packed_logprobs(model, batch, only_actions=True)
        shared = packed_logprobs(model, batch, only_actions=True, share_prefix=True)
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-5)


def test_the_model_sees_fewer_tokens(tokenizer):
    batch = grouped(prompts=2, n=8)
    model = _model(tokenizer, "sdpa")
    sharing = shared_prefix(batch)
    inputs = packed_model_inputs(model, batch, sharing=sharing)
    assert inputs["input_ids"].shape == (1, batch.num_tokens - sharing.saved_tokens)
    assert inputs["packed_length_buckets"].num_tokens == inputs["input_ids"].shape[1]


def test_values_and_scores_equal_the_unshared_forward(tmp_path, tokenizer):
    build_tiny_model(tokenizer).save_pretrained(tmp_path)
    model = load_value_model(tmp_path, dtype=torch.float64, pad_token_id=tokenizer.pad_token_id)
    batch = grouped(seed=3)
    with torch.no_grad():
        torch.testing.assert_close(
            packed_values(model, batch, share_prefix=True), packed_values(model, batch), rtol=0, atol=1e-10
        )
        torch.testing.assert_close(
            packed_scores(model, batch, share_prefix=True), packed_scores(model, batch), rtol=0, atol=1e-10
        )


def test_flash_attention_refuses_a_shared_prefix(tokenizer):
    model = _model(tokenizer, "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    batch = grouped()
    with pytest.raises(ValueError, match=r"shared prefixes need sdpa or eager attention.*flash_attention_2"):
        packed_model_inputs(model, batch, sharing=shared_prefix(batch))


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 5), st.integers(0, 3)), min_size=1, max_size=8))
def test_any_grouping_gives_the_same_log_probs(tokenizer_for_hypothesis, rows):
    """Rows (prompt index, response length, response seed): prompts drawn from three, any order."""
    prompts = [torch.tensor([3, 4, 5, 6]), torch.tensor([3, 4, 5, 7, 8]), torch.tensor([9])]
    records = [
        Trajectory(
            prompt_ids=prompts[prompt],
            response_ids=torch.randint(3, 400, (length,), generator=torch.Generator().manual_seed(seed)),
            group_id=prompt,
        )
        for prompt, length, seed in rows
    ]
    batch = build_experience(records)
    model = tokenizer_for_hypothesis
    with torch.no_grad():
        plain = packed_logprobs(model, batch, only_actions=True)
        shared = packed_logprobs(model, batch, only_actions=True, share_prefix=True)
    torch.testing.assert_close(shared, plain, rtol=0, atol=1e-10)


@pytest.fixture(scope="module")
def tokenizer_for_hypothesis(tokenizer):
    """The float64 sdpa model the property test runs (one per module: hypothesis reuses it)."""
    return _model(tokenizer, "sdpa")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_on_cuda_the_shared_forward_gives_the_unshared_values_and_gradients(tokenizer, dtype, atol):
    batch = grouped(prompts=4, n=8, seed=4).to("cuda")
    results = {}
    for share in (False, True):
        model = _model(tokenizer, "sdpa", torch.float32).to(device="cuda", dtype=dtype)
        logprobs = packed_logprobs(model, batch, only_actions=True, share_prefix=share)
        (logprobs * batch.action_mask).sum().backward()
        results[share] = (
            logprobs.detach().float(),
            torch.cat([p.grad.flatten().float() for p in model.parameters()]),
        )
    (plain, grads), (shared, shared_grads) = results[False], results[True]
    torch.testing.assert_close(shared, plain, rtol=0, atol=atol)
    # the gradient as a whole: a missing or doubled group contribution moves it by O(1)
    assert float((shared_grads - grads).norm() / grads.norm()) < (1e-4 if dtype == torch.float32 else 2e-2)
