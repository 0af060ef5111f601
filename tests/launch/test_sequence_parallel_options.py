"""`model.sequence_parallel_size` in rl-launch: its checks, OpenRLHF's --ds.ring_attn_size alias, the
micro-batch plan of an SP × DP learner group and the start-up words. No actors: the plan is
`Roles.split` on a role of plain ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from rl_launch.cli import main
from rl_launch.config import PPOConfig
from rl_launch.options import load_config
from rl_launch.roles import Roles

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "learner"))
from _helpers_core import experience_with_a_long_sequence

NO_PRESET = ["--preset", "none", "--model.pretrain", "some/model", "--data.prompt_data", "prompts.jsonl"]
NO_PRESET += ["--algo.advantage.estimator", "grpo"]  # no critic unless a test asks for one


def _error(capsys, *args: str, command: str = "ppo") -> str:
    assert main([command, *args]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--model.sequence_parallel_size", "2"],
            "ray.policy.num_actors: 1 must be a multiple of model.sequence_parallel_size 2",
        ),
        (
            [
                "--model.sequence_parallel_size",
                "2",
                "--ray.policy.num_actors",
                "2",
                "--algo.kl.init_kl_coef",
                "0.01",
            ],
            "ray.ref.num_actors: 1 must be a multiple of model.sequence_parallel_size 2",
        ),
        (
            ["--model.sequence_parallel_size", "2", "--model.attn_implementation", "flash_attention_2"],
            "model.sequence_parallel_size: 2 needs model.attn_implementation sdpa or eager",
        ),
        (
            [
                "--model.sequence_parallel_size",
                "2",
                "--ray.policy.num_actors",
                "2",
                "--algo.policy.aux_loss_coef",
                "0.1",
            ],
            "algo.policy.aux_loss_coef: 0.1 must be 0 with model.sequence_parallel_size 2",
        ),
        (
            [
                "--model.sequence_parallel_size",
                "2",
                "--ray.policy.num_actors",
                "2",
                "--algo.advantage.estimator",
                "gae",
            ],
            "ray.critic.num_actors: 1 must be a multiple of model.sequence_parallel_size 2",
        ),
        (["--model.sequence_parallel_size", "0"], "model.sequence_parallel_size: 0 must be >= 1"),
    ],
)
def test_sequence_parallel_size_is_checked_against_the_roles(capsys, args, message):
    assert message in _error(capsys, *NO_PRESET, *args)


def test_unused_roles_need_not_be_multiples_of_sp(capsys):
    args = [
        "--model.sequence_parallel_size",
        "2",
        "--ray.policy.num_actors",
        "4",
        "--algo.kl.init_kl_coef",
        "0",
    ]
    assert main(["ppo", *NO_PRESET, *args, "--print-config"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["model"]["sequence_parallel_size"] == 2


def test_supervised_commands_need_ranks_for_sequence_parallelism(capsys):
    args = ["--preset", "none", "--model.pretrain", "m", "--data.dataset", "d.jsonl"]
    message = _error(capsys, *args, "--model.sequence_parallel_size", "2", command="sft")
    assert "model.sequence_parallel_size: 2 must divide ray.learner.num_actors (1)" in message
    assert "--ray.learner.num_actors to a multiple of 2" in message
    two = ["--model.sequence_parallel_size", "2", "--ray.learner.num_actors", "4", "--print-config"]
    assert main(["dpo", *args, *two]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert (config["model"]["sequence_parallel_size"], config["ray"]["learner"]["num_actors"]) == (2, 4)


def test_openrlhf_ring_attn_size_becomes_sequence_parallel_size_with_a_note(capsys):
    ring = ["--ds.ring_attn_size", "2", "--ds.ring_attn_head_stride", "4", "--ray.policy.num_actors", "2"]
    assert main(["ppo", *NO_PRESET, *ring, "--algo.kl.init_kl_coef", "0", "--print-config"]) == 0
    captured = capsys.readouterr()
    assert yaml.safe_load(captured.out)["model"]["sequence_parallel_size"] == 2
    assert "--model.sequence_parallel_size 2" in captured.err
    assert "Ulysses" in captured.err
    assert "--ds.ring_attn_head_stride" in captured.err
    assert "ignored: it tunes ring attention's head chunks" in captured.err


def test_openrlhf_ring_attn_size_reaches_the_supervised_commands(capsys):
    args = ["--preset", "none", "--model.pretrain", "m", "--data.dataset", "d.jsonl"]
    ring = ["--ds.ring_attn_size", "2", "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "2"]
    assert main(["sft", *args, *ring, "--print-config"]) == 0
    captured = capsys.readouterr()
    config = yaml.safe_load(captured.out)
    assert (config["model"]["sequence_parallel_size"], config["ray"]["learner"]["num_actors"]) == (2, 2)
    assert "--model.sequence_parallel_size 2" in captured.err
    assert main(["serve-rm", "--ds.ring_attn_size", "2"]) == 2
    assert "serve-rm runs its model in one process" in capsys.readouterr().err


def _roles(sp: int, ranks: int, budget: int) -> Roles:
    config = load_config(
        PPOConfig,
        overrides={
            "preset": "none",
            "model.pretrain": "m",
            "data.prompt_data": "d.jsonl",
            "model.sequence_parallel_size": str(sp),
            "ray.policy.num_actors": str(ranks),
            "train.micro_batch_tokens": str(budget),
            "model.share_prefix": "false",
            "algo.advantage.estimator": "grpo",
        },
    )
    roles = Roles(config)
    roles.groups = {"policy": [None] * ranks}  # split reads only the number of ranks
    return roles


def test_the_ranks_of_an_sp_group_get_the_same_micro_batches_of_up_to_sp_times_the_budget():
    batch = experience_with_a_long_sequence()  # 113 tokens, the longest sequence 63
    budget = 40  # one rank's share: the 63-token sequence fits a group of 2, not one rank
    parts = _roles(2, 4, budget).split(batch, "policy")
    assert len(parts) == 4
    for first, second in ((0, 1), (2, 3)):
        assert [p.indices.tolist() for p in parts[first]] == [p.indices.tolist() for p in parts[second]]
    assert all(part.num_tokens <= 2 * budget for rank in parts for part in rank)
    groups = [sorted(i for part in parts[rank] for i in part.indices.tolist()) for rank in (0, 2)]
    assert sorted(groups[0] + groups[1]) == list(range(batch.num_sequences))
    # one rank alone: the 63-token sequence is over its budget and gets a micro-batch of its own
    parts = _roles(1, 2, budget).split(batch, "policy")
    longest = int(batch.sequence_lengths.argmax())
    alone = [part for rank in parts for part in rank if longest in part.indices.tolist()]
    assert [part.indices.tolist() for part in alone] == [[longest]]
    assert all(part.num_tokens <= budget for rank in parts for part in rank if part is not alone[0])
    assert sorted(i for rank in parts for part in rank for i in part.indices.tolist()) == list(
        range(batch.num_sequences)
    )


def test_the_start_up_line_says_the_sequence_parallel_size():
    roles = _roles(2, 4, 1000)
    assert roles.describe_sequence_parallel() == (
        "sequence parallel: 2 ranks share each micro-batch (Ulysses; data-parallel groups: policy 2); "
        "a micro-batch holds up to 2 x 1000 tokens"
    )
    assert _roles(1, 4, 1000).describe_sequence_parallel() is None
