"""rl-learner's README recipes for a plain torch loop: its weights reach an engine through the file
transport, over several buckets, checksums equal every step, and the engine holds the trained
weights afterwards; a packed forward of a plain transformers model equals per-sequence forwards."""

from __future__ import annotations

import itertools
import pathlib
import re
import sys
import textwrap

import pytest
import torch

README = pathlib.Path(__file__).resolve().parents[2] / "packages" / "rl-learner" / "README.md"


# Run in a process that sees only what `pip install rl-learner rl-rollout` installs (the
# declared-only guard of tests/test_declared_dependencies.py): the recipe's user has nothing else.
DRIVER = """
import sys, torch
block, checkpoint, sync_dir = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3]
namespace = {"checkpoint": checkpoint, "sync_dir": sync_dir}
exec(block, namespace)
assert len(namespace["layout"].buckets) > 2, namespace["layout"].buckets
engine, model = namespace["engine"], namespace["model"]
try:
    served = engine.model.state_dict()
    for name, param in model.named_parameters():
        torch.testing.assert_close(served[name], param.detach(), rtol=0, atol=0)
finally:
    engine.close()
print("ok", len(namespace["layout"].buckets), "buckets")
"""


@pytest.mark.slow
def test_plain_loop_recipe_syncs_every_bucket_into_the_engine(tiny_checkpoint, tmp_path):
    from tests.test_declared_dependencies import run_declared_only

    (block,) = [b for b in re.findall(r"```python\n(.+?)```", README.read_text(), re.S) if "HFEngine(" in b]
    (tmp_path / "recipe.py").write_text(block)
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "sync").mkdir()
    command = [sys.executable, "driver.py", "recipe.py", str(tiny_checkpoint), str(tmp_path / "sync")]
    result = run_declared_only(tmp_path, ("rl-learner", "rl-rollout"), command)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.startswith("ok "), result.stdout


def test_packed_forward_recipe_on_a_plain_model_equals_per_sequence_forwards(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    (block,) = [
        b for b in re.findall(r"```python\n(.+?)```", README.read_text(), re.S) if "packed_logprobs(" in b
    ]
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, attn_implementation="sdpa").double()
    namespace = {"model": model}
    exec(textwrap.dedent(block), namespace)
    logprobs, batch = namespace["logprobs"], namespace["batch"]
    starts = batch.cu_seqlens.tolist()
    for begin, end in itertools.pairwise(starts):
        ids = batch.input_ids[begin:end]
        with torch.no_grad():
            logits = model(ids[None]).logits[0]
        expected = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)
        torch.testing.assert_close(logprobs[begin + 1 : end].detach(), expected)
        assert logprobs[begin] == 0
