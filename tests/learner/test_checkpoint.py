"""Checkpoints: atomic saves, rotation, verified loads, bit-exact resume, Hugging Face export.

Real DeepSpeed engines on CPU (gloo). The in-process tests share one single-rank process group
and a pair of ZeRO-2 engines (a causal LM "policy" and a value model "critic"); the resume tests
run `_worker_checkpoint.py` in fresh processes, killed in the middle of a save and resumed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import msgspec
import numpy as np
import pytest
import torch

from rl_data.sync.broadcast import free_port
from rl_learner.checkpoint import (
    CheckpointError,
    TrainingState,
    checkpoint_tag,
    export_hf,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_checkpoint_tensors,
    save_checkpoint,
    verify_checkpoint,
)
from rl_learner.distributed import ensure_distributed

WORKER = Path(__file__).with_name("_worker_checkpoint.py")
WORKER_TIMEOUT_S = 600


# ----------------------------------------------------------------------------------------------
# Shared engines


@pytest.fixture(scope="module")
def process_group():
    """A single-rank gloo group (DeepSpeed also wants LOCAL_RANK set whenever it builds an engine).

    The group is left in place afterwards, as rl_learner leaves its own: DeepSpeed caches group
    handles (``deepspeed.utils.groups``), so a later in-process learner in this pytest worker would
    broadcast over a destroyed group ("Group ... is not registered")."""
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"))
        ensure_distributed()  # DeepSpeed's view of the group, without its shared-memory op (see there)
        yield


def build_engine(model: torch.nn.Module, stage: int = 2):
    import deepspeed

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + step))
    config = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


@pytest.fixture(scope="module")
def engines(process_group, tiny_checkpoint):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    critic = AutoModelForSequenceClassification.from_pretrained(tiny_checkpoint, num_labels=1)
    return {"policy": build_engine(policy), "critic": build_engine(critic)}


def input_ids(seed: int) -> torch.Tensor:
    return torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(seed))


def train_step(engines, seed: int) -> None:
    ids = input_ids(seed)
    policy, critic = engines["policy"], engines["critic"]
    policy.backward(policy(input_ids=ids, labels=ids).loss)
    policy.step()
    critic.backward(critic(input_ids=ids).logits.square().mean())
    critic.step()


def snapshot(engines) -> dict[str, torch.Tensor]:
    return {
        f"{name}.{key}": value.detach().clone()
        for name, engine in engines.items()
        for key, value in engine.module.state_dict().items()
    }


def assert_same_weights(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    different = [key for key in left if not torch.equal(left[key], right[key])]
    assert not different, different[:5]


def state(step: int) -> TrainingState:
    return TrainingState(
        step=step,
        consumed_samples=8 * step,
        policy_version=step,
        data_state={"epoch": 0, "position": 8 * step, "seed": 7},
        extra={"kl_beta": 0.01},
    )


# ----------------------------------------------------------------------------------------------
# Save, rotation, pointer


def test_checkpoint_tag_names_steps_and_checks_tags():
    assert checkpoint_tag(42) == "step_00000042"
    assert checkpoint_tag("best-reward.v2") == "best-reward.v2"
    for bad in (".hidden", "a/b", "latest", ""):
        with pytest.raises(ValueError, match="step_or_tag"):
            checkpoint_tag(bad)
    with pytest.raises(ValueError, match="step must be >= 0"):
        checkpoint_tag(-1)


def test_save_writes_a_verified_manifest_moves_latest_and_keeps_the_last_n(engines, tmp_path):
    root = tmp_path / "run"
    (root / ".tmp-step_00000009").mkdir(parents=True)  # a crashed save
    (root / ".tmp-step_00000009" / "junk.pt").write_bytes(b"x")
    (root / ".trash-step_00000000.123").mkdir()  # a crashed deletion
    for step in range(1, 5):
        folder = save_checkpoint(root, step, engines, state(step), keep_last=2)
        assert folder == root / checkpoint_tag(step)
        assert (root / "latest").read_text().strip() == checkpoint_tag(step)

    assert [info.tag for info in list_checkpoints(root)] == ["step_00000003", "step_00000004"]
    assert [info.sequence for info in list_checkpoints(root)] == [3, 4]
    assert sorted(os.listdir(root)) == ["latest", "step_00000003", "step_00000004"]
    assert latest_checkpoint(root) == root / "step_00000004"

    manifest = verify_checkpoint(root / "step_00000004")
    assert manifest.step == 4
    assert manifest.world_size == 1
    assert {name: info.zero_stage for name, info in manifest.engines.items()} == {"policy": 2, "critic": 2}
    paths = [entry.path for entry in manifest.files]
    assert "training_state.json" in paths
    assert "rng/rank_00000.json" in paths
    assert any(p.startswith("policy/") for p in paths)
    assert any(p.startswith("critic/") for p in paths)
    for entry in manifest.files:
        data = (root / "step_00000004" / entry.path).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest(), entry.block_bytes) == (
            entry.size,
            entry.sha256,
            0,
        )
    saved = msgspec.json.decode(
        (root / "step_00000004" / "training_state.json").read_bytes(), type=TrainingState
    )
    assert saved == state(4)


def test_saving_an_older_step_again_keeps_the_newest_saves(engines, tmp_path):
    # A run rolled back to step 1 and saved again: rotation keeps the latest saves, not the highest steps.
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, engines, state(step), keep_last=2)
    save_checkpoint(tmp_path, 1, engines, state(1), keep_last=2)
    assert [info.tag for info in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000001"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"


def test_rotation_never_deletes_a_kept_tag_beside_the_newest(engines, tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, engines, state(step), keep_last=2, keep_tags=(2,))
    assert [info.tag for info in list_checkpoints(tmp_path)] == [
        "step_00000002",
        "step_00000004",
        "step_00000005",
    ]
    save_checkpoint(tmp_path, 6, engines, state(6), keep_last=2, keep_tags=("step_00000005",))
    # a kept tag among the newest is one of them: nothing more is kept
    assert [info.tag for info in list_checkpoints(tmp_path)] == ["step_00000005", "step_00000006"]


def test_tensor_sets_are_saved_in_the_manifest_and_read_back(engines, tmp_path):
    ema = {"a.weight": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([0.5])}
    save_checkpoint(tmp_path, 1, engines, state(1), tensors={"ema": ema})
    save_checkpoint(tmp_path, 2, engines, state(2))
    manifest = verify_checkpoint(tmp_path / "step_00000001")
    assert "tensors/ema.safetensors" in [entry.path for entry in manifest.files]
    loaded = load_checkpoint_tensors(tmp_path, "ema", tag=1)
    assert loaded.keys() == ema.keys()
    assert all(torch.equal(loaded[k], ema[k]) for k in ema)
    assert load_checkpoint_tensors(tmp_path, "ema") is None  # the latest (step 2) has none
    with pytest.raises(ValueError, match="tensors: name 'a/b'"):
        save_checkpoint(tmp_path, 3, engines, state(3), tensors={"a/b": ema})


def test_save_rejects_bad_arguments_naming_them(engines, tmp_path):
    with pytest.raises(ValueError, match="keep_last: expected an integer >= 1 or None, got 0"):
        save_checkpoint(tmp_path, 1, engines, state(1), keep_last=0)
    with pytest.raises(ValueError, match=r"state\.step: expected an integer >= 0, got -2"):
        save_checkpoint(tmp_path, 1, engines, TrainingState(step=-2))
    with pytest.raises(ValueError, match="not JSON-able"):
        save_checkpoint(tmp_path, 1, engines, TrainingState(step=1, extra={"f": object()}))
    with pytest.raises(TypeError, match=r"engines\['policy'\]: expected a DeepSpeedEngine, got Linear"):
        save_checkpoint(tmp_path, 1, {"policy": torch.nn.Linear(2, 2)}, state(1))
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "full",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("[enforce fail] No space left on device"),
    ],
    ids=["oserror", "torch-writer"],
)
def test_a_save_onto_a_full_disk_keeps_the_previous_checkpoint_and_names_the_space(
    engines, tmp_path, monkeypatch, full
):
    save_checkpoint(tmp_path, 1, engines, state(1))
    size = sum(path.stat().st_size for path in (tmp_path / "step_00000001").rglob("*") if path.is_file())
    policy = engines["policy"]
    original = policy.save_checkpoint

    def save_until_full(folder, **kwargs):
        original(folder, **kwargs)
        raise full

    monkeypatch.setattr(policy, "save_checkpoint", save_until_full)
    with pytest.raises(CheckpointError) as raised:
        save_checkpoint(tmp_path, 2, engines, state(2))
    message = str(raised.value)
    assert (
        f"checkpoint {tmp_path / '.tmp-step_00000002'}: no space left on the device of {tmp_path}" in message
    )
    assert f"a checkpoint takes {size / 2**30:.2f} GiB (the last one, step_00000001)" in message
    assert "GiB are free" in message
    assert f"the previous checkpoint {tmp_path / 'step_00000001'} is intact" in message
    assert raised.value.previous == "step_00000001"
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000001"]  # the partial save is gone
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"
    verify_checkpoint(tmp_path / "step_00000001")


# ----------------------------------------------------------------------------------------------
# Load


def test_load_restores_weights_optimizer_schedule_training_state_and_rng(engines, tmp_path):
    train_step(engines, seed=1)
    save_checkpoint(tmp_path, 1, engines, state(1))
    saved_weights = snapshot(engines)
    saved_lr = engines["policy"].get_lr()
    expected = (torch.rand(3), np.random.rand(3), random.random())  # noqa: NPY002 (continues the saved streams)

    train_step(engines, seed=2)  # moves weights, Adam moments, schedule and RNG away
    loaded = load_checkpoint(tmp_path, engines)
    assert loaded == state(1)
    assert_same_weights(snapshot(engines), saved_weights)
    assert engines["policy"].get_lr() == saved_lr
    assert torch.equal(torch.rand(3), expected[0])
    assert np.array_equal(np.random.rand(3), expected[1])  # noqa: NPY002
    assert random.random() == expected[2]

    # The same step from the restored state gives the same weights as from the original state.
    train_step(engines, seed=2)
    after_once = snapshot(engines)
    load_checkpoint(tmp_path, engines)
    train_step(engines, seed=2)
    assert_same_weights(snapshot(engines), after_once)


def corrupt_flip(folder: Path) -> str:
    path = folder / "policy" / "mp_rank_00_model_states.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    return r"file policy/mp_rank_00_model_states\.pt is corrupt: its SHA-256 differs"


def corrupt_truncate(folder: Path) -> str:
    path = next((folder / "critic").glob("*optim_states.pt"))
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size - 100)
    return rf"file critic/{path.name} has {size - 100} bytes, the manifest says {size}"


def corrupt_delete_file(folder: Path) -> str:
    (folder / "rng" / "rank_00000.json").unlink()
    return r"file rng/rank_00000\.json is missing"


def corrupt_delete_manifest(folder: Path) -> str:
    (folder / "manifest.json").unlink()
    return r"is partial: manifest\.json is missing"


def corrupt_manifest_text(folder: Path) -> str:
    path = folder / "manifest.json"
    path.write_bytes(path.read_bytes()[:-40])
    return r"manifest\.json is unreadable"


@pytest.mark.parametrize(
    "corrupt",
    [corrupt_flip, corrupt_truncate, corrupt_delete_file, corrupt_delete_manifest, corrupt_manifest_text],
)
def test_corrupt_checkpoint_is_refused_before_touching_engines_and_the_previous_one_loads(
    engines, tmp_path, corrupt
):
    train_step(engines, seed=3)
    save_checkpoint(tmp_path, 1, engines, state(1))
    first = snapshot(engines)
    train_step(engines, seed=4)
    save_checkpoint(tmp_path, 2, engines, state(2))
    train_step(engines, seed=5)
    current = snapshot(engines)
    problem = corrupt(tmp_path / "step_00000002")

    with pytest.raises(CheckpointError, match=problem) as caught:
        load_checkpoint(tmp_path, engines)
    message = str(caught.value)
    assert str(tmp_path / "step_00000002") in message
    assert "the previous complete checkpoint is 'step_00000001': load it with tag='step_00000001'" in message
    assert caught.value.previous == "step_00000001"
    assert_same_weights(snapshot(engines), current)

    assert load_checkpoint(tmp_path, engines, tag=caught.value.previous) == state(1)
    assert_same_weights(snapshot(engines), first)


def block_digest(data: bytes, block: int) -> str:
    """ManifestFile's block checksum, written out independently of rl_learner.checkpoint."""
    digests = [hashlib.sha256(data[start : start + block]).digest() for start in range(0, len(data), block)]
    return hashlib.sha256(b"".join(digests)).hexdigest()


def test_files_above_the_block_size_get_block_digests_that_catch_a_flip_in_any_block(
    engines, tmp_path, monkeypatch
):
    import rl_learner.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "_BLOCK_BYTES", 4096)
    folder = save_checkpoint(tmp_path, 1, engines, state(1))
    manifest = verify_checkpoint(folder)
    assert manifest.format == 2
    large = [entry for entry in manifest.files if entry.size > 4096]
    assert len(large) >= 2
    assert max(entry.size for entry in large) > 3 * 4096  # a middle block and a short last one
    for entry in manifest.files:
        data = (folder / entry.path).read_bytes()
        if entry.size > 4096:
            assert (entry.block_bytes, entry.sha256) == (4096, block_digest(data, 4096))
        else:
            assert (entry.block_bytes, entry.sha256) == (0, hashlib.sha256(data).hexdigest())

    biggest = max(large, key=lambda entry: entry.size)
    path = folder / biggest.path
    original = path.read_bytes()
    assert len(original) % 4096 != 0
    for offset in (0, 4096 + 17, len(original) - 1):  # first block, a middle one, the short last one
        data = bytearray(original)
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=rf"file {re.escape(biggest.path)} is corrupt"):
            verify_checkpoint(folder)
    path.write_bytes(original)
    verify_checkpoint(folder)


def test_format_1_manifests_still_load_and_newer_formats_are_refused_naming_both(engines, tmp_path):
    folder = save_checkpoint(tmp_path, 1, engines, state(1))
    written = json.loads((folder / "manifest.json").read_text())
    for entry in written["files"]:  # a format-1 manifest: whole-file SHA-256, no block_bytes
        assert entry.pop("block_bytes") == 0
    (folder / "manifest.json").write_text(json.dumps({**written, "format": 1}))
    assert verify_checkpoint(folder).format == 1
    assert load_checkpoint(tmp_path, engines) == state(1)

    (folder / "manifest.json").write_text(json.dumps({**written, "format": 3}))
    with pytest.raises(CheckpointError, match="has format 3, this version reads formats 1, 2"):
        verify_checkpoint(folder)


def test_a_checkpoint_with_fusedadams_step_layout_resumes_into_torch_adamw(engines, tmp_path):
    # DeepSpeed's FusedAdam (CUDA learners below ZeRO-3 until 2026-11-27) keeps the step count in
    # the parameter group, torch's AdamW in each parameter's state: saved in FusedAdam's layout,
    # the checkpoint must still train on after a resume
    train_step(engines, seed=11)
    basics = [engine.optimizer.optimizer for engine in engines.values()]
    steps = []
    for basic in basics:
        states = [basic.state[p] for group in basic.param_groups for p in group["params"] if p in basic.state]
        steps.append(int(states[0]["step"]))
        for group in basic.param_groups:
            group["step"] = steps[-1]
        for moved in states:
            del moved["step"]
    try:
        save_checkpoint(tmp_path, 1, engines, state(1))
        assert load_checkpoint(tmp_path, engines) == state(1)
        for basic, step in zip(basics, steps, strict=True):
            states = [basic.state[p] for group in basic.param_groups for p in group["params"]]
            assert all(float(moved["step"]) == step for moved in states)
            assert all("step" not in group for group in basic.param_groups)
        train_step(engines, seed=12)
        for basic, step in zip(basics, steps, strict=True):
            assert all(
                float(basic.state[p]["step"]) == step + 1 for g in basic.param_groups for p in g["params"]
            )
    finally:
        for basic in basics:
            for group in basic.param_groups:
                group.pop("step", None)


def test_fusedadams_layout_loads_into_a_fused_torch_adamw_keeping_its_settings():
    from rl_learner.checkpoint import _torch_adam_layout

    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    fused_adam = {  # what DeepSpeed's FusedAdam.state_dict() holds after 5 steps
        "state": {0: {"exp_avg": torch.full((3,), 0.1), "exp_avg_sq": torch.full((3,), 0.01)}},
        "param_groups": [
            {
                "params": [0, 1],
                "lr": 2e-3,
                "betas": (0.9, 0.95),
                "eps": 1e-8,
                "weight_decay": 0.0,
                "bias_correction": True,
                "adam_w_mode": True,
                "step": 5,
            }
        ],
    }
    optimizer.load_state_dict(_torch_adam_layout(fused_adam, optimizer.param_groups))
    group = optimizer.param_groups[0]
    assert (group["lr"], group["fused"], "step" in group) == (2e-3, True, False)
    assert float(optimizer.state[params[0]]["step"]) == 5
    assert params[1] not in optimizer.state  # no moments saved: a fresh start for it, as in FusedAdam
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert float(optimizer.state[params[0]]["step"]) == 6
    torch_layout = optimizer.state_dict()
    assert _torch_adam_layout(torch_layout, optimizer.param_groups) is torch_layout


def test_load_refuses_partial_saves_and_other_engines(engines, tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint in"):
        load_checkpoint(tmp_path, engines)
    save_checkpoint(tmp_path, 1, engines, state(1))
    partial = tmp_path / ".tmp-step_00000002"
    partial.mkdir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000001"  # the unfinished save is ignored
    with pytest.raises(CheckpointError, match=r"\.tmp-step_00000002 is an unfinished save"):
        load_checkpoint(partial, engines)
    with pytest.raises(
        CheckpointError, match=r"holds engines \['critic', 'policy'\], but engines \['policy'\]"
    ):
        load_checkpoint(tmp_path, {"policy": engines["policy"]})
    with pytest.raises(CheckpointError, match="step_00000007 does not exist"):
        load_checkpoint(tmp_path, engines, tag=7)


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("dp_world_size", 2, r"engine 'policy' was saved by 2 data-parallel ranks and now runs on 1"),
        ("zero_stage", 3, r"engine 'policy' was saved with ZeRO stage 3 and now runs stage 2"),
    ],
)
def test_load_refuses_another_sharding_before_touching_engines(engines, tmp_path, field, value, problem):
    folder = save_checkpoint(tmp_path, 1, engines, state(1))
    manifest = msgspec.json.decode((folder / "manifest.json").read_bytes())
    manifest["engines"]["policy"][field] = value  # as if saved by another DeepSpeed set-up
    (folder / "manifest.json").write_bytes(msgspec.json.encode(manifest))
    train_step(engines, seed=13)
    current = snapshot(engines)
    with pytest.raises(CheckpointError, match=problem):
        load_checkpoint(tmp_path, engines)
    assert_same_weights(snapshot(engines), current)


# ----------------------------------------------------------------------------------------------
# Hugging Face export


def eval_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.train(was_training)
    return logits


def test_export_of_a_trained_policy_loads_as_causal_lm_with_its_tokenizer(engines, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train_step(engines, seed=6)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "stale.txt").write_text("replaced")  # an earlier export is replaced whole
    export_hf(engines["policy"], tmp_path / "hf", tokenizer=tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert not (tmp_path / "hf" / "stale.txt").exists()

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    ids = input_ids(7)
    assert torch.equal(eval_logits(loaded, ids), eval_logits(engines["policy"].module, ids))
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").get_vocab() == tokenizer.get_vocab()


def test_export_writes_the_ema_of_the_weights_in_place_of_the_models_own(engines, tmp_path):
    from transformers import AutoModelForCausalLM

    from rl_learner import WeightEMA

    policy = engines["policy"]
    ema = WeightEMA(policy, 0.5)
    before = {name: p.detach().clone() for name, p in policy.module.named_parameters()}
    train_step(engines, seed=10)
    ema.update(policy)
    export_hf(policy, tmp_path / "ema", replace=ema.export_names(policy))
    loaded = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "ema").named_parameters())
    for name, p in policy.module.named_parameters():
        expected = 0.5 * before[name] + 0.5 * p.detach()
        assert torch.allclose(loaded[name], expected, atol=1e-6), name
    assert any(not torch.equal(before[n], p) for n, p in policy.module.named_parameters())


def test_export_of_a_value_model_loads_as_sequence_classification(engines, tmp_path):
    from transformers import AutoModelForSequenceClassification

    train_step(engines, seed=8)
    export_hf(engines["critic"], tmp_path / "critic")
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic")
    assert loaded.config.num_labels == 1
    assert loaded.score.weight.shape[0] == 1
    ids = input_ids(9)
    assert torch.equal(eval_logits(loaded, ids), eval_logits(engines["critic"].module, ids))


def test_export_gathers_zero3_partitioned_parameters(process_group, tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    engine = build_engine(AutoModelForCausalLM.from_pretrained(tiny_checkpoint), stage=3)
    assert all(p.numel() == 0 or hasattr(p, "ds_id") for p in engine.module.parameters())
    engine.backward(engine(input_ids=input_ids(10), labels=input_ids(10)).loss)
    engine.step()
    export_hf(engine, tmp_path / "zero3")

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "zero3")
    original = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    ids = input_ids(11)
    live = eval_logits(engine, ids)
    assert torch.equal(eval_logits(loaded, ids), live)
    assert not torch.equal(eval_logits(original, ids), live)  # the trained weights were exported


def test_export_of_a_lora_model_is_merged_and_leaves_the_adapters_alive(tiny_checkpoint, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora)  # random A and B: the adapters change the outputs
    before = {key: value.clone() for key, value in model.state_dict().items()}
    ids = input_ids(12)
    live = eval_logits(model, ids)
    with model.disable_adapter():
        without_adapters = eval_logits(model, ids)
    assert not torch.allclose(live, without_adapters, atol=1e-3)

    export_hf(model, tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in key or "base_layer" in key for key in loaded.state_dict())
    torch.testing.assert_close(eval_logits(loaded, ids), live, atol=1e-5, rtol=1e-5)

    assert isinstance(model, PeftModel)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(eval_logits(model, ids), live)


def test_export_of_a_dora_model_equals_peft_merge_and_unload(tiny_checkpoint, tmp_path):
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    dora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, use_dora=True
    )
    model = get_peft_model(base, dora)
    with torch.no_grad():  # magnitudes other than ‖W‖ so the rescaling matters
        for name, parameter in model.named_parameters():
            if "lora_magnitude_vector" in name:
                parameter.mul_(1.5)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    ids = input_ids(13)
    live = eval_logits(model, ids)
    merged = copy.deepcopy(model).merge_and_unload()
    with model.disable_adapter():
        assert not torch.allclose(eval_logits(model, ids), live, atol=1e-3)

    export_hf(model, tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in key or "base_layer" in key for key in loaded.state_dict())
    exported = loaded.state_dict()
    for key, value in merged.state_dict().items():
        torch.testing.assert_close(exported[key], value, atol=1e-6, rtol=1e-6, msg=key)
    torch.testing.assert_close(eval_logits(loaded, ids), eval_logits(merged, ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eval_logits(loaded, ids), live, atol=1e-5, rtol=1e-5)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# ----------------------------------------------------------------------------------------------
# Kill and resume, in fresh processes


def run_worker_group(args: list[str], *, world_size: int, logs: Path) -> list[tuple[subprocess.Popen, Path]]:
    port = free_port()
    group = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            DS_ACCELERATOR="cpu",
            OMP_NUM_THREADS="1",
        )
        log = Path(f"{logs}.rank{rank}.log")
        with open(log, "w") as handle:
            process = subprocess.Popen(
                [sys.executable, str(WORKER), *args], env=env, stdout=handle, stderr=handle
            )
        group.append((process, log))
    return group


def wait_all(groups: list[list[tuple[subprocess.Popen, Path]]]) -> list[list[tuple[int, str]]]:
    """The exit code and the log tail of every process; kills what is left on a timeout."""
    try:
        for group in groups:
            for process, _ in group:
                process.wait(timeout=WORKER_TIMEOUT_S)
    finally:
        for group in groups:
            for process, _ in group:
                if process.poll() is None:
                    process.kill()
                    process.wait()
    return [[(process.returncode, log.read_text()[-3000:]) for process, log in group] for group in groups]


def read_results(out: Path, world_size: int) -> list[dict]:
    return [json.loads(Path(f"{out}.rank{rank}.json").read_text()) for rank in range(world_size)]


def check_kill_and_resume(tmp_path: Path, model: Path, *, stage: int, world_size: int, control: bool) -> None:
    common = [
        "--model",
        str(model),
        "--stage",
        str(stage),
        "--steps",
        "6",
        "--save-every",
        "2",
        "--keep-last",
        "2",
    ]
    # The killed run is the uninterrupted reference too: it writes its losses and weights after
    # step 6 right before the save it dies in (a separate uninterrupted run, one process world
    # more, would only add that save, which changes no weight and draws no random number).
    crashed = tmp_path / "crashed"
    killed = ["--root", str(crashed), "--out", str(tmp_path / "a"), "--crash-at-save", "6"]
    (first,) = wait_all([run_worker_group([*common, *killed], world_size=world_size, logs=tmp_path / "a")])
    assert all(code == -signal.SIGKILL for code, _ in first), first
    # The killed save left a partial folder; the previous checkpoints and the pointer are intact.
    assert sorted(os.listdir(crashed)) == [".tmp-step_00000006", "latest", "step_00000002", "step_00000004"]
    assert latest_checkpoint(crashed) == crashed / "step_00000004"

    resume = ["--root", str(crashed), "--out", str(tmp_path / "c"), "--resume"]
    groups = [run_worker_group([*common, *resume], world_size=world_size, logs=tmp_path / "c")]
    if control:  # the same resume without the RNG states: the test can tell them apart
        no_rng = ["--root", str(crashed), "--out", str(tmp_path / "d"), "--resume", "--no-restore-rng"]
        no_rng += ["--resume-tag", "step_00000004"]  # the resume next to it saves step 6 meanwhile
        groups.append(
            run_worker_group(
                [*common[:-4], *no_rng, "--save-every", "100"], world_size=world_size, logs=tmp_path / "d"
            )
        )
    second = wait_all(groups)
    for group in second:
        assert all(code == 0 for code, _ in group), group

    uninterrupted, resumed = (
        read_results(tmp_path / "a", world_size),
        read_results(tmp_path / "c", world_size),
    )
    for rank in range(world_size):
        assert resumed[rank]["start"] == 4
        assert resumed[rank]["losses"] == {step: uninterrupted[rank]["losses"][step] for step in ("5", "6")}
        assert resumed[rank]["weights"] == uninterrupted[rank]["weights"]
    assert uninterrupted[0]["root_entries"] == ["latest", "step_00000002", "step_00000004"]
    # The resumed run's save removed the partial folder and rotated: the last two saves are left.
    assert resumed[0]["root_entries"] == ["latest", "step_00000004", "step_00000006"]
    if control:
        assert read_results(tmp_path / "d", world_size)[0]["losses"]["5"] != uninterrupted[0]["losses"]["5"]


@pytest.mark.slow
def test_killed_mid_save_then_resumed_equals_uninterrupted_run_bit_for_bit_zero2(tiny_checkpoint, tmp_path):
    check_kill_and_resume(tmp_path, tiny_checkpoint, stage=2, world_size=1, control=True)


@pytest.mark.slow
def test_killed_mid_save_then_resumed_equals_uninterrupted_run_bit_for_bit_zero3_two_ranks(
    tiny_checkpoint, tmp_path
):
    check_kill_and_resume(tmp_path, tiny_checkpoint, stage=3, world_size=2, control=False)
