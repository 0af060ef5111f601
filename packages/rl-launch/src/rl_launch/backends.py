"""Which learner backend a run trains on (`train.backend`), and what the FSDP2 backend refuses.

"deepspeed" (default) builds every learner as a DeepSpeed engine; "fsdp2" shards every learner
(policy, reference, teacher, critic, reward model; the trained models of rl-launch sft / rm /
dpo / kto and their references) with torch's `fully_shard` (`rl_learner.fsdp2`). What the FSDP2
backend does not do yet is refused here, in the validation pass (`rl_launch.validation.prepare`
for ppo, `supervised_fsdp2_refusals` from the supervised configs' check), before anything
starts, naming the option that asks for it:

| option                                              | why                                          |
| ---                                                 | ---                                          |
| model.dtype fp16                                    | fp16 needs a loss scaler (bf16, fp32 work)   |
| train.actor_optimizer / critic_optimizer muon       | DeepSpeed's Muon                             |
| train.deepspeed_config (non-empty)                  | DeepSpeed's keys; FSDP2 would ignore them    |
| train.ema_beta                                      | the EMA reads a DeepSpeed engine's parameters |
| ray.colocate all with ray.learner_offload true      | no hybrid-engine state offload yet           |

model.sequence_parallel_size > 1 is taken: the learners' Ulysses sequence parallelism
(`rl_learner.sequence_parallel`) is in the packed forwards, not in the engine, and FSDP2 shards
over every rank of the learner (its SP groups and their data-parallel copies) and averages the
gradients over them, as DeepSpeed does; with train.tensor_parallel_size > 1 it is refused (below).

model.lora_rank > 0 is taken: the LoRA (peft) models the DeepSpeed learners train (`rl_learner.apply_lora`)
are sharded by `fully_shard` (base weights and adapters in the same decoder-layer units, AdamW over
the adapters), sync to the engines merged or adapter-only (model.lora_sync) from the shards, and
export the merged model (`rl_learner.fsdp2`); with train.tensor_parallel_size > 1 it is refused
(below).

train.zero_stage is not used by FSDP2 (it shards as ZeRO-3 does), said on the start-up line
(`zero_stage_note`).

train.adam_offload is taken: FSDP2's `CPUOffloadPolicy` keeps the trained models' sharded
parameters, gradients and AdamW state in host memory (FSDP2 has no optimizer-only offload;
`rl_learner.fsdp2`); so are ray.ref/teacher/reward_model.offload, the frozen models' parameters
in host memory on GPUs at any train.zero_stage (a no-op on CPU, said on the start-up line:
`rl_launch.learner_settings.frozen_offload`).

train.tensor_parallel_size tp > 1 (`tensor_parallel_refusals`, both backends) is refused:
- under train.backend deepspeed: its learners are data-parallel only (DeepSpeed's AutoTP
  trains a step on gloo here, with ZeRO-1, but is not wired into the learners: their weight sync,
  checkpoints and HF export would need its split layers gathered);
- with train.adam_offload (CPU offload of 2-D mesh parameters is not verified);
- with model.sequence_parallel_size > 1 (a 3-D mesh of data, sequence and tensor parallelism is
  not built);
- with model.lora_rank > 0 (torch's DTensor TP plans split nn.Linear modules only, and peft wraps
  each adapted linear layer in its own module: choose LoRA with FSDP2 data parallelism, or
  tensor parallelism without LoRA);
- where a learner role's ray.<role>.num_actors is not a multiple of tp (ppo: the policy, critic,
  reference, teacher and reward model the run starts; sft / rm / dpo / kto: ray.learner);
- where a model's config.json (model.pretrain and the critic / reward / teacher models, read when
  the option names a local folder) is not a Qwen2 / Llama model or its head counts or MLP width do
  not divide by tp (the message names the field); a model that is built later (a preset's, a hub
  id) is checked the same way when its learner builds it.

rl-launch sft / rm / dpo / kto refuse the same model.* and train.* options (fp16, Muon,
train.deepspeed_config) and take LoRA and sequence parallelism the same way; they have no reference /
teacher offload, EMA or hybrid engine to refuse.
"""

from __future__ import annotations

from typing import Any

__all__ = ["fsdp2_refusals", "supervised_fsdp2_refusals", "tensor_parallel_refusals", "zero_stage_note"]


def fsdp2_refusals(config: Any) -> list[tuple[str, Any, str]]:
    """[(option, value, why)] for what a `PPOConfig` asks of the FSDP2 backend that it does not do
    yet; empty when train.backend is not fsdp2 or nothing is refused."""
    if config.train.backend != "fsdp2":
        return []
    from .components.estimators import estimator_needs

    train, ray = config.train, config.ray
    asked = [
        *_shared(config),
        (
            "train.critic_optimizer",
            train.critic_optimizer,
            estimator_needs(config.algo.advantage.estimator).critic and train.critic_optimizer != "adamw",
            "is DeepSpeed's",
        ),
        ("train.ema_beta", train.ema_beta, train.ema_beta is not None, "the EMA is not wired in yet"),
        (
            "ray.learner_offload",
            True,
            ray.colocate == "all" and ray.learner_offload,
            "with ray.colocate all: the FSDP2 learners have no hybrid-engine state offload yet "
            "(set ray.learner_offload false)",
        ),
    ]
    return _refused(asked)


def supervised_fsdp2_refusals(config: Any) -> list[tuple[str, Any, str]]:
    """[(option, value, why)] for what an rl-launch sft / rm / dpo / kto config asks of the FSDP2
    backend that it does not do yet (the options it shares with ppo; the supervised commands
    have no reference / teacher offload, EMA or hybrid engine)."""
    if config.train.backend != "fsdp2":
        return []
    return _refused(_shared(config))


def zero_stage_note(config: Any) -> str | None:
    """The start-up note of an FSDP2 run (None under DeepSpeed): train.zero_stage is not used, as
    FSDP2 shards every learner's parameters, gradients and optimizer states over its data-parallel
    ranks, ZeRO-3's layout. Said on every FSDP2 run: a default stage cannot be told from a chosen
    one (ppo's default is 2, the supervised commands' presets set 0)."""
    if config.train.backend != "fsdp2":
        return None
    return (
        f"train.zero_stage {config.train.zero_stage}: not used by train.backend fsdp2, which shards "
        "parameters, gradients and optimizer states over the data-parallel ranks (ZeRO-3's layout)"
    )


def _refused(asked: list[tuple[str, Any, bool, str]]) -> list[tuple[str, Any, str]]:
    return [
        (option, value, f"{why} (train.backend fsdp2; use train.backend deepspeed)")
        for option, value, refused, why in asked
        if refused
    ]


def _shared(config: Any) -> list[tuple[str, Any, bool, str]]:
    """(option, value, refused, why) of the model and train options every command shares."""
    model, train = config.model, config.train
    return [
        ("model.dtype", model.dtype, model.dtype == "fp16", "fp16 needs a loss scaler; use bf16 or fp32"),
        ("train.actor_optimizer", train.actor_optimizer, train.actor_optimizer != "adamw", "is DeepSpeed's"),
        (
            "train.deepspeed_config",
            dict(train.deepspeed_config),
            bool(train.deepspeed_config),
            "holds DeepSpeed config keys, which the FSDP2 learners do not read",
        ),
    ]


def tensor_parallel_refusals(config: Any, roles: dict[str, bool] | None = None) -> list[tuple[str, Any, str]]:
    """[(option, value, why)] for what stands in the way of train.tensor_parallel_size (module
    docstring), for any command's config; empty when it is 1 or nothing does.

    `roles`: {ray section: whether the run starts that learner}; None for the supervised commands'
    one learner (ray.learner)."""
    train, tp = config.train, config.train.tensor_parallel_size
    if tp == 1:
        return []
    option = "train.tensor_parallel_size"
    if train.backend != "fsdp2":
        why = (
            f"needs train.backend fsdp2 (DTensor tensor parallelism); the {train.backend} learners are "
            "data-parallel only (DeepSpeed's AutoTP is not wired into them: weight sync, checkpoints and HF "
            "export would need its split layers gathered); add --train.backend fsdp2"
        )
        return [(option, tp, why)]
    sp, lora = getattr(config.model, "sequence_parallel_size", 1), getattr(config.model, "lora_rank", 0)
    along = [  # (option, value, refused, why) of what does not combine with tensor parallelism
        (
            "train.adam_offload",
            True,
            train.adam_offload,
            "CPU offload of tensor-parallel parameters is not verified yet (set train.adam_offload false)",
        ),
        (
            "model.sequence_parallel_size",
            sp,
            sp > 1,
            "sequence and tensor parallelism together (a 3-D mesh) are not built; choose one of them",
        ),
        (
            "model.lora_rank",
            lora,
            lora > 0,
            "torch's DTensor tensor-parallel plans split nn.Linear modules only, and peft wraps every "
            f"adapted linear layer in its own lora.Linear; use LoRA with FSDP2 data parallelism ({option} 1) "
            "or tensor parallelism without LoRA (model.lora_rank 0)",
        ),
    ]
    found = [(name, value, f"with {option} {tp}: {why}") for name, value, refused, why in along if refused]
    for role in [role for role, started in (roles or {"learner": True}).items() if started]:
        actors = getattr(config.ray, role).num_actors
        if actors % tp:
            found.append(
                (
                    f"ray.{role}.num_actors",
                    actors,
                    f"must be a multiple of {option} {tp}: the ranks "
                    "of a learner form tensor-parallel groups of that many",
                )
            )
    for field in ("pretrain", "critic_pretrain", "reward_pretrain", "teacher_pretrain"):
        reasons = _model_refusals(getattr(config.model, field, None), tp)
        if reasons:
            found.append(
                (
                    f"model.{field}",
                    getattr(config.model, field),
                    f"cannot be split by {option} {tp}: {'; '.join(reasons)}",
                )
            )
    return found


def _model_refusals(path: str | None, tp: int) -> list[str]:
    """`rl_learner.tensor_parallel_refusals` of the model at `path` when it is a local folder with a
    config.json; [] otherwise (the learner checks it when it builds the model)."""
    import json
    import pathlib

    config = pathlib.Path(path) / "config.json" if path else None
    if config is None or not config.is_file():
        return []
    from rl_learner.tensor_parallel import tensor_parallel_refusals as model_refusals

    try:
        return model_refusals(json.loads(config.read_text()), tp)
    except (OSError, ValueError) as error:
        return [f"its {config} cannot be read ({error})"]
