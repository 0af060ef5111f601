"""The FSDP2 learner backend (`DeepSpeedConfig.backend = "fsdp2"`, `rl_learner.fsdp2`) in this
process, on a one-rank gloo world: a `fully_shard` policy takes the same step as DeepSpeed's
ZeRO-0 learner, saves and resumes through `rl_learner.checkpoint`, and sends its weights with the
same checksums as the unsharded model; a `fully_shard` critic (value head sharded with the root
unit) and the supervised learners (sft, dpo with its frozen reference, rm) take DeepSpeed's
step too. One slow test starts two gloo ranks (`_worker_fsdp2.py`): a team's own `fully_shard`
loop syncing through `make_sender`, the FSDP2 policy's and critic's steps on two ranks against
this process's one-rank steps, a policy checkpoint resumed across world sizes (2 -> 1, 1 -> 2),
FSDP × TP = 1 × 2 (`tensor_parallel_size=2`): one rank's policy and critic steps, the unsharded
model's checksums, and a TP checkpoint resumed on one rank; and a LoRA (peft) policy on two ranks:
one rank's step, the unsharded peft model's merged and adapter-only sync checksums, its
checkpoint resumed on one rank. A LoRA policy on one rank also takes DeepSpeed's step, syncs,
exports the merged model and resumes, and a LoRA critic (score head trained whole) takes
DeepSpeed's step and exports its merged model (fast).
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
import torch
import torch.distributed as dist

from rl_data import WeightSyncReport, compare_checksums, decode
from rl_data.sync import WeightSyncSpec
from rl_data.sync.broadcast import free_port
from rl_data.sync.file import read_buckets
from rl_data.tiny import build_tiny_model
from rl_learner import (
    CheckpointError,
    DeepSpeedConfig,
    DPOLearner,
    DPOLossConfig,
    LoraOptions,
    OptimizerConfig,
    PolicyLearner,
    RewardModelLearner,
    SFTLearner,
    TrainingState,
    ValueLearner,
    apply_lora,
    load_checkpoint,
    pack_pairs,
    pack_sequences,
    save_checkpoint,
)
from rl_learner.fsdp2 import fsdp2_refusals
from rl_learner.models import packed_logprobs, packed_scores, packed_values
from rl_learner.senders import FileSender
from rl_learner.sync import make_sender, sync_layout

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _helpers_core import experience, fill_policy_slots, fill_value_slots, tiny_critic, tiny_policy
from _worker_fsdp2 import LOSS, OPTIMIZER, SMALL_BUCKETS, VALUE_LOSS, lora_policy, lora_syncs
from _worker_supervised import pairs, sft_samples

from tests.learner.single_rank import start_ranks, wait_ranks
from tests.test_declared_dependencies import declared_only_env

FSDP2 = DeepSpeedConfig(backend="fsdp2", dtype="fp32")


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo world for this module (left as it was found)."""
    made = not dist.is_initialized()
    if made:
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    if made:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def batch(tokenizer):
    full = experience(8)
    with torch.no_grad():
        fill_policy_slots(full, packed_logprobs(tiny_policy(tokenizer), full).float())
    return full


def _learner(tokenizer, ds: DeepSpeedConfig = FSDP2) -> PolicyLearner:
    return PolicyLearner(tiny_policy(tokenizer), deepspeed=ds, optimizer=OPTIMIZER, total_steps=4)


def _state(learner) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().detach().clone() for name, p in learner.module.named_parameters()}


def test_fsdp2_policy_step_equals_deepspeeds_and_its_weights_are_dtensors(world, tokenizer, batch):
    fsdp2 = _learner(tokenizer)
    deepspeed = _learner(tokenizer, DeepSpeedConfig(zero_stage=0, dtype="fp32"))
    assert all(hasattr(p, "full_tensor") for p in fsdp2.module.parameters())
    torch.testing.assert_close(fsdp2.logprobs([batch])[0], deepspeed.logprobs([batch])[0], rtol=0, atol=1e-6)
    halves = [batch.select(range(4)), batch.select(range(4, 8))]
    got, want = fsdp2.train_step(halves, LOSS), deepspeed.train_step(halves, LOSS)
    for key in ("loss", "grad_norm", "entropy", "kl", "tokens", "lr"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    assert got["skipped"] == 0.0
    assert fsdp2.step == 1
    expected = {name: p.detach() for name, p in deepspeed.module.named_parameters()}
    for name, value in _state(fsdp2).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_fsdp2_non_finite_advantages_skip_the_step(world, tokenizer, batch):
    learner = _learner(tokenizer)
    before = _state(learner)
    broken = batch.select(range(8))
    broken.advantages = broken.advantages.clone()
    broken.advantages[0] = float("nan")
    assert learner.train_step([broken], LOSS)["skipped"] == 1.0
    assert learner.step == 0
    assert all(torch.equal(before[name], value) for name, value in _state(learner).items())


def test_fsdp2_checkpoint_resumes_with_the_same_next_step(world, tokenizer, batch, tmp_path):
    learner = _learner(tokenizer)
    learner.train_step([batch], LOSS)
    save_checkpoint(tmp_path, 1, {"policy": learner.engine}, TrainingState(step=1), save_rng=False)
    following = learner.train_step([batch], LOSS)
    resumed = _learner(tokenizer)
    assert load_checkpoint(tmp_path, {"policy": resumed.engine}, restore_rng=False).step == 1
    assert resumed.step == 1
    again = resumed.train_step([batch], LOSS)
    assert again["loss"] == following["loss"]
    assert again["grad_norm"] == following["grad_norm"]
    assert again["lr"] == following["lr"]
    after, want = _state(resumed), _state(learner)
    assert all(torch.equal(after[name], want[name]) for name in want)
    # Across backends the files differ: refused, naming the backend to resume with.
    deepspeed = _learner(tokenizer, DeepSpeedConfig(zero_stage=0, dtype="fp32"))
    with pytest.raises(
        CheckpointError, match=r"saved by the fsdp2 learner backend and now runs on deepspeed"
    ):
        load_checkpoint(tmp_path, {"policy": deepspeed.engine}, restore_rng=False)
    save_checkpoint(tmp_path / "ds", 1, {"policy": deepspeed.engine}, TrainingState(step=1), save_rng=False)
    with pytest.raises(
        CheckpointError, match=r"saved by the deepspeed learner backend .* --train.backend deepspeed"
    ):
        load_checkpoint(tmp_path / "ds", {"policy": resumed.engine}, restore_rng=False)


def test_fsdp2_policy_sends_the_unsharded_models_bytes(world, tokenizer, batch, tmp_path):
    learner = _learner(tokenizer)
    learner.train_step([batch], LOSS)
    layout = sync_layout(learner.engine, dtype=torch.bfloat16, bucket_bytes=64 * 1024)
    spec = WeightSyncSpec(transport="file", layout=layout, directory=str(tmp_path / "fsdp2"))
    sent = make_sender(spec, learner.engine).send(version=1)
    plain = tiny_policy(tokenizer)
    plain.load_state_dict(_state(learner))
    assert sync_layout(plain, dtype=torch.bfloat16, bucket_bytes=64 * 1024) == layout
    spec = WeightSyncSpec(transport="file", layout=layout, directory=str(tmp_path / "plain"))
    assert compare_checksums(FileSender(plain, spec).send(version=1), sent) == []


def test_fsdp2_bf16_keeps_fp32_master_weights_and_export_hf_writes_them(world, tokenizer, batch, tmp_path):
    from transformers import AutoModelForCausalLM

    from rl_learner import export_hf

    learner = PolicyLearner(
        tiny_policy(tokenizer, torch.bfloat16),
        deepspeed=DeepSpeedConfig(backend="fsdp2", dtype="bf16"),
        optimizer=OPTIMIZER,
        total_steps=4,
    )
    assert {p.dtype for p in learner.module.parameters()} == {torch.float32}  # the master weights
    with torch.no_grad():
        exact = packed_logprobs(tiny_policy(tokenizer), batch).float()
    computed = learner.logprobs([batch])[0]
    assert 0 < float((computed - exact).abs().max()) < 2e-2  # a bf16 forward, not the fp32 one
    assert learner.train_step([batch], LOSS)["skipped"] == 0.0
    exported = AutoModelForCausalLM.from_pretrained(export_hf(learner.engine, tmp_path / "hf"))
    weights = exported.state_dict()
    assert all(torch.equal(weights[name], value) for name, value in _state(learner).items())


def _critic(tokenizer, ds: DeepSpeedConfig = FSDP2) -> ValueLearner:
    return ValueLearner(tiny_critic(tokenizer), deepspeed=ds, optimizer=OPTIMIZER, total_steps=4)


@pytest.fixture(scope="module")
def value_batch(tokenizer, batch):
    full = batch.select(range(8))
    with torch.no_grad():
        fill_value_slots(full, packed_values(tiny_critic(tokenizer), full).float())
    return full


def test_fsdp2_critic_step_equals_deepspeeds_and_its_score_head_is_sharded(world, tokenizer, value_batch):
    fsdp2 = _critic(tokenizer)
    deepspeed = _critic(tokenizer, DeepSpeedConfig(zero_stage=0, dtype="fp32"))
    assert hasattr(fsdp2.module.score.weight, "full_tensor")  # the value head is a root-unit shard
    for got, want in [
        (fsdp2.values([value_batch])[0], deepspeed.values([value_batch])[0]),
        (fsdp2.scores([value_batch])[0], deepspeed.scores([value_batch])[0]),
    ]:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    halves = [value_batch.select(range(4)), value_batch.select(range(4, 8))]
    got, want = fsdp2.train_step(halves, VALUE_LOSS), deepspeed.train_step(halves, VALUE_LOSS)
    for key in ("loss", "grad_norm", "value_mean", "value_clip_fraction", "tokens", "lr"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    assert (got["skipped"], fsdp2.step) == (0.0, 1)
    expected = {name: p.detach() for name, p in deepspeed.module.named_parameters()}
    for name, value in _state(fsdp2).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_fsdp2_critic_resumes_and_exports_and_a_reward_model_scores_like_the_plain_model(
    world, tokenizer, value_batch, tmp_path
):
    from transformers import AutoModelForSequenceClassification

    from rl_learner import export_hf

    critic = _critic(tokenizer)
    critic.train_step([value_batch], VALUE_LOSS)
    save_checkpoint(tmp_path, 1, {"critic": critic.engine}, TrainingState(step=1), save_rng=False)
    following = critic.train_step([value_batch], VALUE_LOSS)
    resumed = _critic(tokenizer)
    assert load_checkpoint(tmp_path, {"critic": resumed.engine}, restore_rng=False).step == 1
    again = resumed.train_step([value_batch], VALUE_LOSS)
    assert (again["loss"], again["grad_norm"]) == (following["loss"], following["grad_norm"])
    after, want = _state(resumed), _state(critic)
    assert all(torch.equal(after[name], want[name]) for name in want)
    exported = AutoModelForSequenceClassification.from_pretrained(export_hf(critic.engine, tmp_path / "hf"))
    weights = exported.state_dict()
    assert "score.weight" in weights
    assert all(torch.equal(weights[name], value) for name, value in want.items())
    reward = ValueLearner(tiny_critic(tokenizer, torch.bfloat16), deepspeed=DeepSpeedConfig(backend="fsdp2"))
    assert not any(p.requires_grad for p in reward.module.parameters())
    with torch.no_grad():
        plain = packed_scores(tiny_critic(tokenizer, torch.bfloat16), value_batch).float()
    torch.testing.assert_close(reward.scores([value_batch])[0], plain, rtol=0, atol=1e-6)


def _supervised_steps(learner_class, tokenizer, ds: DeepSpeedConfig) -> dict[str, float]:
    """One step of each supervised learner kind on its own tiny data: sft (two micro-batches),
    dpo against a frozen reference on the same backend, and rm (pairs, with margins)."""
    generator = torch.Generator().manual_seed(3)
    if learner_class is SFTLearner:
        samples = sft_samples(generator)
        learner = SFTLearner(tiny_policy(tokenizer), deepspeed=ds, optimizer=OPTIMIZER, total_steps=4)
        return learner, learner.sft_step([pack_sequences(samples[:3]), pack_sequences(samples[3:])])
    data = pairs(generator)
    micro = [pack_pairs(data[:4]), pack_pairs(data[4:])]
    if learner_class is RewardModelLearner:
        learner = RewardModelLearner(tiny_critic(tokenizer), deepspeed=ds, optimizer=OPTIMIZER, total_steps=4)
        return learner, learner.reward_step(micro, use_margin=True)
    reference = tiny_policy(tokenizer)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    frozen = PolicyLearner(reference, deepspeed=ds)
    for batch, values in zip(micro, frozen.logprobs(micro, only_actions=True), strict=True):
        batch.ref_logprobs = values
    learner = DPOLearner(tiny_policy(tokenizer), deepspeed=ds, optimizer=OPTIMIZER, total_steps=4)
    return learner, learner.dpo_step(micro, DPOLossConfig(beta=0.1))


@pytest.mark.parametrize("learner_class", [SFTLearner, DPOLearner, RewardModelLearner])
def test_fsdp2_supervised_steps_equal_deepspeeds(world, tokenizer, learner_class):
    fsdp2, got = _supervised_steps(learner_class, tokenizer, FSDP2)
    deepspeed, want = _supervised_steps(learner_class, tokenizer, DeepSpeedConfig(zero_stage=0, dtype="fp32"))
    assert got.keys() == want.keys()
    assert got["skipped"] == 0.0
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    expected = {name: p.detach() for name, p in deepspeed.module.named_parameters()}
    for name, value in _state(fsdp2).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_fsdp2_cpu_offload_takes_the_same_step_and_a_frozen_offloaded_model_the_same_logprobs(
    world, tokenizer, batch
):
    offloaded = _learner(tokenizer, DeepSpeedConfig(backend="fsdp2", dtype="fp32", offload_optimizer=True))
    plain = _learner(tokenizer)
    assert (offloaded.engine.cpu_offload, plain.engine.cpu_offload) == (True, False)
    got, want = offloaded.train_step([batch], LOSS), plain.train_step([batch], LOSS)
    for key in ("loss", "grad_norm", "entropy", "kl"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key
    after = _state(plain)
    assert all(torch.equal(value, after[name]) for name, value in _state(offloaded).items())
    frozen = [
        PolicyLearner(
            tiny_policy(tokenizer), deepspeed=DeepSpeedConfig(backend="fsdp2", offload_params=offload)
        )
        for offload in (True, False)
    ]
    assert frozen[0].engine.cpu_offload
    assert torch.equal(frozen[0].logprobs([batch])[0], frozen[1].logprobs([batch])[0])


def test_fsdp2_gradient_checkpointing_takes_the_same_step(world, tokenizer, batch):
    model = tiny_policy(tokenizer)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as loaded
    checkpointed = PolicyLearner(model, deepspeed=FSDP2, optimizer=OPTIMIZER, total_steps=4)
    plain = _learner(tokenizer)
    assert checkpointed.module.is_gradient_checkpointing
    got, want = checkpointed.train_step([batch], LOSS), plain.train_step([batch], LOSS)
    for key in ("loss", "grad_norm", "entropy", "kl"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key
    after = _state(plain)
    for name, value in _state(checkpointed).items():
        torch.testing.assert_close(value, after[name], rtol=1e-6, atol=1e-7, msg=name)


def test_fsdp2_refuses_what_it_does_not_do_yet(world, tokenizer):
    assert fsdp2_refusals(DeepSpeedConfig(dtype="fp16")) == []  # DeepSpeed runs it
    refused = fsdp2_refusals(
        DeepSpeedConfig(backend="fsdp2", dtype="fp16", zero_stage=3, offload_params=True),
        OptimizerConfig(name="muon"),
    )
    assert [field for field, _ in refused] == ["dtype", "optimizer.name"]
    with pytest.raises(ValueError, match=r"DeepSpeedConfig.dtype with backend 'fsdp2': fp16"):
        _learner(tokenizer, DeepSpeedConfig(backend="fsdp2", dtype="fp16"))
    with pytest.raises(ValueError, match=r"DeepSpeedConfig.backend: 'fsdp' is not one of"):
        DeepSpeedConfig(backend="fsdp")


def _lora_learner(tokenizer, ds: DeepSpeedConfig = FSDP2) -> PolicyLearner:
    return PolicyLearner(lora_policy(tokenizer), deepspeed=ds, optimizer=OPTIMIZER, total_steps=4)


def _unsharded_lora_syncs_match(tokenizer, state, reports, folder: pathlib.Path) -> None:
    """The unsharded peft model holding `state` (peft's names) sends the merged and adapter-only
    syncs with the checksums of `reports` (the sharded model's)."""
    plain = lora_policy(tokenizer)
    plain.load_state_dict(state)
    for sent, want in zip(lora_syncs(plain, folder, "plain"), reports, strict=True):
        assert compare_checksums(sent, want) == []


def test_fsdp2_lora_policy_steps_syncs_exports_and_resumes_like_the_unsharded_peft_model(
    world, tokenizer, batch, tmp_path
):
    from transformers import AutoModelForCausalLM

    from rl_learner import export_hf
    from rl_learner.fsdp2 import Fsdp2Engine

    fsdp2 = _lora_learner(tokenizer)
    deepspeed = _lora_learner(tokenizer, DeepSpeedConfig(zero_stage=0, dtype="fp32"))
    trained = {n for n, p in fsdp2.module.named_parameters() if p.requires_grad}
    assert trained
    assert all(".lora_" in name for name in trained)  # AdamW holds the adapters only
    assert sum(len(group["params"]) for group in fsdp2.engine.optimizer.param_groups) == len(trained)
    halves = [batch.select(range(4)), batch.select(range(4, 8))]
    got, want = fsdp2.train_step(halves, LOSS), deepspeed.train_step(halves, LOSS)
    for key in ("loss", "grad_norm", "entropy", "kl", "tokens"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    state = _state(fsdp2)
    expected = {name: p.detach() for name, p in deepspeed.module.named_parameters()}
    for name, value in state.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(".lora_B." in n and value.abs().max() > 0 for n, value in state.items())  # a real merge

    # Weight sync, merged and adapter-only: the unsharded peft model's checksums.
    reports = lora_syncs(fsdp2.engine, tmp_path, "fsdp2")
    _unsharded_lora_syncs_match(tokenizer, state, reports, tmp_path)
    assert all(hasattr(p, "full_tensor") for p in fsdp2.module.parameters())  # the shards are back

    # HF export: the merged model, as under DeepSpeed (peft's merge_and_unload, bit for bit).
    exported = AutoModelForCausalLM.from_pretrained(export_hf(fsdp2.engine, tmp_path / "hf")).state_dict()
    merged = lora_policy(tokenizer)
    merged.load_state_dict(state)
    for name, value in merged.merge_and_unload().state_dict().items():
        assert torch.equal(exported[name], value), name

    # Checkpoint round trip: the adapters and their AdamW state come back.
    save_checkpoint(tmp_path / "ckpt", 1, {"policy": fsdp2.engine}, TrainingState(step=1), save_rng=False)
    following = fsdp2.train_step(halves, LOSS)
    resumed = _lora_learner(tokenizer)
    assert load_checkpoint(tmp_path / "ckpt", {"policy": resumed.engine}, restore_rng=False).step == 1
    again = resumed.train_step(halves, LOSS)
    assert (again["loss"], again["grad_norm"]) == (following["loss"], following["grad_norm"])
    after, want = _state(resumed), _state(fsdp2)
    assert all(torch.equal(after[name], want[name]) for name in want)

    # bf16: fp32 master weights of base and adapters, a step taken.
    bf16 = _lora_learner(tokenizer, DeepSpeedConfig(backend="fsdp2", dtype="bf16"))
    assert {p.dtype for p in bf16.module.parameters()} == {torch.float32}
    assert bf16.train_step(halves, LOSS)["skipped"] == 0.0
    # LoRA with tensor parallelism: refused with the reason (world 1 cannot hold tp 2 anyway).
    ds = DeepSpeedConfig(backend="fsdp2", dtype="fp32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"peft wraps every adapted linear layer .* tensor_parallel_size 1"):
        Fsdp2Engine(lora_policy(tokenizer), ds, None, total_steps=1, device=torch.device("cpu"))


def test_fsdp2_lora_critic_trains_its_adapters_and_score_head_and_exports_like_deepspeed(
    world, tokenizer, value_batch, tmp_path
):
    from transformers import AutoModelForSequenceClassification

    from rl_learner import export_hf

    def lora_critic(ds: DeepSpeedConfig) -> ValueLearner:
        torch.manual_seed(0)
        model = apply_lora(tiny_critic(tokenizer), LoraOptions(rank=4, alpha=8.0))
        return ValueLearner(model, deepspeed=ds, optimizer=OPTIMIZER, total_steps=4)

    fsdp2, deepspeed = lora_critic(FSDP2), lora_critic(DeepSpeedConfig(zero_stage=0, dtype="fp32"))
    trained = {n for n, p in fsdp2.module.named_parameters() if p.requires_grad}
    assert any(".modules_to_save." in name for name in trained)  # the score head trains whole
    halves = [value_batch.select(range(4)), value_batch.select(range(4, 8))]
    got, want = fsdp2.train_step(halves, VALUE_LOSS), deepspeed.train_step(halves, VALUE_LOSS)
    for key in ("loss", "grad_norm", "value_mean", "tokens"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    exported = AutoModelForSequenceClassification.from_pretrained(export_hf(fsdp2.engine, tmp_path / "f"))
    reference = AutoModelForSequenceClassification.from_pretrained(
        export_hf(deepspeed.engine, tmp_path / "d")
    )
    weights = reference.state_dict()
    for name, value in exported.state_dict().items():
        torch.testing.assert_close(value, weights[name], rtol=1e-5, atol=1e-6, msg=name)


def _engine_serves_the_sync(tokenizer, folder: pathlib.Path, layout, sent, trained) -> None:
    """The own loop's sync (version 3 in `folder`/sync) into a running rl-rollout engine that
    started from the loop's initial weights: it takes the same checksums, then holds `trained`'s
    weights and answers greedy prompts as an engine serving `trained` does."""
    from rl_rollout import SamplingParams
    from rl_rollout.engines import HFEngine

    def engine_of(model, name: str) -> HFEngine:
        model.save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
        return HFEngine(str(folder / name), dtype="float32", max_model_len=64, seed=0)

    engine, reference = (
        engine_of(build_tiny_model(tokenizer, seed=0), "initial"),
        engine_of(trained, "trained"),
    )
    try:
        greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
        prompts = [[5, 6, 7, 8], [9, 10, 11]]
        engine.init_weight_sync(
            WeightSyncSpec(transport="file", layout=layout, directory=str(folder / "sync")), 1
        )
        assert compare_checksums(engine.receive_weights(3), sent) == []
        served = engine.model.state_dict()
        assert all(torch.equal(served[name], value) for name, value in trained.state_dict().items())
        answers = [[g.token_ids for g in row] for row in engine.generate(prompts, greedy)]
        assert answers == [[g.token_ids for g in row] for row in reference.generate(prompts, greedy)]
    finally:
        engine.close()
        reference.close()


@pytest.mark.slow  # two gloo ranks in processes of their own (~10-60 s to start on 2 busy cores)
def test_two_fsdp2_ranks_sync_step_and_reshard_checkpoints_like_one_rank(
    world, tokenizer, batch, value_batch, tmp_path
):
    halves = [batch.select(range(4)), batch.select(range(4, 8))]
    one = _learner(tokenizer)
    expected = one.train_step(halves, LOSS)
    after_one_step = _state(one)
    save_checkpoint(tmp_path / "one-ckpt", 1, {"policy": one.engine}, TrainingState(step=1), save_rng=False)
    worker = pathlib.Path(__file__).with_name("_worker_fsdp2.py")
    # the ranks see only what `pip install rl-learner[peft]` installs (peft: the LoRA phase)
    only_rl_learner = declared_only_env(tmp_path, "rl-learner", ("peft",))
    wait_ranks(start_ranks(worker, tmp_path, 2, env=only_rl_learner), timeout=600)

    # A team's own fully_shard loop: rank 0 sent, rank 1 joined the gathers and returned None.
    infos = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert [(info["is_sender"], info["report_is_none"]) for info in infos] == [(True, False), (False, True)]
    assert infos[0]["sharded"]  # DTensor shards, gathered bucket by bucket
    assert infos[0]["buckets"] > 2
    sent = decode((tmp_path / "report.msgpack").read_bytes(), WeightSyncReport)
    full = decode((tmp_path / "state.msgpack").read_bytes(), dict[str, torch.Tensor])
    plain = build_tiny_model(tokenizer, seed=1)  # the same weights, unsharded, sent the same way
    plain.load_state_dict(full)
    layout = sync_layout(plain, bucket_bytes=SMALL_BUCKETS)
    spec = WeightSyncSpec(transport="file", layout=layout, directory=str(tmp_path / "plain"))
    assert compare_checksums(FileSender(plain, spec).send(version=3), sent) == []
    received: dict[str, torch.Tensor] = {}
    report = read_buckets(
        tmp_path / "sync",
        layout,
        lambda bucket, tensors: received.update({k: v.clone() for k, v in tensors.items()}),
        version=3,
    )
    assert compare_checksums(sent, report) == []
    assert received.keys() == full.keys()
    assert all(torch.equal(received[name], full[name]) for name in full)
    _engine_serves_the_sync(tokenizer, tmp_path, layout, sent, plain)

    # The FSDP2 learner: micro-batch r on rank r gives one rank's step over both micro-batches.
    metrics = json.loads((tmp_path / "learner-metrics.json").read_text())
    two = decode((tmp_path / "learner-state.msgpack").read_bytes(), dict[str, torch.Tensor])
    for key in ("loss", "grad_norm", "entropy", "kl", "tokens", "sequences"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5), key
    for name, value in _state(one).items():
        torch.testing.assert_close(two[name], value, rtol=1e-5, atol=1e-6, msg=name)

    # Checkpoints reshard (torch.distributed.checkpoint): the step after a one-rank checkpoint
    # resumed on two ranks, and after the two ranks' checkpoint resumed here on one, is one rank's
    # next step (AdamW's moments and the schedule came back: a fresh optimizer steps differently).
    following = one.train_step(halves, LOSS)
    onto_two = json.loads((tmp_path / "resumed-metrics.json").read_text())
    back = _learner(tokenizer)
    assert load_checkpoint(tmp_path / "two-ckpt", {"policy": back.engine}, restore_rng=False).step == 1
    onto_one = back.train_step(halves, LOSS)
    assert (onto_two["step"], back.step) == (2, 2)
    for key in ("loss", "grad_norm", "entropy", "kl", "lr"):
        assert onto_two[key] == pytest.approx(following[key], rel=1e-5), key
        assert onto_one[key] == pytest.approx(following[key], rel=1e-5), key
    resumed = decode((tmp_path / "resumed-state.msgpack").read_bytes(), dict[str, torch.Tensor])
    for name, value in _state(one).items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(_state(back), _state(one), rtol=1e-5, atol=1e-6)

    # FSDP × TP = 1 × 2: half of each layer's heads per rank, one rank's step, and the weights it
    # sends have the checksums of the unsharded model holding them.
    tp = json.loads((tmp_path / "tp-metrics.json").read_text())
    assert (tp["q_proj_local"], tp["q_proj"]) == ([64, 128], [128, 128])
    for key in ("loss", "grad_norm", "entropy", "kl", "tokens", "sequences"):
        assert tp[key] == pytest.approx(expected[key], rel=1e-5), key
    tp_state = decode((tmp_path / "tp-state.msgpack").read_bytes(), dict[str, torch.Tensor])
    # AdamW's first step moves a weight by about lr · g / (|g| + eps): an element whose gradient is
    # near eps carries the round-off of the split matmuls' other summation order into its update
    # (up to 7e-6 seen), so the weights agree to 1% of one step's lr (1e-3) rather than to 1e-6.
    for name, value in after_one_step.items():
        torch.testing.assert_close(tp_state[name], value, rtol=1e-5, atol=1e-5, msg=name)
    plain = build_tiny_model(tokenizer, seed=0)
    plain.load_state_dict(tp_state)
    layout = sync_layout(plain, bucket_bytes=SMALL_BUCKETS)
    spec = WeightSyncSpec(transport="file", layout=layout, directory=str(tmp_path / "tp-plain"))
    tp_sent = decode((tmp_path / "tp-report.msgpack").read_bytes(), WeightSyncReport)
    assert compare_checksums(FileSender(plain, spec).send(version=5), tp_sent) == []
    tp_back = _learner(tokenizer)  # the TP ranks' checkpoint resumes on one rank without TP
    assert load_checkpoint(tmp_path / "tp-ckpt", {"policy": tp_back.engine}, restore_rng=False).step == 1
    tp_onto_one = tp_back.train_step(halves, LOSS)
    for key in ("loss", "grad_norm", "entropy", "kl", "lr"):
        assert tp_onto_one[key] == pytest.approx(following[key], rel=1e-5), key

    # FSDP2 with sequence parallelism 2: both ranks on both micro-batches, half of each row's
    # tokens each, one rank's step (the attention's all-to-alls move heads, not sums: the same
    # kernels on the same numbers; the rest is the gradient's sum over the two ranks).
    sp = json.loads((tmp_path / "sp-metrics.json").read_text())
    assert (sp["sp_group"], sp["gradient_ranks"]) == ([2, 0], 2)
    for key in ("loss", "grad_norm", "entropy", "kl", "tokens", "sequences"):
        assert sp[key] == pytest.approx(expected[key], rel=1e-5), key
    sp_state = decode((tmp_path / "sp-state.msgpack").read_bytes(), dict[str, torch.Tensor])
    for name, value in after_one_step.items():  # AdamW's first step: as for TP above
        torch.testing.assert_close(sp_state[name], value, rtol=1e-5, atol=1e-5, msg=name)

    # The critic: its score head's one row on rank 0, the same step as one rank's.
    heads = [json.loads((tmp_path / f"critic-head-{rank}.json").read_text()) for rank in (0, 1)]
    assert heads == [[1, 128], [0, 128]]
    metrics = json.loads((tmp_path / "critic-metrics.json").read_text())
    two = decode((tmp_path / "critic-state.msgpack").read_bytes(), dict[str, torch.Tensor])
    one = _critic(tokenizer)
    expected = one.train_step([value_batch.select(range(4)), value_batch.select(range(4, 8))], VALUE_LOSS)
    for key in ("loss", "grad_norm", "value_mean", "value_clip_fraction", "tokens"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5), key
    for name in ("tp-critic", "sp-critic"):  # FSDP x TP = 1 x 2, and FSDP2 with SP 2
        parallel = json.loads((tmp_path / f"{name}-metrics.json").read_text())
        for key in ("loss", "grad_norm", "value_mean", "value_clip_fraction", "tokens"):
            assert parallel[key] == pytest.approx(expected[key], rel=1e-5), (name, key)
    for name, value in _state(one).items():
        torch.testing.assert_close(two[name], value, rtol=1e-5, atol=1e-6, msg=name)

    # LoRA on two FSDP2 ranks: one rank's step, the unsharded peft model's merged and adapter
    # checksums, and the two ranks' checkpoint resumes on one rank with one rank's next step.
    one = _lora_learner(tokenizer)
    expected = one.train_step(halves, LOSS)
    metrics = json.loads((tmp_path / "lora-metrics.json").read_text())
    for key in ("loss", "grad_norm", "entropy", "kl", "tokens", "sequences"):
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5), key
    two = decode((tmp_path / "lora-state.msgpack").read_bytes(), dict[str, torch.Tensor])
    for name, value in _state(one).items():
        torch.testing.assert_close(two[name], value, rtol=1e-5, atol=1e-6, msg=name)
    reports = decode((tmp_path / "lora-reports.msgpack").read_bytes(), list[WeightSyncReport])
    _unsharded_lora_syncs_match(tokenizer, two, reports, tmp_path)
    following = one.train_step(halves, LOSS)
    back = _lora_learner(tokenizer)
    assert load_checkpoint(tmp_path / "lora-ckpt", {"policy": back.engine}, restore_rng=False).step == 1
    onto_one = back.train_step(halves, LOSS)
    for key in ("loss", "grad_norm", "entropy", "kl", "lr"):
        assert onto_one[key] == pytest.approx(following[key], rel=1e-5), key


def test_tensor_parallelism_needs_whole_groups_and_sync_gathers_over_one_meshs_parts(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from rl_learner.dtensor import dtensor_group
    from rl_learner.fsdp2 import Fsdp2Engine

    ds = DeepSpeedConfig(backend="fsdp2", dtype="fp32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 does not divide the world size 1"):
        Fsdp2Engine(torch.nn.Linear(2, 2), ds, None, total_steps=1, device=torch.device("cpu"))
    # FSDP x TP: split matrices on the dp x tp mesh, the rest on its dp part -> one gather group
    grid = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    on_grid = distribute_tensor(torch.ones(2), grid, [Replicate(), Replicate()])
    on_part = distribute_tensor(torch.ones(2), grid["dp"], [Replicate()])
    assert dtensor_group([on_grid, on_part]) is dist.group.WORLD
    other = distribute_tensor(torch.ones(2), init_device_mesh("cpu", (1,)), [Replicate()])
    with pytest.raises(ValueError, match=r"live on different device meshes"):
        dtensor_group([on_grid, other])
