"""Tests of rl_data.datasets.sampler: reproducible epochs, exact resume, refused foreign states."""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_data.datasets.sampler import PromptLoader, ResumableSampler, SamplerState, epoch_seed
from rl_data.errors import DataError
from rl_data.records import PromptSample


def take(iterable, count):
    return list(itertools.islice(iterable, count))


# --------------------------------------------------------------------------- order of an epoch


def test_an_epoch_visits_every_row_once_in_batches_of_batch_size():
    sampler = ResumableSampler(12, batch_size=4, seed=3)
    batches = list(sampler.iter_epoch())
    assert [len(batch) for batch in batches] == [4, 4, 4]
    assert sorted(index for batch in batches for index in batch) == list(range(12))
    assert batches != [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_the_epoch_order_is_the_documented_torch_permutation():
    sampler = ResumableSampler(10, batch_size=5, seed=7, drop_last=False)
    for epoch in range(3):
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(epoch_seed(7, epoch))).tolist()
        assert [index for batch in sampler.iter_epoch() for index in batch] == expected


def test_epoch_seeds_mix_seed_and_epoch_so_neighbouring_runs_do_not_share_epochs():
    assert epoch_seed(42, 1) != epoch_seed(43, 0)
    assert epoch_seed(42, 0) == epoch_seed(42, 0)
    assert 0 <= epoch_seed(2**40, 10**6) < 2**63


def test_each_epoch_has_its_own_order_and_the_same_seed_gives_the_same_orders():
    first = take(ResumableSampler(50, batch_size=50, seed=1), 3)
    again = take(ResumableSampler(50, batch_size=50, seed=1), 3)
    other = take(ResumableSampler(50, batch_size=50, seed=2), 3)
    assert first == again
    assert first[0] != first[1] != first[2]
    assert first != other


def test_without_shuffle_rows_come_in_file_order_every_epoch():
    sampler = ResumableSampler(5, batch_size=2, shuffle=False, drop_last=False)
    assert take(sampler, 6) == [[0, 1], [2, 3], [4], [0, 1], [2, 3], [4]]


def test_drop_last_leaves_out_the_tail_of_each_epoch_and_len_counts_batches():
    dropping = ResumableSampler(10, batch_size=4, shuffle=False, drop_last=True)
    keeping = ResumableSampler(10, batch_size=4, shuffle=False, drop_last=False)
    assert (len(dropping), len(keeping)) == (2, 3)
    assert list(dropping.iter_epoch()) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert list(keeping.iter_epoch()) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_state_counts_epochs_positions_and_consumed_samples():
    sampler = ResumableSampler(10, batch_size=4, seed=0, drop_last=False)
    iterator = iter(sampler)
    next(iterator)
    state = sampler.state_dict()
    assert (state.epoch, state.position, state.consumed_samples) == (0, 4, 4)
    next(iterator), next(iterator)  # the last batch (2 rows) ends the epoch
    state = sampler.state_dict()
    assert (state.epoch, state.position, state.consumed_samples) == (1, 0, 10)
    next(iterator)
    assert (sampler.epoch, sampler.position, sampler.consumed_samples) == (1, 4, 14)


# --------------------------------------------------------------------------- resume


def run_with_interruption(settings_kwargs, total, stop_after):
    """Batches of a run that checkpoints after `stop_after` batches and resumes in a new sampler."""
    first = ResumableSampler(**settings_kwargs)
    head = take(first, stop_after)
    encoded = msgspec.msgpack.encode(first.state_dict())
    second = ResumableSampler(**settings_kwargs)
    second.load_state_dict(msgspec.msgpack.decode(encoded, type=SamplerState))
    return head + take(second, total - stop_after), first.state_dict(), second.state_dict()


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
def test_resuming_after_any_batch_reproduces_the_uninterrupted_run(shuffle, drop_last):
    kwargs = dict(num_rows=7, batch_size=3, seed=11, shuffle=shuffle, drop_last=drop_last)
    total = 10  # several epochs
    reference = take(ResumableSampler(**kwargs), total)
    for stop_after in range(total + 1):
        batches, _, _ = run_with_interruption(kwargs, total, stop_after)
        assert batches == reference, stop_after


@settings(max_examples=60, deadline=None)
@given(
    num_rows=st.integers(1, 30),
    batch_size=st.integers(1, 30),
    seed=st.integers(0, 2**32),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    total=st.integers(0, 25),
    data=st.data(),
)
def test_resume_is_exact_for_any_settings_and_stopping_point(
    num_rows, batch_size, seed, shuffle, drop_last, total, data
):
    if drop_last and batch_size > num_rows:
        batch_size = num_rows
    kwargs = dict(num_rows=num_rows, batch_size=batch_size, seed=seed, shuffle=shuffle, drop_last=drop_last)
    stop_after = data.draw(st.integers(0, total))
    reference_sampler = ResumableSampler(**kwargs)
    reference = take(reference_sampler, total)
    batches, _, resumed_state = run_with_interruption(kwargs, total, stop_after)
    assert batches == reference
    assert resumed_state == reference_sampler.state_dict()
    assert resumed_state.consumed_samples == sum(len(batch) for batch in reference)


def test_resuming_inside_iter_epoch_yields_only_the_rest_of_that_epoch():
    sampler = ResumableSampler(9, batch_size=3, seed=5)
    whole_epoch = list(ResumableSampler(9, batch_size=3, seed=5).iter_epoch())
    next(sampler.iter_epoch())
    resumed = ResumableSampler(9, batch_size=3, seed=5)
    resumed.load_state_dict(sampler.state_dict())
    assert list(resumed.iter_epoch()) == whole_epoch[1:]
    assert resumed.epoch == 1


def test_a_state_loads_from_its_dict_form():
    sampler = ResumableSampler(8, batch_size=2, seed=4)
    take(sampler, 5)
    resumed = ResumableSampler(8, batch_size=2, seed=4)
    resumed.load_state_dict(msgspec.to_builtins(sampler.state_dict()))
    assert take(resumed, 3) == take(sampler, 3)


@pytest.mark.parametrize(
    ("field", "changed", "pattern"),
    [
        ("num_rows", dict(num_rows=9), "num_rows is 8 in the checkpoint but 9 now"),
        ("batch_size", dict(batch_size=4), "batch_size is 2 in the checkpoint but 4 now"),
        ("seed", dict(seed=5), "seed is 4 in the checkpoint but 5 now"),
        ("shuffle", dict(shuffle=False), "shuffle is True in the checkpoint but False now"),
        ("drop_last", dict(drop_last=False), "drop_last is True in the checkpoint but False now"),
    ],
)
def test_a_state_from_other_settings_is_refused_naming_the_field(field, changed, pattern):
    kwargs = dict(num_rows=8, batch_size=2, seed=4, shuffle=True, drop_last=True)
    state = ResumableSampler(**kwargs).state_dict()
    with pytest.raises(DataError, match=pattern):
        ResumableSampler(**{**kwargs, **changed}).load_state_dict(state)


def test_a_state_with_an_impossible_position_is_refused():
    sampler = ResumableSampler(8, batch_size=2)
    state = msgspec.structs.replace(sampler.state_dict(), position=9)
    with pytest.raises(DataError, match=r"position 9 is outside 0\.\.8"):
        sampler.load_state_dict(state)
    with pytest.raises(DataError, match="epoch -1"):
        sampler.load_state_dict(msgspec.structs.replace(sampler.state_dict(), epoch=-1))


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(num_rows=0, batch_size=1), "num_rows: expected an integer >= 1, got 0"),
        (dict(num_rows=4, batch_size=0), "batch_size: expected an integer >= 1, got 0"),
        (dict(num_rows=4, batch_size=2, seed=-1), "seed: expected an integer >= 0, got -1"),
        (dict(num_rows=4, batch_size=2.0), "batch_size: expected an integer"),
        (dict(num_rows=3, batch_size=4), "batch_size: 4 is larger than the 3 rows"),
    ],
)
def test_bad_sampler_arguments_are_refused(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ResumableSampler(**kwargs)


def test_a_batch_larger_than_the_data_is_one_short_batch_without_drop_last():
    assert take(ResumableSampler(3, batch_size=4, shuffle=False, drop_last=False), 2) == [
        [0, 1, 2],
        [0, 1, 2],
    ]


# --------------------------------------------------------------------------- PromptLoader


def make_samples(count):
    return [PromptSample(prompt_ids=[index], prompt=f"p{index}", index=index) for index in range(count)]


def test_prompt_loader_yields_dataset_items_in_the_sampler_order():
    samples = make_samples(10)
    loader = PromptLoader(samples, batch_size=4, seed=9)
    sampler = ResumableSampler(10, batch_size=4, seed=9)
    for batch, indices in zip(take(loader, 5), take(sampler, 5)):
        assert [sample.index for sample in batch] == indices
        assert all(isinstance(sample, PromptSample) for sample in batch)
    assert len(loader) == 2
    assert (loader.epoch, loader.consumed_samples) == (2, 20)


def test_prompt_loader_resumes_through_a_msgpack_round_trip():
    samples = make_samples(11)
    reference = [[s.index for s in batch] for batch in take(PromptLoader(samples, batch_size=3, seed=1), 9)]
    loader = PromptLoader(samples, batch_size=3, seed=1)
    head = [[s.index for s in batch] for batch in take(loader, 4)]
    encoded = msgspec.msgpack.encode(loader.state_dict())
    resumed = PromptLoader(samples, batch_size=3, seed=1)
    resumed.load_state_dict(msgspec.msgpack.decode(encoded, type=SamplerState))
    tail = [[s.index for s in batch] for batch in take(resumed, 5)]
    assert head + tail == reference
    assert resumed.consumed_samples == 27


def test_prompt_loader_iter_epoch_stops_at_the_end_of_the_epoch():
    loader = PromptLoader(make_samples(5), batch_size=2, shuffle=False, drop_last=False)
    assert [[s.index for s in batch] for batch in loader.iter_epoch()] == [[0, 1], [2, 3], [4]]
    assert loader.epoch == 1


def test_prompt_loader_refuses_a_checkpoint_of_a_dataset_of_another_size():
    state = PromptLoader(make_samples(6), batch_size=2).state_dict()
    with pytest.raises(DataError, match="num_rows is 6 in the checkpoint but 7 now"):
        PromptLoader(make_samples(7), batch_size=2).load_state_dict(state)
