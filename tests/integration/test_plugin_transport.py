"""A weight-sync transport added from a test module, without editing the packages: its spec,
sender and receiver are found by name on each side, and a real `rl_learner` sender updates a real
`rl_rollout` HF engine through it with checksums that match."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from rl_data import compare_checksums, decode, encode
from rl_data.sync import TRANSPORTS, WeightSyncSpec
from rl_data.tiny import build_tiny_model, build_tiny_tokenizer
from rl_learner import SENDERS, make_sender, sync_layout
from rl_rollout import RECEIVERS, SamplingParams
from rl_rollout.engines.hf import HFEngine

_spec = importlib.util.spec_from_file_location(
    "_toy_transport", pathlib.Path(__file__).with_name("_toy_transport.py")
)
toy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(toy)


def test_a_plugin_transport_registers_on_every_side_by_name():
    assert toy.NAME in TRANSPORTS
    assert SENDERS[toy.NAME] is toy.ToySender
    assert RECEIVERS[toy.NAME] is toy.ToyReceiver
    meta = sync_layout(build_tiny_model(build_tiny_tokenizer(), seed=0))
    with pytest.raises(ValueError, match=r"options\.folder: the toy_folder transport needs a folder"):
        WeightSyncSpec(transport=toy.NAME, layout=meta)
    spec = WeightSyncSpec(transport=toy.NAME, layout=meta, options={"folder": "/somewhere"})
    assert decode(encode(spec), WeightSyncSpec) == spec  # its own fields travel in the spec


def test_a_learner_sender_updates_an_hf_engine_through_a_plugin_transport(tmp_path):
    tokenizer = build_tiny_tokenizer()
    engine_model, learner_model = build_tiny_model(tokenizer, seed=0), build_tiny_model(tokenizer, seed=1)
    engine = HFEngine(engine_model, tokenizer, device="cpu", max_model_len=64)
    spec = WeightSyncSpec(
        transport=toy.NAME, layout=sync_layout(learner_model), options={"folder": str(tmp_path)}
    )
    engine.init_weight_sync(spec, rank=1)
    with make_sender(
        spec, learner_model, device="cpu", keep=3
    ) as sender:  # options it does not take are left out
        assert isinstance(sender, toy.ToySender)
        sent = sender.send(version=4)
    received = engine.receive_weights(version=4)
    assert engine.policy_version == 4
    assert compare_checksums(sent, received) == []
    learned = dict(learner_model.named_parameters())
    for name, param in engine.model.named_parameters():
        torch.testing.assert_close(param, learned[name], rtol=0, atol=0, msg=name)
    generation = engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=4))[0][0]
    assert generation.policy_version == 4
    engine.close()
