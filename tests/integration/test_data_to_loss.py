"""rl_data and rl_algos in one flow with a real tiny model, as the learner will run it.

prompts from a JSONL file → sampled responses (token ids and the sampler's log-probs) →
`Trajectory` records sent over the wire → GRPO advantages on the whole batch → micro-batches
balanced over 2 ranks → one packed forward per micro-batch (block-diagonal attention) →
log-probs that equal the sampler's, and micro-batch losses that sum to the full-batch loss.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rl_algos import POLICY_LOSSES, aggregate_loss, compute_advantages, logprobs_from_logits
from rl_data import (
    Trajectory,
    build_experience,
    decode,
    encode,
    micro_batches,
    packed_attention_mask,
    plan_micro_batches,
)
from rl_data.datasets import PromptDataset, PromptLoader

SAMPLES_PER_PROMPT = 3


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float64, attn_implementation="sdpa"
    )
    return model.eval(), AutoTokenizer.from_pretrained(tiny_checkpoint)


def sample(model, prompt_ids: torch.Tensor, max_new_tokens: int, eos: int, generator: torch.Generator):
    """Ancestral sampling at temperature 1: token ids, their log-probs and the finish reason."""
    ids, tokens, logprobs = prompt_ids.clone(), [], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            step = torch.log_softmax(model(ids[None]).logits[0, -1], dim=-1)
            token = int(torch.multinomial(step.exp(), 1, generator=generator))
            tokens.append(token)
            logprobs.append(float(step[token]))
            ids = torch.cat([ids, torch.tensor([token])])
            if token == eos:
                return tokens, logprobs, "stop"
    return tokens, logprobs, "length"


def packed_token_logprobs(model, batch) -> torch.Tensor:
    """[N] log π(input_ids[t] | earlier tokens of its sequence); 0 at each sequence's first token."""
    mask = packed_attention_mask(batch.cu_seqlens)
    logits = model(
        batch.input_ids[None], position_ids=batch.position_ids[None], attention_mask=mask[None, None]
    ).logits[0]
    out = torch.zeros(batch.num_tokens, dtype=logits.dtype)
    out[1:] = logprobs_from_logits(logits[:-1], batch.input_ids[1:])
    out[batch.cu_seqlens[:-1].long()] = 0.0  # a first token has no prediction inside its sequence
    return out


def test_prompts_to_packed_losses_match_the_sampler_and_sum_over_micro_batches(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    rows = [
        {"question": f"What is {a} + {b}?", "answer": str(a + b)}
        for a, b in [(1, 2), (13, 4), (7, 7), (20, 5)]
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompts = PromptDataset(
        path, tokenizer, input_key="question", label_key="answer", cache_dir=tmp_path / "cache"
    )
    (batch_of_prompts,) = list(PromptLoader(prompts, batch_size=4, seed=0).iter_epoch())

    generator = torch.Generator().manual_seed(0)
    records = []
    for group_id, prompt in enumerate(batch_of_prompts):
        for _ in range(SAMPLES_PER_PROMPT):
            tokens, logprobs, finish = sample(model, prompt.prompt_ids, 6, tokenizer.eos_token_id, generator)
            reward = sum(token % 2 == 0 for token in tokens) / len(tokens)  # any rule that varies
            records.append(
                Trajectory(
                    prompt_ids=prompt.prompt_ids,
                    response_ids=tokens,
                    rollout_logprobs=logprobs,
                    reward=reward,
                    group_id=group_id,
                    finish_reason=finish,
                    label=prompt.label,
                )
            )
    records = decode(encode(records), list[Trajectory])  # what a rollout actor sends a learner

    full = build_experience(records)
    advantages, _ = compute_advantages(
        "grpo",
        rewards=full.rewards.double(),
        group_ids=full.group_ids,
        action_mask=full.response_action_mask(),
    )
    full.advantages = full.from_response_view(advantages)
    mask = full.response_action_mask()
    old = full.response_view(full.rollout_logprobs.double())

    # Reference: the full-batch token-mean PPO loss, from per-sequence forwards.
    with torch.no_grad():
        full_logprobs = packed_token_logprobs(model, full)
    per_token, _ = POLICY_LOSSES["ppo"](full.response_view(full_logprobs), old, advantages, mask)
    expected_loss = aggregate_loss(per_token, mask, "token-mean")

    lengths = full.sequence_lengths.tolist()
    plan = plan_micro_batches(lengths, max_tokens=max(lengths) + 5, num_ranks=2)
    assert plan.num_micro_batches >= 2
    global_tokens = full.num_actions  # the normaliser of the whole optimizer step, all ranks
    total, seen = torch.zeros((), dtype=torch.float64), []
    for rank in range(plan.num_ranks):
        for micro in micro_batches(full, plan, rank):
            seen += micro.indices.tolist()
            with torch.no_grad():
                logprobs = packed_token_logprobs(model, micro)
            action = micro.action_mask
            # The learner's packed forward reproduces the sampler's log-probs (float64, same weights).
            torch.testing.assert_close(
                logprobs[action], micro.rollout_logprobs[action].double(), atol=1e-6, rtol=0
            )
            per_token, _ = POLICY_LOSSES["ppo"](
                micro.response_view(logprobs),
                micro.response_view(micro.rollout_logprobs.double()),
                micro.response_view(micro.advantages.double()),
                micro.response_action_mask(),
            )
            total = total + aggregate_loss(
                per_token, micro.response_action_mask(), "token-mean", normalizer=global_tokens
            )
    assert sorted(seen) == list(range(len(records)))
    torch.testing.assert_close(total, expected_loss, atol=1e-12, rtol=0)
    assert any(record.reward != records[0].reward for record in records), (
        "rewards must differ to give advantages"
    )
    assert bool(full.advantages.abs().sum() > 0)
