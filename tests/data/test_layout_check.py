"""A weight-sync layout is checked against the receiving model's shapes before any bucket moves."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from rl_data import check_layout_shapes, plan_buckets, safetensors_shapes


def _layout(shapes: dict[str, tuple[int, ...]]):
    return plan_buckets([(name, torch.bfloat16, shape) for name, shape in shapes.items()], bucket_bytes=64)


def test_safetensors_shapes_reads_every_file_header(tmp_path):
    save_file({"a.weight": torch.zeros(3, 4)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b.bias": torch.zeros(5)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert safetensors_shapes(tmp_path) == {"a.weight": (3, 4), "b.bias": (5,)}


def test_safetensors_shapes_of_the_tiny_checkpoint_match_its_model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    on_disk = safetensors_shapes(tiny_checkpoint)
    assert on_disk
    assert all(tuple(model.state_dict()[name].shape) == shape for name, shape in on_disk.items())


def test_a_matching_layout_passes_and_names_only_one_side_has_are_not_checked():
    layout = _layout({"embed.weight": (8, 4), "lm_head.weight": (8, 4)})
    check_layout_shapes(layout, {"embed.weight": [8, 4], "fused_qkv.weight": (12, 4)}, where="test")


def test_a_shape_mismatch_names_the_parameter_and_both_shapes():
    layout = _layout({"embed.weight": (8, 4), "norm.weight": (4,)})
    with pytest.raises(
        ValueError, match=r"engine.init: .*'embed.weight' is \[8, 4\] in the layout.*\[9, 4\]"
    ):
        check_layout_shapes(layout, {"embed.weight": (9, 4), "norm.weight": (4,)}, where="engine.init")


def test_many_mismatches_are_listed_up_to_shown_and_counted():
    layout = _layout({f"layer{i}.weight": (2, 2) for i in range(8)})
    with pytest.raises(ValueError, match=r"\(and 3 more\)"):
        check_layout_shapes(layout, {f"layer{i}.weight": (3, 2) for i in range(8)}, where="w", shown=5)
