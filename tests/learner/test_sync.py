"""Weight sync, sending side: real senders into real receiving processes (gloo on 127.0.0.1).

Two receiver processes (`_worker_sync.py receiver`) stay up for the module and take one job per
sync: a differently initialised copy of the architecture, a plain torch receiver
(`rl_data.sync.broadcast.receive_buckets`). After a sync their `state_dict()` must equal the sender's
(cast to the engine dtype), LoRA merged, checksums equal on both sides.
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import subprocess
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from rl_data import WeightSyncReport, compare_checksums, decode, encode
from rl_data.sync import WeightSyncError, WeightSyncSpec
from rl_data.sync.broadcast import free_port
from rl_data.sync.file import read_buckets
from rl_data.sync.shm import shm_directory
from rl_data.tiny import build_tiny_model
from rl_learner.senders import BroadcastSender, FileSender, IpcSender, ShmSender
from rl_learner.sync import make_sender, sync_layout
from tests.processes import wait_world

WORKER = pathlib.Path(__file__).with_name("_worker_sync.py")
TIMEOUT_S = 180
SMALL_BUCKETS = 64 * 1024  # several buckets even for the tiny model


class Receivers:
    """The module's receiver processes; `run` hands each a job, `wait` collects what they wrote."""

    def __init__(self, ranks: list[int], out: pathlib.Path) -> None:
        self.ranks, self.out = ranks, out
        # one OpenMP thread per process: two receivers and two learner ranks share 2 cores
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
        self.processes = [
            subprocess.Popen(
                [sys.executable, str(WORKER), "receiver", str(rank)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                text=True,
            )
            for rank in ranks
        ]
        for process in self.processes:
            assert process.stdout.readline().strip() == "ready"

    def run(self, tag: str, spec: WeightSyncSpec, **job) -> None:
        spec_path = self.out / f"{tag}-spec.msgpack"
        spec_path.write_bytes(encode(spec))
        job = {"architecture": "qwen2", "tied": False, "dtype": "float32", **job}
        line = {**job, "tag": tag, "out": str(self.out), "spec": str(spec_path)}
        for process in self.processes:
            process.stdin.write(json.dumps(line) + "\n")
            process.stdin.flush()

    def wait(self, tag: str) -> dict[int, dict]:
        deadline = time.monotonic() + TIMEOUT_S
        results = {}
        for rank, process in zip(self.ranks, self.processes, strict=True):
            while not (self.out / f"{tag}-done-{rank}").exists():
                assert process.poll() is None, f"receiver {rank} exited with {process.returncode}"
                assert time.monotonic() < deadline, f"receiver {rank} did not finish job {tag!r}"
                time.sleep(0.05)
            result = results[rank] = {}
            error = self.out / f"{tag}-error-{rank}.txt"
            if error.exists():
                result["error"] = error.read_text()
            report = self.out / f"{tag}-report-{rank}.msgpack"
            if report.exists():
                result["report"] = decode(report.read_bytes(), WeightSyncReport)
                state = (self.out / f"{tag}-state-{rank}.msgpack").read_bytes()
                result["state"] = decode(state, dict[str, torch.Tensor])
        return results

    def close(self) -> None:
        for process in self.processes:
            process.stdin.close()
        for process in self.processes:
            try:
                process.wait(timeout=30)
            finally:
                process.kill()


@pytest.fixture(scope="module")
def receivers(tmp_path_factory):
    group = Receivers([1, 2], tmp_path_factory.mktemp("sync"))
    yield group
    group.close()


def broadcast_spec(layout, world_size: int = 3) -> WeightSyncSpec:
    return WeightSyncSpec(
        transport="broadcast", layout=layout, port=free_port(), world_size=world_size, timeout_s=90
    )


def assert_same_state(received: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert received.keys() == expected.keys()
    for name, tensor in expected.items():
        assert received[name].dtype == tensor.dtype, name
        assert torch.equal(received[name], tensor), name


@pytest.mark.slow  # `receivers`: two processes in a gloo group, ~10 s to start and stop
@pytest.mark.parametrize(("architecture", "tied"), [("qwen2", False), ("llama", True)])
def test_broadcast_makes_both_receivers_identical_with_matching_checksums(
    receivers, tokenizer, architecture, tied
):
    model = build_tiny_model(tokenizer, architecture=architecture, tie_word_embeddings=tied, seed=0)
    layout = sync_layout(model, bucket_bytes=SMALL_BUCKETS)
    assert len(layout.buckets) > 2
    assert ("lm_head.weight" in layout.names()) is not tied  # a tied storage goes once, as the embedding
    spec = broadcast_spec(layout)
    tag = f"plain-{architecture}"
    receivers.run(tag, spec, architecture=architecture, tied=tied, layouts=["spec", "spec"])
    with BroadcastSender(model, spec) as sender:
        first = sender.send(version=1)
        with torch.no_grad():
            model.model.norm.weight.add_(0.5)
            model.model.embed_tokens.weight.mul_(-1.0)
        second = sender.send(version=2)
    assert compare_checksums(first, second) != []  # the second sync moved other bytes
    assert (second.version, second.num_bytes) == (2, layout.total_bytes)
    for result in receivers.wait(tag).values():
        assert "error" not in result, result.get("error")
        assert result["report"].version == 2
        assert compare_checksums(second, result["report"]) == []
        assert_same_state(result["state"], model.state_dict())


@pytest.mark.slow  # `receivers`: two processes in a gloo group, ~10 s to start and stop
def test_broadcast_casts_to_the_engine_dtype(receivers, tokenizer):
    model = build_tiny_model(tokenizer, seed=0)
    layout = sync_layout(model, dtype=torch.bfloat16, bucket_bytes=SMALL_BUCKETS)
    assert {param.dtype for bucket in layout.buckets for param in bucket.params} == {"bfloat16"}
    spec = broadcast_spec(layout)
    receivers.run("bf16", spec, dtype="bfloat16")
    with BroadcastSender(model, spec) as sender:
        sent = sender.send(version=7)
    assert sent.num_bytes == layout.total_bytes < sync_layout(model, bucket_bytes=SMALL_BUCKETS).total_bytes
    expected = {name: tensor.to(torch.bfloat16) for name, tensor in model.state_dict().items()}
    for result in receivers.wait("bf16").values():
        assert "error" not in result, result.get("error")
        assert compare_checksums(sent, result["report"]) == []
        assert_same_state(result["state"], expected)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the live model is not cast


def lora_model(tokenizer, **config):
    import peft

    base = build_tiny_model(tokenizer, seed=0)
    options = {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
        "modules_to_save": ["lm_head"],
        "init_lora_weights": False,  # B is random, not zero: the merge changes the weights
        **config,
    }
    model = peft.get_peft_model(base, peft.LoraConfig(**options))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".modules_to_save." in name:
                param.add_(0.25)  # the trained copy differs from the original head
    return model


@pytest.mark.slow  # `receivers`: two processes in a gloo group, ~10 s to start and stop
def test_lora_receiver_gets_the_merged_weights_and_the_live_model_keeps_its_adapters(receivers, tokenizer):
    model = lora_model(tokenizer)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    layout = sync_layout(model, bucket_bytes=SMALL_BUCKETS)
    assert layout.names() == tuple(name for name, _ in build_tiny_model(tokenizer).named_parameters())
    spec = broadcast_spec(layout)
    receivers.run("lora", spec)
    with make_sender(spec, model) as sender:
        sent = sender.send(version=3)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    original = build_tiny_model(tokenizer, seed=0).state_dict()
    assert not torch.equal(
        merged["model.layers.0.self_attn.q_proj.weight"], original["model.layers.0.self_attn.q_proj.weight"]
    )
    for result in receivers.wait("lora").values():
        assert "error" not in result, result.get("error")
        assert compare_checksums(sent, result["report"]) == []
        assert_same_state(result["state"], merged)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert not q_proj.merged
    assert "default" in q_proj.lora_A
    assert_same_state(model.state_dict(), before)


@pytest.mark.slow  # `receivers`: two processes in a gloo group, ~10 s to start and stop
def test_shm_sender_gives_receivers_started_first_every_version_with_matching_checksums(receivers, tokenizer):
    model = build_tiny_model(tokenizer, architecture="llama", tie_word_embeddings=True, seed=0)
    layout = sync_layout(model, dtype=torch.bfloat16, bucket_bytes=SMALL_BUCKETS)
    spec = WeightSyncSpec(transport="shm", layout=layout, directory=shm_directory(), timeout_s=90)
    # the receivers wait for versions 1 and 2 before the sender exists (the driver's ordering)
    receivers.run(
        "shm",
        spec,
        architecture="llama",
        tied=True,
        dtype="bfloat16",
        layouts=["spec", "spec"],
        versions=[1, 2],
    )
    sender = make_sender(spec, model)
    assert isinstance(sender, ShmSender)
    with sender:
        first = sender.send(version=1)
        with torch.no_grad():
            model.model.norm.weight.add_(0.5)
        second = sender.send(version=2)
        results = receivers.wait("shm")
    assert compare_checksums(first, second) != []
    expected = {name: tensor.to(torch.bfloat16) for name, tensor in model.state_dict().items()}
    for result in results.values():
        assert "error" not in result, result.get("error")
        assert result["report"].version == 2
        assert compare_checksums(second, result["report"]) == []
        assert_same_state(result["state"], expected)
    assert not os.path.exists(spec.directory)  # close removed the segments


def test_file_sender_merges_fan_in_fan_out_lora_like_merge_and_unload(tmp_path):
    import peft
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4))
    config = peft.LoraConfig(
        r=4, lora_alpha=16, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, init_lora_weights=False
    )
    model = peft.get_peft_model(base, config)
    layout = sync_layout(model, bucket_bytes=SMALL_BUCKETS)
    spec = WeightSyncSpec(transport="file", layout=layout, directory=str(tmp_path))
    with FileSender(model, spec, keep=1) as sender:
        sender.send(version=1)
        sent = sender.send(version=2)
    received: dict[str, torch.Tensor] = {}
    report = read_buckets(
        tmp_path,
        layout,
        lambda bucket, views: received.update({k: v.clone() for k, v in views.items()}),
        version=2,
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["version-00000002"]
    assert compare_checksums(sent, report) == []
    merged = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    assert_same_state(received, {name: tensor.detach() for name, tensor in merged.items()})
    assert "lm_head.weight" not in received  # tied to transformer.wte.weight in GPT-2


def file_round_trip(model, directory: pathlib.Path) -> dict[str, torch.Tensor]:
    layout = sync_layout(model, bucket_bytes=SMALL_BUCKETS)
    spec = WeightSyncSpec(transport="file", layout=layout, directory=str(directory))
    with FileSender(model, spec) as sender:
        sent = sender.send(version=1)
    received: dict[str, torch.Tensor] = {}
    report = read_buckets(
        directory,
        layout,
        lambda bucket, views: received.update({k: v.clone() for k, v in views.items()}),
        version=1,
    )
    assert compare_checksums(sent, report) == []
    return received


def test_embedding_lora_lora_bias_and_two_active_adapters_merge_like_merge_and_unload(tokenizer, tmp_path):
    import peft

    model = peft.get_peft_model(
        build_tiny_model(tokenizer, seed=0),
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["embed_tokens", "k_proj"], init_lora_weights=False
        ),
    )
    other = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["k_proj", "q_proj"], lora_bias=True, init_lora_weights=False
    )
    model.add_adapter("other", other)
    model.base_model.set_adapter(["default", "other"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_embedding_B" in name or ("lora_B" in name and name.endswith(".bias")):
                param.normal_()  # peft starts these at zero
    received = file_round_trip(model, tmp_path)
    merged = {name: p.detach() for name, p in copy.deepcopy(model).merge_and_unload().named_parameters()}
    assert_same_state(received, merged)
    original = dict(build_tiny_model(tokenizer, seed=0).named_parameters())
    changed = {name for name in merged if not torch.equal(merged[name], original[name])}
    assert {"model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.bias"} <= changed


def test_dora_merges_like_merge_and_unload_and_export_hf_writes_the_same_weights(tokenizer, tmp_path):
    import peft

    from rl_learner import export_hf

    model = peft.get_peft_model(
        build_tiny_model(tokenizer, seed=0),
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, use_dora=True
        ),
    )
    with torch.no_grad():  # magnitudes other than ‖W‖ so the rescaling matters
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(1.5)
    received = file_round_trip(model, tmp_path / "sync")
    merged = {name: p.detach() for name, p in copy.deepcopy(model).merge_and_unload().named_parameters()}
    assert received.keys() == merged.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(received[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    export_hf(model, tmp_path / "export")
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert all(torch.equal(exported[name], received[name]) for name in received)


@pytest.mark.slow  # `receivers`: two processes in a gloo group, ~10 s to start and stop
def test_zero3_engine_on_two_learner_ranks_syncs_identical_weights(receivers, tokenizer, tmp_path):
    model = build_tiny_model(tokenizer, architecture="llama", tie_word_embeddings=True, seed=0)
    layout = sync_layout(model, bucket_bytes=SMALL_BUCKETS)
    spec = broadcast_spec(layout)
    spec_path = tmp_path / "spec.msgpack"
    spec_path.write_bytes(encode(spec))
    layouts = {"1": ["spec", "spec"], "2": ["spec", "rebucketed"]}  # rank 2 rejects the second sync
    receivers.run("zero3", spec, architecture="llama", tied=True, layouts=layouts)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }
    master_port = free_port()
    learners = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "learner",
                str(rank),
                "2",
                str(master_port),
                str(spec_path),
                str(tmp_path),
            ],
            env=env,
        )
        for rank in (0, 1)
    ]
    codes = wait_world(learners, TIMEOUT_S * 2)
    assert codes == [0, 0]
    results = receivers.wait("zero3")
    infos = [json.loads((tmp_path / f"learner-{rank}.json").read_text()) for rank in (0, 1)]
    errors = [info.pop("second_error") for info in infos]
    assert "a receiver rejected the layout of version 6" in errors[0]
    assert "data-parallel rank 0 failed to send version 6" in errors[1]
    assert infos == [
        {"is_sender": True, "report_is_none": False, "same_layout": True},
        {"is_sender": False, "report_is_none": True, "same_layout": True},
    ]
    sent = decode((tmp_path / "learner-report.msgpack").read_bytes(), WeightSyncReport)
    trained = decode((tmp_path / "learner-state.msgpack").read_bytes(), dict[str, torch.Tensor])
    assert not torch.equal(trained["model.norm.weight"], model.model.norm.weight.detach())  # a step was taken
    assert "another receiver rejected the layout" in results[1]["error"]
    assert "differs from this receiver's" in results[2]["error"]
    for result in results.values():  # what the first sync left
        assert compare_checksums(sent, result["report"]) == []
        state = result["state"]
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
        assert_same_state({name: state[name] for name in trained}, trained)


@pytest.mark.slow  # `receivers`: two processes in a gloo group, ~10 s to start and stop
def test_a_receiver_expecting_other_parameter_names_fails_on_both_sides(receivers, tokenizer):
    model = build_tiny_model(tokenizer, architecture="llama", seed=0)  # no attention biases
    spec = broadcast_spec(sync_layout(model))
    receivers.run("mismatch", spec, architecture="qwen2", layouts={"1": ["own"], "2": ["spec"]})
    with BroadcastSender(model, spec) as sender, pytest.raises(WeightSyncError, match="rejected the layout"):
        sender.send(version=1)
    results = receivers.wait("mismatch")
    assert "differs from this receiver's" in results[1]["error"]
    assert "another receiver rejected the layout" in results[2]["error"]


def test_a_sender_refuses_a_layout_that_does_not_match_its_model(tokenizer, tmp_path):
    qwen2 = build_tiny_model(tokenizer, architecture="qwen2")
    llama = build_tiny_model(tokenizer, architecture="llama")
    spec = WeightSyncSpec(transport="file", layout=sync_layout(qwen2), directory=str(tmp_path))
    with pytest.raises(
        ValueError,
        match=r"FileSender: spec.layout does not match the model: 6 names only in the layout \(model.layers.0.self_attn.q_proj.bias",
    ):
        FileSender(llama, spec)
    with pytest.raises(ValueError, match=r"spec.transport is 'file', this sender handles 'broadcast'"):
        BroadcastSender(qwen2, spec)
    with pytest.raises(
        ValueError, match=r"sync_layout: dtype must be None or a floating torch.dtype, got torch.int8"
    ):
        sync_layout(qwen2, dtype=torch.int8)


@pytest.mark.gpu
def test_ipc_sender_hands_engines_on_the_same_gpu_the_exact_bytes(tokenizer):
    model = build_tiny_model(tokenizer, seed=0).cuda()
    layout = sync_layout(model, dtype=torch.bfloat16, bucket_bytes=SMALL_BUCKETS)
    spec = WeightSyncSpec(transport="ipc", layout=layout)
    sender = IpcSender(model, spec)
    sent = sender.send(version=4)
    code = (
        "import sys, torch; from rl_data import decode, encode; "
        "from rl_data.sync import WeightSyncSpec; from rl_data.sync.ipc import IpcPayload, read_ipc_buckets; "
        "spec = decode(open(sys.argv[1], 'rb').read(), WeightSyncSpec); "
        "payload = decode(sys.stdin.buffer.read(), IpcPayload); got = {}; "
        "report = read_ipc_buckets(payload, spec.layout, lambda b, v: got.update({k: t.cpu() for k, t in v.items()})); "
        "sys.stdout.buffer.write(encode([report, got]))"
    )
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".msgpack") as spec_file:
        spec_file.write(encode(spec))
        spec_file.flush()
        done = subprocess.run(
            [sys.executable, "-c", code, spec_file.name],
            input=encode(sender.payload),
            capture_output=True,
            check=True,
            timeout=TIMEOUT_S,
        )
    report, received = decode(done.stdout, tuple[WeightSyncReport, dict[str, torch.Tensor]])
    sender.close()
    assert compare_checksums(sent, report) == []
    expected = {name: p.detach().to(torch.bfloat16).cpu() for name, p in model.named_parameters()}
    assert_same_state(received, expected)
