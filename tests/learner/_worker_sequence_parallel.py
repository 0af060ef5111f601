"""One rank of a two-rank gloo world for tests/learner/test_sequence_parallel.py.

    python _worker_sequence_parallel.py OUT_DIR

(the test runs `diffs` inside `_worker_sequence_parallel_learner.py --diffs`, whose two-rank world
it shares). Runs the packed forward and backward of the tiny Qwen2 policy (log-probs, entropy) and critic
(values, scores) once whole on every rank (SP = 1) and once split over the two ranks (SP = 2,
`rl_learner.sequence_parallel`), and writes the largest absolute differences of the outputs and
of every parameter gradient (the SP gradients summed over the group) to OUT_DIR/diffs{rank}.json.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _helpers_core import experience_with_a_long_sequence, tiny_critic, tiny_policy

from rl_data import ExperienceBatch
from rl_data.tiny import build_tiny_tokenizer
from rl_learner.models import packed_logprobs, packed_scores, packed_values
from rl_learner.sequence_parallel import check_heads, new_sequence_parallel_group


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def summed_gradients(model: torch.nn.Module, group) -> dict[str, torch.Tensor]:
    grads = gradients(model)
    for grad in grads.values():
        dist.all_reduce(grad, group=group.group)
    return grads


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def largest(grads: dict[str, torch.Tensor]) -> float:
    return max(float(g.abs().max()) for g in grads.values())


def policy_case(model, batch, weights, group, **options) -> dict:
    def run(sequence_parallel):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = packed_logprobs(
            model, batch, with_entropy=True, sequence_parallel=sequence_parallel, **options
        )
        ((logprobs * weights).sum() + (entropy * weights.flip(0)).sum()).backward()
        return logprobs.detach(), entropy.detach()

    logprobs, entropy = run(None)
    whole = gradients(model)
    sp_logprobs, sp_entropy = run(group)
    return {
        "logprobs": float((logprobs - sp_logprobs).abs().max()) if batch.num_tokens else 0.0,
        "entropy": float((entropy - sp_entropy).abs().max()) if batch.num_tokens else 0.0,
        "gradients": max_diff(whole, summed_gradients(model, group)),
        "gradient_scale": largest(whole),
        "nonzero_logprobs": int((logprobs != 0).sum()),
    }


def critic_case(model, batch, weights, group, **options) -> dict:
    def run(sequence_parallel):
        model.zero_grad(set_to_none=True)
        values = packed_values(model, batch, sequence_parallel=sequence_parallel, **options)
        scores = packed_scores(model, batch, sequence_parallel=sequence_parallel, **options)
        ((values * weights).sum() + scores.sum()).backward()
        return values.detach(), scores.detach()

    values, scores = run(None)
    whole = gradients(model)
    sp_values, sp_scores = run(group)
    return {
        "values": float((values - sp_values).abs().max()),
        "scores": float((scores - sp_scores).abs().max()),
        "gradients": max_diff(whole, summed_gradients(model, group)),
        "gradient_scale": largest(whole),
    }


def diffs(out: pathlib.Path) -> None:
    """The comparisons of the module docstring, in this process's (two-rank) default group."""
    rank = dist.get_rank()
    group = new_sequence_parallel_group(2)
    tokenizer = build_tiny_tokenizer()
    batch = experience_with_a_long_sequence()
    weights = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(3))
    lengths = batch.sequence_lengths.tolist()
    results: dict = {
        "num_tokens": batch.num_tokens,
        "longest": max(lengths),
        "local_range": group.local_range(batch.num_tokens),
    }
    for attention in ("sdpa", "eager"):
        policy = tiny_policy(tokenizer)
        policy.config._attn_implementation = attention
        critic = tiny_critic(tokenizer)
        critic.config._attn_implementation = attention
        for share in (False, True):
            for only_actions in (False, True):
                key = f"policy/{attention}/share={share}/only_actions={only_actions}"
                results[key] = policy_case(
                    policy, batch, weights, group, share_prefix=share, only_actions=only_actions
                )
            results[f"critic/{attention}/share={share}"] = critic_case(
                critic, batch, weights, group, share_prefix=share
            )
    # an odd length (padding on the last rank) and an empty micro-batch (one padded dummy token per rank)
    odd = next(
        part
        for part in (batch.select(range(count)) for count in range(batch.num_sequences - 1, 0, -1))
        if part.num_tokens % 2
    )
    results["policy/odd_length"] = policy_case(tiny_policy(tokenizer), odd, weights[: odd.num_tokens], group)
    results["odd_num_tokens"] = odd.num_tokens
    # gradient checkpointing re-runs each layer, its all-to-alls included, in the backward pass
    checkpointed = tiny_policy(tokenizer)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed.train()
    results["policy/gradient_checkpointing"] = policy_case(checkpointed, batch, weights, group)
    empty = ExperienceBatch.empty(with_rollout_logprobs=True)
    results["policy/empty"] = policy_case(tiny_policy(tokenizer), empty, weights[:0], group)
    try:
        check_heads(4, 2, 4)
        results["heads_error"] = "no error"
    except ValueError as error:
        results["heads_error"] = str(error)
    (out / f"diffs{rank}.json").write_text(json.dumps(results, indent=1))


def main() -> None:
    dist.init_process_group("gloo")
    diffs(pathlib.Path(sys.argv[1]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
