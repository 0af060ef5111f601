"""rl_learner: DeepSpeed learners for RL post-training, the sending side of weight sync, checkpoints.

- Models from HF checkpoints: policy and reference (`load_causal_lm`), critic and reward model
  (`load_value_model`: a causal-LM backbone with a scalar `score` head that also loads as
  `AutoModelForSequenceClassification`); LoRA through peft (`apply_lora`).
- `PolicyLearner` / `ValueLearner`: forward passes over packed `rl_data.ExperienceBatch`
  micro-batches (log-probs, entropy, values, scores) and train steps that use `rl_algos` only.
  Every loss is normalised by the global count of the whole optimizer step (all micro-batches,
  all ranks), so the update does not depend on how the batch is split. Non-finite values never
  reach the weights.
- Sequence parallelism (`rl_learner.sequence_parallel`, `DeepSpeedConfig.sequence_parallel_size`):
  Ulysses all-to-alls let a group of ranks share each packed micro-batch along its tokens.
- Weight sync, sender side (`rl_learner.sync`): bucketed broadcast, CUDA IPC, shared memory or
  files, through `rl_data.sync`, one sender per transport (`rl_learner.senders`, found by name in
  `SENDERS`); ZeRO-3 gathered per bucket, LoRA merged on the fly, cast to the engine's dtype.
  A LoRA policy may send its adapter only (`rl_learner.adapter_sync`: `adapter_layout`,
  `lora_adapter`, a spec with `adapter` set).
- Supervised learners (`rl_learner.supervised`): `SFTLearner`, `RewardModelLearner`,
  `DPOLearner` (sigmoid DPO, cDPO, IPO) and `KTOLearner` on `pack_sequences` / `pack_pairs` /
  `pack_unpaired` micro-batches.
- Checkpoints (`rl_learner.checkpoint`): atomic, rotated, verified on resume; HF export.
- `WeightEMA` (`rl_learner.ema`): an exponential moving average of the trained weights on the host,
  saved in checkpoints and exported like the model.

`import rl_learner` stays light: DeepSpeed, transformers and peft load where they are used.
"""

from .__about__ import __version__
from .adapter_sync import adapter_layout, lora_adapter
from .checkpoint import (
    CheckpointError,
    TrainingState,
    export_hf,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_checkpoint_tensors,
    save_checkpoint,
)
from .config import DeepSpeedConfig, OptimizerConfig, build_optimizer, build_scheduler, deepspeed_config
from .ema import WeightEMA, ema_update
from .learner import Learner, NonFiniteError, PolicyLearner, PolicyLossConfig, ValueLearner, ValueLossConfig
from .lora import LoraOptions, apply_lora
from .models import load_causal_lm, load_value_model, packed_logprobs, packed_scores, packed_values
from .sender_base import SENDERS, WeightSender
from .senders import BroadcastSender, FileSender, IpcSender, ShmSender
from .supervised import (
    DPOLearner,
    DPOLossConfig,
    KTOLearner,
    KTOLossConfig,
    RewardModelLearner,
    SFTLearner,
    group_by_tokens,
    pack_pairs,
    pack_sequences,
    pack_unpaired,
    sequence_logprobs,
)
from .sync import make_sender, sync_layout

__all__ = [
    "SENDERS",
    "BroadcastSender",
    "CheckpointError",
    "DPOLearner",
    "DPOLossConfig",
    "DeepSpeedConfig",
    "FileSender",
    "IpcSender",
    "KTOLearner",
    "KTOLossConfig",
    "Learner",
    "LoraOptions",
    "NonFiniteError",
    "OptimizerConfig",
    "PolicyLearner",
    "PolicyLossConfig",
    "RewardModelLearner",
    "SFTLearner",
    "ShmSender",
    "TrainingState",
    "ValueLearner",
    "ValueLossConfig",
    "WeightEMA",
    "WeightSender",
    "__version__",
    "adapter_layout",
    "apply_lora",
    "build_optimizer",
    "build_scheduler",
    "deepspeed_config",
    "ema_update",
    "export_hf",
    "group_by_tokens",
    "latest_checkpoint",
    "list_checkpoints",
    "load_causal_lm",
    "load_checkpoint",
    "load_checkpoint_tensors",
    "load_value_model",
    "lora_adapter",
    "make_sender",
    "pack_pairs",
    "pack_sequences",
    "pack_unpaired",
    "packed_logprobs",
    "packed_scores",
    "packed_values",
    "save_checkpoint",
    "sequence_logprobs",
    "sync_layout",
]
