"""The typed configurations of `rl-launch sft`, `rm`, `dpo` and `kto`.

Each command has its own root struct (`SFTConfig`, `RMConfig`, `DPOConfig`, `KTOConfig`) built from the same
sections as `PPOConfig` where they mean the same thing (`model`, `train`, `ckpt`, `log`; `train`
and `log` only change defaults) plus its own `data` and `loss` sections. They load through the
same `rl_launch.options` machinery: dotted flags, `--config FILE`, `--print-config`, and a
preset under the file and the flags.

The trained model runs on `ray.learner.num_actors` data-parallel ranks, DeepSpeed engines or
(`--train.backend fsdp2`) torch `fully_shard` modules, whose refusals are
`rl_launch.backends.supervised_fsdp2_refusals`: one rank (the
default, no `ray.address`) trains in the driver process without starting Ray; more ranks, or a
cluster to join, run as a Ray actor group placed and joined as `rl-launch ppo` places its policy
(`rl_launch.trainers.learners`). Options of the shared sections that they cannot honour (a critic,
a separate reward model, PPO epochs; LoRA in rm and dpo) are refused with the reason.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from ..config import (
    CheckpointConfig,
    LogConfig,
    ModelConfig,
    NonNegative,
    Positive,
    PositiveInt,
    ResourceConfig,
    TrainConfig,
    _check_sources,
    _fail,
    _Section,
    check_joined_temp_dir,
    check_probabilities,
)

__all__ = [
    "COMMANDS",
    "DPOConfig",
    "DPOLossSection",
    "KTOConfig",
    "KTOLossSection",
    "PairDataConfig",
    "RMConfig",
    "RMDataConfig",
    "RMLossSection",
    "SFTConfig",
    "SFTDataConfig",
    "SFTLossSection",
    "SupervisedRayConfig",
    "SupervisedTrainConfig",
    "UnpairedDataConfig",
]


class SupervisedTrainConfig(TrainConfig):
    max_steps: PositiveInt = 100
    """Optimizer steps; the data is read in shuffled passes (a new order each pass) as needed."""
    train_batch_size: PositiveInt = 32
    """Samples (sft) or pairs (rm, dpo) per optimizer step."""
    micro_batch_tokens: PositiveInt = 16384
    """Token budget of one packed micro-batch (both sides of a pair stay in one micro-batch);
    gradients accumulate over the micro-batches of a step."""
    actor_learning_rate: Positive = 5e-6
    """Peak learning rate of the trained model."""
    epochs: PositiveInt | None = None
    """Passes over the data (OpenRLHF's max_epochs): when given, train.max_steps becomes
    ⌈epochs × rows / train_batch_size⌉, set once the dataset is loaded (the start-up line says
    how many); None: train.max_steps as given."""


class SFTLogConfig(LogConfig):
    output_dir: str = "runs/sft"
    """Run folder: metrics.jsonl, summary, plot, checkpoints, final model."""


class RMLogConfig(LogConfig):
    output_dir: str = "runs/rm"
    """Run folder: metrics.jsonl, summary, plot, checkpoints, final model."""


class DPOLogConfig(LogConfig):
    output_dir: str = "runs/dpo"
    """Run folder: metrics.jsonl, summary, plot, checkpoints, final model."""


class _DataSource(_Section):
    """The rows of a supervised command: datasets as `rl-launch ppo` reads its prompts."""

    dataset: str | list[str] | None = None
    """Training rows: a .jsonl/.json/.parquet/.csv/.arrow file, a `datasets.save_to_disk` folder, a
    folder that `datasets.load_dataset` reads or a Hugging Face dataset name org/name (with
    HF_HUB_OFFLINE set it must be in the local cache); several comma-separated or as a list (mixed
    by dataset_probs, else concatenated in order). None: the preset's."""
    dataset_probs: list[float] | None = None
    """Mix the datasets: each row is drawn from dataset i with probability p_i (one per dataset,
    summing to 1, e.g. 0.7,0.3; datasets.interleave_datasets until every dataset was used in
    full). None: concatenate."""
    dataset_split: str = "train"
    """Split of a hub dataset, a load_dataset folder or a save_to_disk DatasetDict; a single file is
    its own split."""
    dataset_subset: str | None = None
    """Configuration (subset) of a hub dataset; None: its default."""
    max_samples: PositiveInt | None = None
    """Use at most this many rows (the first ones after mixing)."""

    def __post_init__(self) -> None:
        sources = _check_sources("data.dataset", self.dataset)
        check_probabilities("data.dataset_probs", self.dataset_probs, "data.dataset", sources)


class SFTDataConfig(_DataSource):
    input_key: str = "prompt"
    """Column holding the prompt (text, or a list of chat messages)."""
    output_key: str = "response"
    """Column holding the response (text); only its tokens (and the end-of-turn marker) are trained."""
    pretrain_mode: bool = False
    """Continued pretraining (OpenRLHF's --model.pretrain_mode_enable): each row is plain text,
    input_key's value followed by output_key's when the data has that column, then EOS; every token
    is trained, no chat template."""
    messages_key: str | None = None
    """Multi-turn SFT: the column holding whole conversations (lists of messages), every assistant
    turn trained (the mask from the chat template), input_key / output_key unused; needs
    apply_chat_template (OpenRLHF's --data.multiturn, whose conversations are in --data.input_key)."""
    apply_chat_template: bool = True
    """Render prompt and response with the tokenizer's chat template; false: plain text + EOS."""
    max_len: PositiveInt = 2048
    """Longest sample in tokens; longer rows are dropped (counted in the start-up line)."""


class PairDataConfig(_DataSource):
    """Preference rows (`dataset`: as for sft)."""

    prompt_key: str | None = "prompt"
    """Column holding the prompt; None when chosen / rejected hold whole conversations."""
    chosen_key: str = "chosen"
    """Column holding the preferred response (text or messages)."""
    rejected_key: str = "rejected"
    """Column holding the other response."""
    apply_chat_template: bool = True
    """Render with the tokenizer's chat template; false: plain text + EOS."""
    max_len: PositiveInt = 2048
    """Longest side of a pair in tokens; longer pairs are dropped."""


class KTOLogConfig(LogConfig):
    output_dir: str = "runs/kto"
    """Run folder: metrics.jsonl, summary, plot, checkpoints, final model."""


class UnpairedDataConfig(_DataSource):
    """Labelled completions (`dataset`: as for sft)."""

    prompt_key: str | None = "prompt"
    """Column holding the prompt; None when completions hold whole conversations."""
    completion_key: str = "completion"
    """Column holding the completion (text or messages)."""
    label_key: str = "label"
    """Column holding the label: true / 1 desirable, false / 0 undesirable."""
    apply_chat_template: bool = True
    """Render with the tokenizer's chat template; false: plain text + EOS."""
    max_len: PositiveInt = 2048
    """Longest sample in tokens; longer rows are dropped."""


class RMDataConfig(PairDataConfig):
    margin_key: str | None = None
    """Column with a number per pair (how much better chosen is), used by `loss.use_margin`."""


class SFTLossSection(_Section):
    aggregation: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    """token-mean: NLL averaged over every response token of the step (OpenRLHF's SFT);
    seq-mean-token-mean: averaged per sequence first."""
    aux_loss_coef: NonNegative = 0.0
    """c of the MoE load-balancing loss of the trained model's routers (OpenRLHF's
    --model.aux_loss_coef): the loss gets + c·L_aux (rl_algos.load_balancing_loss), logged as
    <command>/aux_loss and <command>/loss_aux. 0: off. Needs an MoE model (Mixtral, Qwen2-MoE, ...)."""


class RMLossSection(_Section):
    use_margin: bool = False
    """Bradley-Terry with a margin: −log σ(r_w − r_l − m), m from `data.margin_key` (Llama 2)."""
    aux_loss_coef: NonNegative = 0.0
    """c of the MoE load-balancing loss of the trained model's routers (OpenRLHF's
    --model.aux_loss_coef): the loss gets + c·L_aux (rl_algos.load_balancing_loss), logged as
    <command>/aux_loss and <command>/loss_aux. 0: off. Needs an MoE model (Mixtral, Qwen2-MoE, ...)."""


class DPOLossSection(_Section):
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO (cDPO with label_smoothing > 0); ipo: IPO's squared loss towards 1/(2·beta)."""
    beta: Positive = 0.1
    """beta, the implicit reward scale (strength of the pull towards the reference model)."""
    label_smoothing: Annotated[float, Meta(ge=0, lt=0.5)] = 0.0
    """cDPO: assumed probability that a preference label is flipped; 0 is plain DPO (sigmoid only)."""
    aux_loss_coef: NonNegative = 0.0
    """c of the MoE load-balancing loss of the trained model's routers (OpenRLHF's
    --model.aux_loss_coef): the loss gets + c·L_aux (rl_algos.load_balancing_loss), logged as
    <command>/aux_loss and <command>/loss_aux. 0: off. Needs an MoE model (Mixtral, Qwen2-MoE, ...)."""

    def __post_init__(self) -> None:
        if self.loss_type == "ipo" and self.label_smoothing > 0:
            _fail("loss.label_smoothing", self.label_smoothing, "must be 0 with loss.loss_type ipo")


_DEFAULT_TRAIN = SupervisedTrainConfig()


class SupervisedRayConfig(_Section):
    """Where the trained model's ranks run (the fields of ppo's `ray` section that apply)."""

    learner: ResourceConfig = msgspec.field(default_factory=ResourceConfig)
    """The trained model's data-parallel ranks (OpenRLHF: --actor.num_nodes × --actor.num_gpus_per_node):
    one Ray actor each, with these GPUs and CPUs. One rank without ray.address trains in the
    driver process (no Ray); anything else runs a Ray actor group."""
    address: str | None = None
    """Ray cluster to join ("auto" or host:port); "local" starts a local Ray bound to 127.0.0.1
    (more ranks). Not given: RAY_ADDRESS when it is set (`ray job submit` sets it), said on
    stderr; else none."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = cuda when the cluster (or, in the driver, this machine) has GPUs, else cpu."""
    num_cpus: PositiveInt | None = None
    """Logical CPUs of a local Ray (None: enough for every rank)."""
    temp_dir: str | None = None
    """Session folder of a local Ray (None: Ray's default); refused with ray.address."""
    startup_timeout_s: Positive = 600.0
    """Seconds the ranks may take to start (model loading, rendezvous) before the run fails."""

    def __post_init__(self) -> None:
        check_joined_temp_dir(self.address, self.temp_dir)
        if self.learner.offload:
            _fail(
                "ray.learner.offload",
                True,
                "applies to frozen models only; for the trained model's optimizer states use train.adam_offload",
            )

    @property
    def in_driver(self) -> bool:
        """One local rank: trained in the driver process, without Ray."""
        return self.learner.num_actors == 1 and self.address is None


class KTOLossSection(_Section):
    beta: Positive = 0.1
    """beta, the implicit reward scale β·(log π − log π_ref) (OpenRLHF's default is 0.01)."""
    desirable_weight: Annotated[float, Meta(ge=0)] = 1.0
    """λ_D: weight of a desirable completion's loss (OpenRLHF's desirable_loss_weight)."""
    undesirable_weight: Annotated[float, Meta(ge=0)] = 1.0
    """λ_U: weight of an undesirable one (the KTO paper keeps λ_D·n_D / (λ_U·n_U) in [1, 4/3])."""


class _SupervisedRoot(_Section):
    preset: Literal["auto", "arithmetic", "none"] = "auto"
    """Built-in demo whose model, data and settings sit under yours: arithmetic ("What is n + 1?"
    on a tiny model built locally), or none. auto: arithmetic when neither model.pretrain nor
    data.dataset is given, else none."""
    preset_root: str | None = None
    """Cache folder of preset builds (None: ~/.cache/rl-launch/presets)."""
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    """The model to train (model.pretrain) and its precision; a dpo reference is a frozen copy."""
    train: SupervisedTrainConfig = msgspec.field(default_factory=SupervisedTrainConfig)
    """Optimisation: steps, batch size, learning rate, DeepSpeed."""
    ckpt: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    """Checkpoints, resume (--ckpt.load_checkpoint true) and the HF export to <log.output_dir>/final."""
    ray: SupervisedRayConfig = msgspec.field(default_factory=SupervisedRayConfig)
    """The trained model's ranks: in the driver (one) or a Ray actor group (several, or a cluster)."""

    def _check_common(self, command: str) -> None:
        if self.preset != "arithmetic":
            if self.model.pretrain is None:
                _fail("model.pretrain", None, "is required without a preset (or pass --preset arithmetic)")
            if self.data.dataset is None:  # type: ignore[attr-defined]
                _fail("data.dataset", None, "is required without a preset (or pass --preset arithmetic)")
        for field in ("critic_pretrain", "reward_pretrain"):
            if getattr(self.model, field) is not None:
                _fail(f"model.{field}", getattr(self.model, field), f"does not apply to rl-launch {command}")
        from ..backends import supervised_fsdp2_refusals, tensor_parallel_refusals

        for option, value, why in [*supervised_fsdp2_refusals(self), *tensor_parallel_refusals(self)]:
            _fail(option, value, why)
        sp, ranks = self.model.sequence_parallel_size, self.ray.learner.num_actors
        if ranks % sp:
            _fail(
                "model.sequence_parallel_size",
                sp,
                f"must divide ray.learner.num_actors ({ranks}): each group of {sp} ranks shares its "
                f"micro-batches (set --ray.learner.num_actors to a multiple of {sp})",
            )
        for field in (
            "max_epochs",
            "critic_learning_rate",
            "critic_optimizer",
            "critic_muon_learning_rate",
            "num_episodes",
            "ema_beta",
            "critic_warmup_steps",
        ):
            if getattr(self.train, field) != getattr(_DEFAULT_TRAIN, field):
                _fail(f"train.{field}", getattr(self.train, field), f"does not apply to rl-launch {command}")
        if self.ckpt.best_metric_key is not None:
            _fail("ckpt.best_metric_key", self.ckpt.best_metric_key, f"does not apply to rl-launch {command}")


class SFTConfig(_SupervisedRoot):
    """Everything `rl-launch sft` needs; sections are dotted on the command line."""

    data: SFTDataConfig = msgspec.field(default_factory=SFTDataConfig)
    """Demonstrations: prompt / response rows."""
    loss: SFTLossSection = msgspec.field(default_factory=SFTLossSection)
    """The NLL of the response tokens."""
    log: SFTLogConfig = msgspec.field(default_factory=SFTLogConfig)
    """Outputs: metrics, progress bar, TensorBoard, wandb."""

    def __post_init__(self) -> None:
        self._check_common("sft")
        if self.data.pretrain_mode and self.data.messages_key is not None:
            _fail("data.pretrain_mode", True, "trains plain text rows; leave data.messages_key unset")
        if self.data.messages_key is not None and not self.data.apply_chat_template:
            _fail(
                "data.messages_key",
                self.data.messages_key,
                "needs data.apply_chat_template true: the assistant turns are found through the chat template",
            )


class RMConfig(_SupervisedRoot):
    """Everything `rl-launch rm` needs; sections are dotted on the command line."""

    data: RMDataConfig = msgspec.field(default_factory=RMDataConfig)
    """Preference pairs: prompt, chosen and rejected responses."""
    loss: RMLossSection = msgspec.field(default_factory=RMLossSection)
    """The Bradley-Terry loss on the scores of chosen and rejected."""
    log: RMLogConfig = msgspec.field(default_factory=RMLogConfig)
    """Outputs: metrics, progress bar, TensorBoard, wandb."""

    def __post_init__(self) -> None:
        self._check_common("rm")
        if self.loss.use_margin and self.data.margin_key is None:
            _fail("loss.use_margin", True, "needs data.margin_key (the column holding each pair's margin)")


class DPOConfig(_SupervisedRoot):
    """Everything `rl-launch dpo` needs; sections are dotted on the command line."""

    data: PairDataConfig = msgspec.field(default_factory=PairDataConfig)
    """Preference pairs: prompt, chosen and rejected responses."""
    loss: DPOLossSection = msgspec.field(default_factory=DPOLossSection)
    """DPO / cDPO / IPO against a frozen copy of the starting model."""
    log: DPOLogConfig = msgspec.field(default_factory=DPOLogConfig)
    """Outputs: metrics, progress bar, TensorBoard, wandb."""

    def __post_init__(self) -> None:
        self._check_common("dpo")


class KTOConfig(_SupervisedRoot):
    """Everything `rl-launch kto` needs; sections are dotted on the command line."""

    data: UnpairedDataConfig = msgspec.field(default_factory=UnpairedDataConfig)
    """Completions labelled desirable or undesirable: prompt, completion, label."""
    loss: KTOLossSection = msgspec.field(default_factory=KTOLossSection)
    """KTO against a frozen copy of the starting model."""
    log: KTOLogConfig = msgspec.field(default_factory=KTOLogConfig)
    """Outputs: metrics, progress bar, TensorBoard, wandb."""

    def __post_init__(self) -> None:
        self._check_common("kto")


COMMANDS: dict[str, type] = {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig, "kto": KTOConfig}
"""Command name -> its root config struct."""
