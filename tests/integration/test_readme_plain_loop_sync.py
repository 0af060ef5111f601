"""rl-learner's README recipe for a plain torch loop: its weights reach an engine through the file
transport, over several buckets, checksums equal every step, and the engine holds the trained
weights afterwards."""

from __future__ import annotations

import pathlib
import re

import torch

README = pathlib.Path(__file__).resolve().parents[2] / "packages" / "rl-learner" / "README.md"


def test_plain_loop_recipe_syncs_every_bucket_into_the_engine(tiny_checkpoint, tmp_path):
    (block,) = [b for b in re.findall(r"```python\n(.+?)```", README.read_text(), re.S) if "HFEngine(" in b]
    namespace = {"checkpoint": str(tiny_checkpoint), "sync_dir": tmp_path / "sync"}
    (tmp_path / "sync").mkdir()
    exec(block, namespace)
    assert len(namespace["layout"].buckets) > 2
    engine, model = namespace["engine"], namespace["model"]
    try:
        served = engine.model.state_dict()
        for name, param in model.named_parameters():
            torch.testing.assert_close(served[name], param.detach(), rtol=0, atol=0)
    finally:
        engine.close()
