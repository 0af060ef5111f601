"""Evaluation metrics from scored responses: mean reward and length, pass@k and mean@k, per dataset.

A response is correct when its reward is above the threshold (`eval.correct_threshold`, strictly).
For a prompt with n responses of which c are correct:

    pass@k = 1 − C(n−c, k) / C(n, k)   (the probability that k of the n responses, drawn without
                                         replacement, hold a correct one; unbiased, Chen et al. 2021,
                                         "Evaluating Large Language Models Trained on Code")
    mean@k = c / n                     (the share of correct responses)

and each is averaged over prompts. With k = n (the run samples `eval.n_samples_per_prompt`
responses and reports k = n), pass@k is 1 when any response is correct and 0 otherwise. The
metrics are named `eval/reward/mean`, `eval/response_length/mean`, `eval/pass@k`, `eval/mean@k`
(the last two when k > 1), and the same under `eval/<dataset>/` per evaluation dataset when
there are several.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rl_rollout.episodes import episode_ends

__all__ = ["eval_metrics", "pass_at_k"]


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """1 − C(n−c, k) / C(n, k) for n = num_samples responses, c = num_correct of them correct."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"pass@k: k = {k} must be in 1..n = {num_samples}")
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"pass@k: {num_correct} correct of {num_samples} responses")
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def _group_metrics(groups: Sequence[Sequence[Any]], k: int, threshold: float) -> dict[str, float]:
    """reward/mean and response_length/mean over all responses; pass@k and mean@k over prompts."""
    responses = [record for group in groups for record in group]
    metrics = {
        "reward/mean": sum(record.reward for record in responses) / len(responses),
        "response_length/mean": sum(float(record.response_ids.numel()) for record in responses)
        / len(responses),
    }
    if k > 1:
        correct = [sum(record.reward > threshold for record in group) for group in groups]
        metrics[f"pass@{k}"] = sum(pass_at_k(len(g), c, k) for g, c in zip(groups, correct)) / len(groups)
        metrics[f"mean@{k}"] = sum(c / len(g) for g, c in zip(groups, correct)) / len(groups)
    return metrics


def eval_metrics(
    records: Sequence[Any], *, k: int, threshold: float, labels: Mapping[str, str] | None = None
) -> dict[str, float]:
    """The `eval/...` metrics of scored responses (module doc).

    Args:
        records: `Trajectory`-like objects with `reward`, `response_ids`, `group_id` (responses
            to one prompt share it) and `extra["source"]` (the prompt's dataset).
        k: responses per prompt to score pass@k / mean@k with (`eval.n_samples_per_prompt`);
            every prompt needs at least k responses.
        threshold: a response is correct when its reward > threshold.
        labels: dataset source -> metric name; with two or more, per-dataset metrics are added as
            `eval/<name>/...` (a source missing from it is named by itself).
    """
    if not records:
        raise ValueError("eval_metrics: no records")
    groups: dict[int, list[Any]] = {}
    for record in episode_ends(records):  # an episode trained as segments is one response
        groups.setdefault(record.group_id, []).append(record)
    short = [len(group) for group in groups.values() if len(group) < k]
    if short:
        raise ValueError(f"eval_metrics: a prompt has {short[0]} responses, fewer than k = {k}")
    metrics = {
        f"eval/{name}": value for name, value in _group_metrics(list(groups.values()), k, threshold).items()
    }
    if labels is not None and len(labels) > 1:
        by_source: dict[str, list[list[Any]]] = {}
        for group in groups.values():
            source = str(group[0].extra.get("source", ""))
            by_source.setdefault(labels.get(source, source or "unknown"), []).append(group)
        for label, source_groups in by_source.items():
            for name, value in _group_metrics(source_groups, k, threshold).items():
                metrics[f"eval/{label}/{name}"] = value
    return metrics
