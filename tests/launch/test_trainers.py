"""`rl-launch sft`, `rm`, `dpo`, `kto`: configs (unit) and one real run each (slow).

The e2e tests run the real CLI (`rl_launch.cli.main`, in the test's process: these commands
train in the driver process, DeepSpeed on CPU with a world of one, so a process of their own
would add only its seconds of imports) on the arithmetic demo (a tiny model built locally),
check that the headline metric moves the right way, resume from the run's checkpoint with a
larger train.max_steps, and load `final/` with transformers. The rm run trains LoRA adapters;
the dpo run trains on the FSDP2 backend with CPU offload (`--train.backend fsdp2
--train.adam_offload true`). `rl-launch sft` sent
SIGTERM, in a process of its own, is tests/launch/test_preemption_e2e.py.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from rl_launch.cli import main
from rl_launch.config import ConfigError
from rl_launch.trainers import DPOConfig, RMConfig, SFTConfig, resolve_config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from launching import read_metrics

# --------------------------------------------------------------------------- configs


def test_no_arguments_choose_the_arithmetic_preset_and_its_settings():
    config = resolve_config("sft", None, {})
    assert isinstance(config, SFTConfig)
    assert config.preset == "arithmetic"
    assert config.log.output_dir == "runs/sft-arithmetic"
    assert config.train.train_batch_size == 16


def test_a_named_model_or_dataset_turns_the_preset_off():
    config = resolve_config("dpo", None, {"model.pretrain": "m", "data.dataset": "d.jsonl"})
    assert isinstance(config, DPOConfig)
    assert config.preset == "none"
    assert config.log.output_dir == "runs/dpo"
    assert config.loss.beta == 0.1
    with pytest.raises(ConfigError, match=r"data\.dataset: None is required without a preset"):
        resolve_config("rm", None, {"model.pretrain": "m"})


def test_dotted_options_reach_the_loss_and_data_sections():
    config = resolve_config(
        "rm", None, {"data.margin_key": "m", "loss.use_margin": "true", "data.chosen_key": "good"}
    )
    assert isinstance(config, RMConfig)
    assert config.loss.use_margin
    assert config.data.margin_key == "m"
    assert config.data.chosen_key == "good"
    dpo = resolve_config("dpo", None, {"loss.loss_type": "ipo", "loss.beta": "0.5"})
    assert (dpo.loss.loss_type, dpo.loss.beta) == ("ipo", 0.5)


@pytest.mark.parametrize(
    ("command", "overrides", "message"),
    [
        ("dpo", {"loss.loss_type": "ipo", "loss.label_smoothing": "0.1"}, "loss.label_smoothing"),
        ("dpo", {"loss.label_smoothing": "0.5"}, "loss.label_smoothing"),
        ("dpo", {"loss.beta": "0"}, "loss.beta"),
        ("rm", {"loss.use_margin": "true"}, "needs data.margin_key"),
        ("sft", {"loss.aggregation": "seq-mean-token-sum"}, "loss.aggregation"),
        ("sft", {"model.critic_pretrain": "x"}, "does not apply to rl-launch sft"),
        ("rm", {"train.max_epochs": "2"}, "train.max_epochs"),
        ("sft", {"train.critic_optimizer": "muon"}, "train.critic_optimizer: 'muon' does not apply"),
        # the config's `> 0` admits inf; rl-learner's own check refuses it before anything starts
        ("kto", {"train.actor_learning_rate": "1e400"}, "OptimizerConfig.lr: inf is not a finite number"),
    ],
)
def test_bad_options_name_the_dotted_field(command, overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        resolve_config(command, None, overrides)


def test_the_trained_model_uses_the_actor_optimizer_settings():
    from rl_launch.trainers.loop import learner_options

    config = resolve_config(
        "dpo", None, {"train.actor_optimizer": "muon", "train.actor_muon_learning_rate": "0.01"}
    )
    optimizer = learner_options(config).optimizer
    assert (optimizer.name, optimizer.muon_lr, optimizer.lr) == (
        "muon",
        0.01,
        config.train.actor_learning_rate,
    )


def test_cli_print_config_and_bad_option_exit_codes(capsys):
    assert main(["dpo", "--print-config", "--loss.beta", "0.3"]) == 0
    assert "beta: 0.3" in capsys.readouterr().out
    assert main(["sft", "--loss.nope", "1"]) == 2
    assert "loss.nope" in capsys.readouterr().err
    assert main(["rm", "--loss.use_margin", "true"]) == 2
    assert "rl-launch rm: error: loss.use_margin" in capsys.readouterr().err


# --------------------------------------------------------------------------- runs

STEPS = {"sft": 40, "rm": 24, "dpo": 24, "kto": 24}
MORE = 4


def _run(command: str, args: list[str], capsys) -> subprocess.CompletedProcess:
    """`rl-launch <command> <args>` through the CLI's main in this process: its exit code and output."""
    capsys.readouterr()
    code = main([command, *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([command, *args], code, out, err)


def _mean(records: list[dict], key: str, rows: slice) -> float:
    values = [record[key] for record in records[rows]]
    return sum(values) / len(values)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "kto"])
def test_demo_run_learns_resumes_and_exports(command, tmp_path, capsys, in_process):
    out = tmp_path / "run"
    common = [
        "--preset_root",
        str(tmp_path / "presets"),
        "--log.output_dir",
        str(out),
        "--log.progress_bar",
        "false",
    ]
    steps = STEPS[command]
    if command == "rm":  # LoRA adapters on the backbone, the score head trained whole, merged at export
        common += ["--model.lora_rank", "8"]
    if command == "dpo":  # the policy (CPU-offloaded) and its frozen reference on FSDP2; DCP checkpoints
        common += ["--train.backend", "fsdp2", "--train.adam_offload", "true"]
    first = _run(command, [*common, "--train.max_steps", str(steps)], capsys)
    assert first.returncode == 0, first.stderr[-4000:]
    if command == "dpo":
        assert "learner: FSDP2 (fully_shard, CPU offload of parameters" in first.stdout + first.stderr
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    early, late = slice(0, 4), slice(-4, None)
    if command == "sft":
        assert _mean(records, "sft/loss", late) < 0.6 * _mean(records, "sft/loss", early)
    elif command == "rm":
        assert _mean(records, "rm/accuracy", late) > _mean(records, "rm/accuracy", early) + 0.2
        assert _mean(records, "rm/accuracy", late) >= 0.9
    else:  # dpo, kto
        margin = f"{command}/reward_margin"
        assert _mean(records, margin, late) > _mean(records, margin, early) + 0.1
        assert records[0][margin] == pytest.approx(0.0, abs=1e-6)  # policy == reference
    assert (out / "curves.png").is_file()
    assert (out / "summary.txt").is_file()

    again = _run(
        command, [*common, "--ckpt.load_checkpoint", "true", "--train.max_steps", str(steps + MORE)], capsys
    )
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resuming run" in again.stdout + again.stderr
    assert f"from step {steps}" in again.stdout + again.stderr
    resumed = read_metrics(out)
    assert [r["step"] for r in resumed] == list(range(1, steps + MORE + 1))
    assert resumed[:steps] == records  # the first run's lines are kept as they were
    if command in ("dpo", "kto"):  # the restored policy differs from the reference: no restart at 0
        assert resumed[steps][f"{command}/reward_margin"] > 0.1

    import transformers

    kind = (
        transformers.AutoModelForSequenceClassification
        if command == "rm"
        else transformers.AutoModelForCausalLM
    )
    model = kind.from_pretrained(out / "final")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out / "final")
    ids = tokenizer("What is 3 + 1?", return_tensors="pt")
    assert model(**ids).logits.shape[0] == 1


def test_epochs_become_steps_once_the_dataset_size_is_known():
    from rl_launch.trainers.loop import steps_of_epochs

    config = resolve_config("sft", None, {"train.epochs": "2", "train.train_batch_size": "4"})
    assert steps_of_epochs(config, 10).train.max_steps == 5  # ⌈2 × 10 / 4⌉
    assert steps_of_epochs(config, 1).train.max_steps == 1


def test_multi_turn_sft_trains_every_assistant_turn_and_nothing_else(tmp_path):
    """`data.messages_key` (OpenRLHF's --data.multiturn): the chat template's assistant spans are
    the loss mask, across turns."""
    import json

    from rl_data.tiny import build_tiny_tokenizer
    from rl_launch.trainers import sft

    tokenizer = build_tiny_tokenizer(chat_template="chatml")
    path = tmp_path / "chats.jsonl"
    conversation = [
        {"role": "user", "content": "What is 2 + 1?"},
        {"role": "assistant", "content": "3"},
        {"role": "user", "content": "And 3 + 1?"},
        {"role": "assistant", "content": "4"},
    ]
    path.write_text(json.dumps({"messages": conversation}) + "\n")
    config = resolve_config(
        "sft", None, {"model.pretrain": "m", "data.dataset": str(path), "data.messages_key": "messages"}
    )
    sample = sft.TASK.load(config, tokenizer, str(path))[0]
    trained = tokenizer.decode(sample.input_ids[sample.loss_mask].tolist())
    assert trained.replace(" ", "") == "3<|im_end|>4<|im_end|>".replace(" ", "")
    untrained = tokenizer.decode(sample.input_ids[~sample.loss_mask].tolist())
    assert "2 + 1" in untrained.replace("  ", " ") or "2+1" in untrained.replace(" ", "")
    with pytest.raises(ConfigError, match=r"data\.messages_key.*apply_chat_template"):
        resolve_config("sft", None, {"data.messages_key": "messages", "data.apply_chat_template": "false"})


def test_datasets_are_read_mixed_and_split_as_ppo_reads_prompts(tmp_path, monkeypatch):
    """data.dataset: several files mixed by data.dataset_probs, a save_to_disk DatasetDict's
    data.dataset_split, a hub name that is not cached (offline) refused naming the option."""
    import json

    import datasets

    from rl_data.tiny import build_tiny_tokenizer
    from rl_launch.preflight import PreflightError
    from rl_launch.trainers import dpo

    tokenizer = build_tiny_tokenizer(chat_template="chatml")
    rows = {
        name: [{"prompt": f"{name} {i}", "chosen": "1", "rejected": "2"} for i in range(count)]
        for name, count in (("a", 30), ("b", 10))
    }
    for name, part in rows.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in part))
    both = f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"

    def load(**options):
        config = resolve_config("dpo", None, {"model.pretrain": "m", **options})
        return dpo.TASK.load(config, tokenizer, config.data.dataset)

    assert len(load(**{"data.dataset": both})) == 40  # concatenated
    mixed = load(**{"data.dataset": both, "data.dataset_probs": "0.5,0.5", "data.max_samples": "20"})
    sources = [mixed[i].source for i in range(len(mixed))]
    assert len(sources) == 20
    assert {s.rsplit("/", 1)[-1] for s in sources} == {"a.jsonl", "b.jsonl"}
    with pytest.raises(ConfigError, match=r"data\.dataset_probs.*one probability per data\.dataset"):
        load(**{"data.dataset": both, "data.dataset_probs": "1.0"})

    folder = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows["a"]), "validation": datasets.Dataset.from_list(rows["b"])}
    ).save_to_disk(str(folder))
    assert len(load(**{"data.dataset": str(folder), "data.dataset_split": "validation"})) == 10
    with pytest.raises(PreflightError, match=r"data\.dataset_split: 'test' is not a split"):
        load(**{"data.dataset": str(folder), "data.dataset_split": "test"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PreflightError, match=r"data\.dataset: 'nobody/no-such-set'.*HF_HUB_OFFLINE"):
        load(**{"data.dataset": "nobody/no-such-set"})


def test_pretrain_mode_trains_every_token_of_plain_text_rows(tmp_path):
    """data.pretrain_mode (OpenRLHF's --model.pretrain_mode_enable): text rows, every token trained."""
    import json

    from rl_data.tiny import build_tiny_tokenizer
    from rl_launch.aliases import expand_aliases
    from rl_launch.trainers import sft

    tokenizer = build_tiny_tokenizer(chat_template="chatml")
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in ("1 + 1 = 2", "2 + 2 = 4")))
    argv, _ = expand_aliases(["--model.pretrain_mode_enable"], "sft")
    assert argv == ["--data.pretrain_mode", "true"]
    config = resolve_config(
        "sft",
        None,
        {
            "model.pretrain": "m",
            "data.dataset": str(path),
            "data.pretrain_mode": "true",
            "data.input_key": "text",
        },
    )
    samples = sft.TASK.load(config, tokenizer, str(path))
    assert len(samples) == 2
    first = samples[0]
    assert bool(first.loss_mask.all())  # the first token has no target; pack_sequences drops it
    assert tokenizer.decode(first.input_ids.tolist()) == "1 + 1 = 2" + tokenizer.eos_token
    with pytest.raises(ConfigError, match=r"data\.pretrain_mode"):
        resolve_config("sft", None, {"data.pretrain_mode": "true", "data.messages_key": "m"})
