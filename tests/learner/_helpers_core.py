"""Shared data and a plain-torch reference step for the learner tests (no DeepSpeed here)."""

from __future__ import annotations

import torch

from rl_data import ExperienceBatch, Trajectory, build_experience

LR = 1e-3
TOTAL_STEPS = 4
NUM_STEPS = 2  # optimizer steps in the equivalence runs


def experience(num_sequences: int = 8, *, seed: int = 0, vocab: int = 400) -> ExperienceBatch:
    """A fixed batch of random trajectories of different lengths (ids in [3, vocab): no pad id, inside
    the tiny vocabulary). Sequences 4g..4g+3 are group g: one prompt, four responses (so the
    learners run each prompt once, `rl_learner.models.shared_prefix`, while the references don't)."""
    return build_experience(_records(num_sequences, seed=seed, vocab=vocab))


def experience_with_a_long_sequence(
    long_response: int = 60, *, seed: int = 5, vocab: int = 400
) -> ExperienceBatch:
    """`experience(6)`'s trajectories (groups of four samples sharing a prompt) plus a seventh with a
    `long_response`-token response, longer than half the packed row: under sequence parallelism
    with two ranks it spans both ranks' slices."""
    records = _records(6, seed=seed, vocab=vocab)
    generator = torch.Generator().manual_seed(seed + 1)
    records.append(
        Trajectory(
            prompt_ids=torch.randint(3, vocab, (3,), generator=generator),
            response_ids=torch.randint(3, vocab, (long_response,), generator=generator),
            rollout_logprobs=-torch.rand(long_response, generator=generator) * 4,
            reward=1.0,
            group_id=99,
        )
    )
    return build_experience(records)


def _records(num_sequences: int, *, seed: int, vocab: int) -> list[Trajectory]:
    generator = torch.Generator().manual_seed(seed)
    records = []
    prompts: dict[int, torch.Tensor] = {}
    for index in range(num_sequences):
        if index // 4 not in prompts:
            length = int(torch.randint(2, 6, (1,), generator=generator))
            prompts[index // 4] = torch.randint(3, vocab, (length,), generator=generator)
        response = int(torch.randint(2, 9, (1,), generator=generator))
        mask = torch.ones(response, dtype=torch.bool)
        if index % 3 == 1 and response > 2:
            mask[1] = False  # an environment token
        records.append(
            Trajectory(
                prompt_ids=prompts[index // 4],
                response_ids=torch.randint(3, vocab, (response,), generator=generator),
                action_mask=mask,
                rollout_logprobs=-torch.rand(response, generator=generator) * 4,
                reward=float(index % 2),
                group_id=index // 4,
            )
        )
    return records


def fill_policy_slots(batch: ExperienceBatch, logprobs: torch.Tensor, *, seed: int = 1) -> ExperienceBatch:
    """old/ref/teacher log-probs near the model's (so some ratios clip) and random advantages, on response tokens."""
    generator = torch.Generator().manual_seed(seed)
    on = batch.action_mask
    noise = torch.randn(batch.num_tokens, generator=generator)
    batch.old_logprobs = torch.where(on, logprobs + 0.15 * noise, 0.0).float()
    batch.ref_logprobs = torch.where(on, logprobs - 0.1 * noise.abs(), 0.0).float()
    batch.teacher_logprobs = torch.where(on, logprobs - 0.2 * noise, 0.0).float()
    batch.rollout_logprobs = torch.where(
        on, batch.old_logprobs + 0.05 * torch.randn(batch.num_tokens, generator=generator), 0.0
    ).float()
    batch.advantages = torch.where(on, torch.randn(batch.num_tokens, generator=generator), 0.0).float()
    return batch


def fill_value_slots(batch: ExperienceBatch, values: torch.Tensor, *, seed: int = 2) -> ExperienceBatch:
    generator = torch.Generator().manual_seed(seed)
    on = batch.action_mask
    batch.values = torch.where(
        on, values + 0.3 * torch.randn(batch.num_tokens, generator=generator), 0.0
    ).float()
    batch.returns = torch.where(on, torch.randn(batch.num_tokens, generator=generator), 0.0).float()
    return batch


def tiny_policy(tokenizer, dtype: torch.dtype = torch.float32):
    """The tiny Qwen2 policy (seed 0), initialised in float32 and then cast: the same weights for every dtype."""
    from rl_data.tiny import build_tiny_model

    return build_tiny_model(tokenizer, seed=0).to(dtype)


def tiny_critic(tokenizer, dtype: torch.dtype = torch.float32):
    """A value model with the tiny policy's backbone and a seeded random `score` head."""
    from transformers import AutoModelForSequenceClassification

    policy = tiny_policy(tokenizer)
    config = policy.config
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        critic = AutoModelForSequenceClassification.from_config(config)
    critic.load_state_dict(policy.state_dict(), strict=False)
    return critic.to(dtype)
