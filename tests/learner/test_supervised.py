"""Supervised learners (SFT, reward model, DPO / cDPO / IPO): packing here, real DeepSpeed steps in a worker.

The worker (`_worker_supervised.py`, one process, gloo world size 1, ZeRO-2 fp32) checks the
learners' first-step loss and pair metrics against plain transformers forwards of every sequence
on its own plus the rl_algos loss on the whole batch, the same step split into three micro-batches
and an empty one, and the metric moving the right way over a few steps on a fixed batch.
"""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest
import torch

from rl_data.datasets import PreferencePair
from rl_learner import DPOLossConfig, group_by_tokens, pack_pairs, pack_sequences, sequence_logprobs
from tests.learner.single_rank import single_rank_env

WORKER = pathlib.Path(__file__).resolve().parent / "_worker_supervised.py"


def test_pack_sequences_targets_are_the_loss_mask_after_the_first_token():
    batch = pack_sequences(
        [
            (torch.tensor([5, 6, 7, 8]), torch.tensor([False, False, True, True])),
            (torch.tensor([9, 10, 11]), torch.tensor([True, True, True])),  # first token: never a target
        ]
    )
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 11]
    assert batch.action_mask.tolist() == [False, False, True, True, False, True, True]
    assert batch.prompt_lengths.tolist() == [2, 1]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2]
    values = torch.arange(7, dtype=torch.float32)
    assert sequence_logprobs(batch, values).tolist() == [2 + 3, 5 + 6]


def test_pack_sequences_refuses_a_sequence_without_targets():
    with pytest.raises(ValueError, match=r"sequences\[1\]: no target token"):
        pack_sequences(
            [
                (torch.tensor([1, 2]), torch.tensor([False, True])),
                (torch.tensor([1, 2]), torch.tensor([True, False])),
            ]
        )


def test_pack_pairs_puts_chosen_first_and_margins_in_rewards():
    pair = PreferencePair(
        chosen_ids=torch.tensor([1, 2, 3]),
        chosen_mask=torch.tensor([False, True, True]),
        rejected_ids=torch.tensor([1, 4]),
        rejected_mask=torch.tensor([False, True]),
        margin=0.5,
    )
    other = PreferencePair(
        chosen_ids=torch.tensor([7, 8]),
        chosen_mask=torch.tensor([False, True]),
        rejected_ids=torch.tensor([7, 9, 9]),
        rejected_mask=torch.tensor([False, True, True]),
    )
    batch = pack_pairs([pair, other])
    assert batch.num_sequences == 4
    assert batch.input_ids.tolist() == [1, 2, 3, 7, 8, 1, 4, 7, 9, 9]
    assert batch.rewards.tolist() == [0.5, 0.0, 0.0, 0.0]


def test_group_by_tokens_keeps_order_and_budget():
    assert group_by_tokens([3, 4, 5, 20, 1, 1], 8) == [[0, 1], [2], [3], [4, 5]]
    with pytest.raises(ValueError, match="budget"):
        group_by_tokens([1], 0)


def test_dpo_loss_config_names_the_bad_option():
    with pytest.raises(ValueError, match="loss_type"):
        DPOLossConfig(loss_type="hinge")
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOLossConfig(loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="beta"):
        DPOLossConfig(beta=0.0)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("supervised")
    env = single_rank_env()
    done = subprocess.run(
        [sys.executable, str(WORKER), str(folder)], env=env, capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        pytest.fail(f"worker failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return json.loads((folder / "metrics.json").read_text())


PAIR_KEYS = {
    "dpo": ("reward_margin", "reward_accuracy", "chosen_rewards", "rejected_rewards"),
    "cdpo": ("reward_margin", "reward_accuracy"),
    "ipo": ("reward_margin", "reward_accuracy"),
    "rm": ("accuracy", "reward_margin", "chosen_reward", "rejected_reward"),
    "kto": ("kl", "desirable_rewards", "undesirable_rewards"),
}


@pytest.mark.slow  # `results`: a DeepSpeed worker process
@pytest.mark.parametrize("kind", ["sft", "dpo", "cdpo", "ipo", "rm", "kto"])
def test_first_step_matches_plain_transformers_and_the_rl_algos_loss(results, kind):
    run = results[kind]
    assert run["whole"]["skipped"] == 0.0
    assert math.isclose(run["whole"]["loss"], run["reference"]["loss"], rel_tol=1e-4, abs_tol=1e-5)
    for key in PAIR_KEYS.get(kind, ()):
        assert math.isclose(run["whole"][key], run["reference"][key], rel_tol=1e-4, abs_tol=1e-5), key


@pytest.mark.slow  # `results`: a DeepSpeed worker process
@pytest.mark.parametrize("kind", ["sft", "dpo", "cdpo", "ipo", "rm", "kto"])
def test_micro_batch_split_gives_the_same_step(results, kind):
    whole, split = results[kind]["whole"], results[kind]["split"]
    for key in ("loss", "grad_norm", "tokens", "sequences", *PAIR_KEYS.get(kind, ())):
        assert math.isclose(whole[key], split[key], rel_tol=1e-4, abs_tol=1e-6), key


@pytest.mark.slow  # `results`: a DeepSpeed worker process
def test_training_moves_each_metric_the_right_way(results):
    sft = [m["loss"] for m in results["sft"]["curve"]]
    assert sft[-1] < 0.5 * sft[0]
    for kind in ("dpo", "cdpo"):
        curve = results[kind]["curve"]
        assert curve[-1]["reward_margin"] > curve[0]["reward_margin"] + 0.5, kind
        assert curve[-1]["reward_accuracy"] == 1.0, kind
    # IPO regresses z onto 1/(2β), so the reward margin β·z settles at 1/2 instead of growing.
    ipo = results["ipo"]["curve"]
    assert abs(ipo[-1]["reward_margin"] - 0.5) < 0.1 < abs(ipo[0]["reward_margin"] - 0.5)
    assert ipo[-1]["loss"] < 0.5 * ipo[0]["loss"]
    rm = results["rm"]["curve"]
    assert rm[-1]["loss"] < rm[0]["loss"]
    assert rm[-1]["accuracy"] == 1.0
    kto = results["kto"]["curve"]
    margins = [m["desirable_rewards"] - m["undesirable_rewards"] for m in kto]
    assert margins[-1] > margins[0] + 0.5
    assert kto[-1]["loss"] < kto[0]["loss"]


MOE_WORKER = pathlib.Path(__file__).resolve().parent / "_worker_supervised_moe.py"


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("supervised-moe")
    done = subprocess.run(
        [sys.executable, str(MOE_WORKER), str(folder)],
        env=single_rank_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        pytest.fail(f"worker failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return json.loads((folder / "results.json").read_text())


@pytest.mark.slow  # a DeepSpeed worker process
@pytest.mark.parametrize("kind", ["sft", "dpo", "rm"])
def test_moe_load_balancing_term_joins_the_supervised_loss_and_trains_the_routers(moe_results, kind):
    """aux_loss_coef c (OpenRLHF's --model.aux_loss_coef): loss = loss without it + c · L_aux,
    and the routers get a gradient of their own."""
    off, on, split = (moe_results[kind][name] for name in ("off", "on", "split"))
    assert "aux_loss" not in off
    assert on["aux_loss"] > 0
    assert on["loss_aux"] == pytest.approx(0.5 * on["aux_loss"], rel=1e-5)
    assert on["loss"] == pytest.approx(off["loss"] + on["loss_aux"], rel=1e-5)
    # two micro-batches: each one's L_aux over its own tokens, weighted by its share of the targets
    assert split["loss_aux"] == pytest.approx(0.5 * split["aux_loss"], rel=1e-5)
    assert split["loss"] == pytest.approx(off["loss"] + split["loss_aux"], rel=1e-4)
    assert moe_results[kind]["gates_differ"]  # the term changes the routers' update
    if kind == "sft":  # the packed forward's routers: the same L_aux as computed directly
        assert on["aux_loss"] == pytest.approx(moe_results["sft_expected_aux"], rel=1e-5)
