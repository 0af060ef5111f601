"""Packed attention in length buckets: same outputs and gradients as per-sequence forwards and as
the old dense block-diagonal mask, for sdpa and eager, policies, critics and reward models."""

from __future__ import annotations

import itertools
import pathlib
import sys

import pytest
import torch

from rl_data import ExperienceBatch, Trajectory, build_experience, packed_attention_mask
from rl_data.tiny import build_tiny_model
from rl_learner.models import (
    length_buckets,
    load_value_model,
    packed_logprobs,
    packed_model_inputs,
    packed_scores,
    packed_values,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _helpers_core import experience

ATOL = 1e-5  # float32 models


@pytest.fixture(scope="module")
def batch() -> ExperienceBatch:
    # 10 sequences of 4 to 13 tokens: several buckets, some with padding.
    return experience(10, seed=7)


def _sequences(batch: ExperienceBatch) -> list[torch.Tensor]:
    return [batch.input_ids[a:b] for a, b in itertools.pairwise(batch.cu_seqlens.tolist())]


def _model(tokenizer, architecture: str, attention: str, **config):
    model = build_tiny_model(tokenizer, architecture=architecture, seed=1)
    for key, value in config.items():
        setattr(model.config, key, value)
    model.config._attn_implementation = attention
    return model


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[L, V] logits of one sequence → [L] log-probs, 0 at the first token."""
    step = torch.log_softmax(logits[:-1].float(), -1).gather(-1, ids[1:, None])[:, 0]
    return torch.cat([step.new_zeros(1), step])


def _dense_mask_logprobs(model, batch: ExperienceBatch) -> torch.Tensor:
    """The old packed forward: one [1, 1, N, N] block-diagonal mask (additive for eager)."""
    mask = packed_attention_mask(batch.cu_seqlens)[None, None]
    if model.config._attn_implementation == "eager":
        mask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    logits = model(
        input_ids=batch.input_ids[None],
        position_ids=batch.position_ids[None],
        attention_mask=mask,
        use_cache=False,
    ).logits[0]
    return torch.cat(
        [
            _token_logprobs(logits[a:b], batch.input_ids[a:b])
            for a, b in itertools.pairwise(batch.cu_seqlens.tolist())
        ]
    )


def _per_sequence_logprobs(model, batch: ExperienceBatch) -> torch.Tensor:
    return torch.cat([_token_logprobs(model(ids[None]).logits[0], ids) for ids in _sequences(batch)])


def _gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_gradients(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Equal to ATOL × the gradient's largest entry (float32 sums of ~N terms of that size)."""
    assert ours.keys() == expected.keys()
    assert len(expected) > 0
    for name, grad in expected.items():
        scale = float(grad.abs().max())
        assert scale > 0, f"{name}: no gradient reached it"
        torch.testing.assert_close(
            ours[name], grad, rtol=0, atol=ATOL * max(1.0, scale), msg=lambda m, name=name: f"{name}: {m}"
        )


# --------------------------------------------------------------------------- buckets


def test_length_buckets_keep_padding_within_the_waste_bound_and_round_trip():
    lengths = torch.tensor([3, 17, 5, 17, 16, 1, 9, 8, 8, 2])
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
    tokens = torch.arange(int(lengths.sum()))
    for max_waste in (0.0, 0.1, 0.5, 100.0):
        buckets = length_buckets(cu_seqlens, max_waste=max_waste)
        for gather in buckets.gathers:
            rows = [tokens[row] for row in gather]
            real = sum(len(torch.unique(row)) for row in rows)
            assert gather.numel() <= (1 + max_waste) * real
        slots = torch.cat([tokens[gather].reshape(-1) for gather in buckets.gathers])
        assert torch.equal(slots[buckets.order], tokens)  # every token once, back in packed order
    assert [g.shape for g in length_buckets(cu_seqlens, max_waste=0.0).gathers] == [
        (2, 17), (1, 16), (1, 9), (2, 8), (1, 5), (1, 3), (1, 2), (1, 1)
    ]  # fmt: skip
    assert len(length_buckets(cu_seqlens, max_waste=100.0).gathers) == 1


def test_length_buckets_pad_by_repeating_the_last_token_and_skip_empty_sequences():
    buckets = length_buckets(torch.tensor([0, 2, 2, 5]), max_waste=1.0)
    assert [g.tolist() for g in buckets.gathers] == [[[2, 3, 4], [0, 1, 1]]]
    assert buckets.order.tolist() == [3, 4, 0, 1, 2]


def test_length_buckets_refuse_bad_arguments():
    with pytest.raises(ValueError, match=r"max_waste: -0\.5 is not allowed"):
        length_buckets(torch.tensor([0, 3]), max_waste=-0.5)
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing, got \[0, 3, 2\]"):
        length_buckets(torch.tensor([0, 3, 2]))


# --------------------------------------------------------------------------- policies


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_logprobs_and_gradients_equal_the_dense_mask_and_per_sequence_forwards(
    tokenizer, batch, architecture, attention
):
    packed_model = _model(tokenizer, architecture, attention)
    dense_model = _model(tokenizer, architecture, attention)
    weights = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(0))

    logprobs = packed_logprobs(packed_model, batch)
    assert packed_model.config._attn_implementation == f"rl_packed_{attention}"
    (logprobs * weights).sum().backward()
    dense = _dense_mask_logprobs(dense_model, batch)
    (dense * weights).sum().backward()
    with torch.no_grad():
        per_sequence = _per_sequence_logprobs(dense_model, batch)

    torch.testing.assert_close(logprobs, dense, rtol=0, atol=ATOL)
    torch.testing.assert_close(logprobs, per_sequence, rtol=0, atol=ATOL)
    _assert_same_gradients(_gradients(packed_model), _gradients(dense_model))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_attention_respects_a_sliding_window(tokenizer, attention):
    # Qwen2 with every layer windowed to 4 tokens: sequences longer than the window must see only it.
    model = _model(
        tokenizer,
        "qwen2",
        attention,
        use_sliding_window=True,
        sliding_window=4,
        layer_types=["sliding_attention"] * 2,
    )
    model.model.has_sliding_layers = True
    for layer in model.model.layers:
        layer.self_attn.sliding_window = 4
    batch = experience(6, seed=11)
    with torch.no_grad():
        per_sequence = _per_sequence_logprobs(model, batch)
        logprobs = packed_logprobs(model, batch)
        full = _per_sequence_logprobs(_model(tokenizer, "qwen2", attention), batch)
    assert (per_sequence - full).abs().max() > 1e-3  # the window changes the answer
    torch.testing.assert_close(logprobs, per_sequence, rtol=0, atol=ATOL)


def test_sdpa_buckets_run_causal_without_a_mask(tokenizer, batch, monkeypatch):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    stock = ALL_ATTENTION_FUNCTIONS["sdpa"]
    calls = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        calls.append((tuple(query.shape), attention_mask))
        return stock(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "sdpa", recording)
    model = _model(tokenizer, "qwen2", "sdpa")
    with torch.no_grad():
        packed_logprobs(model, batch)
    buckets = length_buckets(batch.cu_seqlens)
    longest = int((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).max())
    assert len(calls) == model.config.num_hidden_layers * len(buckets.gathers)
    assert all(mask is None for _, mask in calls)
    assert max(shape[2] for shape, _ in calls) == longest  # per-sequence widths, never N


def test_gradient_checkpointing_through_packed_attention_gives_the_same_gradients(tokenizer, batch):
    def gradients(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = _model(tokenizer, "qwen2", "sdpa")
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        (packed_logprobs(model, batch) * batch.action_mask).sum().backward()
        return _gradients(model)

    _assert_same_gradients(gradients(True), gradients(False))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_switched_model_still_runs_padded_batches_as_the_stock_implementation(tokenizer, batch, attention):
    switched, stock = _model(tokenizer, "qwen2", attention), _model(tokenizer, "qwen2", attention)
    packed_model_inputs(switched, batch)
    assert switched.config._attn_implementation == f"rl_packed_{attention}"
    sequences = _sequences(batch)
    width = max(len(ids) for ids in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.int64)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(sequences):
        input_ids[row, width - len(ids) :] = ids  # left padding, as generate pads
        attention_mask[row, width - len(ids) :] = 1
    with torch.no_grad():
        ours = switched(input_ids=input_ids, attention_mask=attention_mask).logits
        theirs = stock(input_ids=input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_an_attention_implementation_without_a_packed_forward_is_named(tokenizer, batch):
    model = _model(tokenizer, "qwen2", "sdpa")
    model.config._attn_implementation = "paged|eager"
    with pytest.raises(ValueError, match=r"attention implementation 'paged\|eager' has no packed forward"):
        packed_model_inputs(model, batch)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_empty_batch_runs_one_dummy_token_connected_to_the_model(tokenizer, attention):
    model = _model(tokenizer, "qwen2", attention)
    logprobs, entropy = packed_logprobs(model, ExperienceBatch.empty(), with_entropy=True)
    assert logprobs.shape == entropy.shape == (0,)
    (logprobs.sum() + entropy.sum()).backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


# --------------------------------------------------------------------------- critics, reward models


@pytest.fixture(scope="module")
def value_checkpoint(tokenizer, tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("value")
    build_tiny_model(tokenizer, seed=2).save_pretrained(path)
    return path


def _value_model(path, tokenizer, attention: str):
    model = load_value_model(
        path, dtype=torch.float32, attn_implementation=attention, pad_token_id=tokenizer.pad_token_id
    )
    with torch.no_grad():
        model.score.weight.mul_(50.0)  # values of order 1
    return model


def _dense_mask_scores(model, batch: ExperienceBatch) -> torch.Tensor:
    """[N] score head at every position of the old dense-mask packed forward."""
    captured = {}
    handle = model.score.register_forward_hook(lambda _m, _i, output: captured.update(output=output))
    mask = packed_attention_mask(batch.cu_seqlens)[None, None]
    if model.config._attn_implementation == "eager":
        mask = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None], attention_mask=mask)
    handle.remove()
    return captured["output"][0, :, 0]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_values_and_scores_take_the_bucketed_path_and_match_the_dense_mask(
    value_checkpoint, tokenizer, batch, attention
):
    packed_model = _value_model(value_checkpoint, tokenizer, attention)
    dense_model = _value_model(value_checkpoint, tokenizer, attention)
    assert "packed_length_buckets" in packed_model_inputs(packed_model, batch)
    weights = torch.randn(batch.num_tokens, generator=torch.Generator().manual_seed(1))

    values = packed_values(packed_model, batch)
    scores = packed_scores(packed_model, batch)
    (values * weights).sum().add(scores.sum()).backward()
    dense = _dense_mask_scores(dense_model, batch)
    starts = batch.position_ids == 0
    dense_values = torch.where(starts, 0.0, torch.cat([dense.new_zeros(1), dense[:-1]]))
    dense_scores = dense[batch.cu_seqlens[1:].long() - 1]
    (dense_values * weights).sum().add(dense_scores.sum()).backward()

    assert packed_model.config._attn_implementation == f"rl_packed_{attention}"
    assert dense_scores.abs().max() > 0.1
    torch.testing.assert_close(values, dense_values, rtol=0, atol=ATOL)
    torch.testing.assert_close(scores, dense_scores, rtol=0, atol=ATOL)
    with torch.no_grad():
        alone = [dense_model(input_ids=ids[None]).logits[0, 0] for ids in _sequences(batch)]
    torch.testing.assert_close(scores, torch.stack(alone).detach(), rtol=0, atol=ATOL)
    _assert_same_gradients(_gradients(packed_model), _gradients(dense_model))


def test_empty_batch_values_and_scores_are_connected_to_the_value_model(value_checkpoint, tokenizer):
    model = _value_model(value_checkpoint, tokenizer, "sdpa")
    values, scores = (
        packed_values(model, ExperienceBatch.empty()),
        packed_scores(model, ExperienceBatch.empty()),
    )
    assert values.shape == scores.shape == (0,)
    (values.sum() + scores.sum()).backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_short_sequences_match_per_sequence_forwards(tokenizer):
    model = _model(tokenizer, "qwen2", "sdpa")
    batch = build_experience(
        [Trajectory(prompt_ids=[5], response_ids=[8]), Trajectory(prompt_ids=[6, 7, 9], response_ids=[10])]
    )
    with torch.no_grad():
        torch.testing.assert_close(
            packed_logprobs(model, batch), _per_sequence_logprobs(model, batch), rtol=0, atol=ATOL
        )


# ---------------------------------------------------------------------------------- only_actions


@pytest.mark.parametrize("with_entropy", [False, True])
def test_only_actions_gives_the_same_values_and_gradients_at_action_tokens(with_entropy):
    from _helpers_core import experience

    from rl_data.tiny import build_tiny_model, build_tiny_tokenizer
    from rl_learner.models import packed_logprobs

    tokenizer = build_tiny_tokenizer()
    batch = experience(12, seed=3)  # some responses hold an environment token (action mask 0)
    results = {}
    for only in (False, True):
        model = build_tiny_model(tokenizer, seed=0)
        out = packed_logprobs(model, batch, with_entropy=with_entropy, only_actions=only)
        logprobs, entropy = out if with_entropy else (out, None)
        on = batch.action_mask
        loss = logprobs[on].sum() + (entropy[on].sum() if with_entropy else 0.0)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[only] = (logprobs.detach(), None if entropy is None else entropy.detach(), grads)
    full, only = results[False], results[True]
    on = batch.action_mask
    assert not on.all()
    torch.testing.assert_close(only[0][on], full[0][on], rtol=0, atol=1e-6)
    assert torch.count_nonzero(only[0][~on]) == 0
    if with_entropy:
        torch.testing.assert_close(only[1][on], full[1][on], rtol=0, atol=1e-6)
        assert torch.count_nonzero(only[1][~on]) == 0
    torch.testing.assert_close(only[2], full[2], rtol=1e-5, atol=1e-6)
