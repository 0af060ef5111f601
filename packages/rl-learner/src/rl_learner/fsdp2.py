"""The FSDP2 learner backend: torch's `fully_shard` behind the engine interface the learners drive.

`DeepSpeedConfig.backend = "fsdp2"` makes a `Learner` (policy, reference, critic, reward model;
the supervised `SFTLearner`, `DPOLearner`, `KTOLearner`, `RewardModelLearner`) shard its model
with `torch.distributed.fsdp.fully_shard` instead of wrapping it in a DeepSpeed engine. `Fsdp2Engine`
offers what `rl_learner.learner`, `rl_learner.sync` and `rl_learner.checkpoint` call on a
DeepSpeed engine (`module`, forward, `backward`, `step`, `was_step_applied`,
`get_global_grad_norm`, `save_checkpoint`, `load_checkpoint`, ...), so the train step, its
global normaliser and its non-finite handling are the same code for both backends.

Sharding. Every module whose class is in the HF model's `_no_split_modules` (its decoder layers)
is a `fully_shard` unit, then the root; parameters become DTensors sharded over a 1-D mesh of
the learner's ranks (dim 0 split evenly, the last shards padded). Parameters outside the decoder
layers (embeddings, final norm, LM head, a value model's scalar `score` head [1, hidden]) belong
to the root unit and are sharded the same way: the score head's one row sits on rank 0, the
other ranks hold empty shards; it is all-gathered with the root's parameters for each forward,
so `packed_values` / `packed_scores` read its full output through their forward hook. Gradients
are reduce-scattered and averaged over the ranks, as DeepSpeed's are, so the learner's
`backward(world_size · L_j)` rule holds unchanged.

Precision (`DeepSpeedConfig.dtype`):
- "bf16": fp32 sharded parameters (the optimizer's master weights) and a
  `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`: forward and backward in
  bf16 on all-gathered bf16 copies, gradients reduced in fp32;
- "fp32": no policy;
- "fp16": refused (it needs a loss scaler, which this backend does not have).

One optimizer step: gradients accumulate over the micro-batches; the global 2-norm g of the
sharded gradients is computed (`torch.nn.utils.get_total_norm`, a collective over the mesh); a
non-finite g drops the update (gradients cleared, LR schedule not stepped, `was_step_applied()`
False, as DeepSpeed's overflow path); else gradients are scaled by min(1, grad_clip / g) when
grad_clip > 0, AdamW steps and the schedule advances.

Checkpoints: `save_checkpoint(folder, tag)` writes `folder/tag/dcp/` with
`torch.distributed.checkpoint` (model and optimizer state dicts of the sharded model, each rank
its shards) and `folder/tag/scheduler.json`; the files go into `rl_learner.checkpoint`'s
manifest like DeepSpeed's. Loading reads them back into the live sharded model at any world size:
torch.distributed.checkpoint reshards the model and AdamW state (a checkpoint of 2 ranks resumes
on 1 and the reverse with the same next step, tests/learner/test_fsdp2.py), which is why
`zero_optimization_stage()` says 0 and the manifest's world-size check does not apply.

CPU offload (`ds.offload_optimizer` or `ds.offload_params`): FSDP2's `CPUOffloadPolicy` on every
unit, which offloads the sharded parameters, their gradients and the optimizer state together
(FSDP2 has no optimizer-only offload): they live in host memory (pinned on CUDA), each unit's
parameters are all-gathered onto the device for its forward and backward, gradients come back
to host memory and AdamW steps on the CPU. `cpu_offload` says whether it is on.

LoRA: a peft model (`rl_learner.apply_lora`, as the DeepSpeed learners get it) is sharded the
same way: its decoder layers, found through the peft wrapper, are the units, then the root (the
`PeftModel`); each layer's frozen base weights and trainable adapter factors (lora_A [r, in],
lora_B [out, r]) are sharded together in one unit (FSDP2 takes mixed requires_grad), and AdamW
holds the trainable parameters only (the adapters, and a value model's `score` head). Precision
and offload as above. Weight sync and HF export gather from the shards one tensor at a time
(`rl_learner.dtensor`): merged sync and `export_hf` compute W + scaling·B·A on one LoRA layer's
gathered parameters, adapter-only sync (`rl_learner.adapter_sync`) gathers each factor; both give
the unsharded peft model's checksums. Checkpoints hold the peft model's state dict (base weights
and adapters under peft's names) and AdamW's state of the adapters. LoRA with tensor parallelism
is refused (`lora_tensor_parallel_refusal`): torch's DTensor plans split nn.Linear modules only,
and peft wraps each adapted linear.

Sequence parallelism (`DeepSpeedConfig.sequence_parallel_size` = sp > 1) needs nothing of the
engine: the learner's Ulysses groups (`rl_learner.sequence_parallel`) split each packed row's
tokens in the forwards, and the 1-D mesh over every rank (the SP groups and their data-parallel
copies) averages the gradients over all of them, which the learner's backward factor (the world
size) turns back into the sum, as under DeepSpeed; SP = 2 on two ranks takes one rank's step
(tests/learner/test_fsdp2.py).

Not in this backend yet, refused by `fsdp2_refusals` (and by `Fsdp2Engine` when built anyway):
Muon, fp16, the hybrid engine's state offload (`Learner.offload_plan` says "none"), CPU offload
with tensor parallelism, LoRA with tensor parallelism, sequence with tensor parallelism.

Tensor parallelism (`DeepSpeedConfig.tensor_parallel_size` = tp > 1, `rl_learner.tensor_parallel`):
the ranks form a dp × tp mesh; each decoder layer is split over its TP group with DTensor
column / row plans before `fully_shard` shards every parameter over dp. `mesh` is the dp mesh,
`dp_world_size` = world / tp, `tensor_parallel` this rank's TP group (None without TP); the
gradient norm is summed over the two meshes the parameters live on.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .config import DeepSpeedConfig, OptimizerConfig, build_scheduler
from .tensor_parallel import TensorParallelGroup, apply_tensor_parallel

__all__ = ["Fsdp2Engine", "fsdp2_refusals", "lora_tensor_parallel_refusal"]


def fsdp2_refusals(ds: DeepSpeedConfig, optimizer: OptimizerConfig | None = None) -> list[tuple[str, str]]:
    """What the FSDP2 backend does not do yet among `ds` and `optimizer`'s settings:
    [(field, why)], empty when it can run them (or when `ds.backend` is not "fsdp2")."""
    if ds.backend != "fsdp2":
        return []
    found = []
    if ds.dtype == "fp16":
        found.append(("dtype", "fp16 needs a loss scaler; use bf16 or fp32"))
    if ds.sequence_parallel_size != 1 and ds.tensor_parallel_size != 1:
        found.append(
            (
                "sequence_parallel_size",
                "sequence and tensor parallelism together (a 3-D mesh) are not built; choose one of them",
            )
        )
    if optimizer is not None and optimizer.name != "adamw":
        found.append(("optimizer.name", f"{optimizer.name!r} is DeepSpeed's; FSDP2 trains with AdamW"))
    if ds.tensor_parallel_size > 1 and (ds.offload_optimizer or ds.offload_params):
        found.append(
            (
                "tensor_parallel_size",
                "CPU offload of tensor-parallel (2-D mesh) parameters is not verified yet",
            )
        )
    return found


def _grads_by_mesh(model: torch.nn.Module) -> dict[Any, list[torch.nn.Parameter]]:
    """The parameters with a gradient, grouped by their DTensor mesh (None: plain tensors), in the
    model's order (the same on every rank). With tensor parallelism the split matrices live on the
    dp × tp mesh and the others on the dp mesh; torch's norms and clipping take one mesh at a time."""
    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for param in model.parameters():
        if param.grad is not None:
            groups.setdefault(getattr(param, "device_mesh", None), []).append(param)
    return groups


def _global_norm(by_mesh: dict[Any, list[torch.nn.Parameter]]) -> float:
    """‖g‖₂ over every gradient: √Σ_meshes ‖g_mesh‖₂² (each a collective over its mesh)."""
    total = 0.0
    for params in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        total += float(norm) ** 2
    return math.sqrt(total)


def _is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def lora_tensor_parallel_refusal(tp: int) -> str:
    """Why a LoRA (peft) model does not take tensor parallelism (tp > 1) on this backend."""
    return (
        f"DeepSpeedConfig.tensor_parallel_size {tp} with a LoRA (peft) model: torch's DTensor tensor-"
        "parallel plans (ColwiseParallel / RowwiseParallel) split nn.Linear modules only, and peft wraps "
        "every adapted linear layer in its own lora.Linear; use tensor_parallel_size 1 (LoRA with FSDP2 "
        "data parallelism) or no LoRA (lora rank 0)"
    )


class Fsdp2Engine:
    """A model sharded with `fully_shard`, its AdamW and LR schedule (module docstring).

    Args:
      model: an HF model, or a peft LoRA model around one (`rl_learner.apply_lora`; module docstring).
      ds: dtype and checks (`ds.backend` must be "fsdp2").
      optimizer: AdamW options; None for an inference-only model (parameters frozen).
      total_steps: optimizer steps of the run (LR schedule).
      device: this rank's device (cpu or cuda:N).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        ds: DeepSpeedConfig,
        optimizer: OptimizerConfig | None,
        *,
        total_steps: int,
        device: torch.device,
    ) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        refused = fsdp2_refusals(ds, optimizer)
        if refused:
            field, why = refused[0]
            raise ValueError(f"DeepSpeedConfig.{field} with backend 'fsdp2': {why}")
        if _is_lora(model) and ds.tensor_parallel_size > 1:
            raise ValueError(lora_tensor_parallel_refusal(ds.tensor_parallel_size))
        self.ds, self.optim, self.device = ds, optimizer, device
        world, tp = dist.get_world_size(), ds.tensor_parallel_size
        if world % tp:
            raise ValueError(
                f"DeepSpeedConfig.tensor_parallel_size: {tp} does not divide the world size {world}; the "
                "ranks of a learner must form whole tensor-parallel groups (ranks = dp × tp)"
            )
        self.dp_world_size = world // tp
        self.tensor_parallel: TensorParallelGroup | None = None
        if tp == 1:
            self.mesh = init_device_mesh(device.type, (world,))
        else:  # a dp × tp mesh: TP groups are consecutive ranks (rl_learner.tensor_parallel)
            grid = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
            self.mesh = grid["dp"]
            self.tensor_parallel = TensorParallelGroup(
                grid["tp"].get_group(), tp, grid["tp"].get_local_rank()
            )
        if optimizer is None:
            model.requires_grad_(False)
        elif any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
            model.to(torch.float32)  # fp32 master weights; bf16 runs through the policy below
        model.to(device)
        if self.tensor_parallel is not None:
            apply_tensor_parallel(model, grid["tp"])
        policy = MixedPrecisionPolicy()
        if ds.dtype == "bf16":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self.cpu_offload = ds.offload_optimizer or ds.offload_params
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if self.cpu_offload else OffloadPolicy()
        # a peft model's decoder layers: its base model names them (LoRA layers shard with them)
        base = model.get_base_model() if _is_lora(model) else model
        units = set(getattr(base, "_no_split_modules", None) or ())
        for module in list(model.modules())[1:]:
            if type(module).__name__ in units:
                fully_shard(module, mesh=self.mesh, mp_policy=policy, offload_policy=offload)
        fully_shard(model, mesh=self.mesh, mp_policy=policy, offload_policy=offload)
        self.module = model
        self.optimizer = None
        self.lr_scheduler = None
        if optimizer is not None:
            trainable = [p for p in model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(
                trainable,
                lr=optimizer.lr,
                betas=tuple(optimizer.betas),
                eps=optimizer.eps,
                weight_decay=optimizer.weight_decay,
            )
            self.lr_scheduler = build_scheduler(self.optimizer, optimizer, total_steps)
        self._applied = True
        self._grad_norm: float | None = None

    # --- what the learners call on a DeepSpeed engine ------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def training(self) -> bool:
        return self.module.training

    def train(self, mode: bool = True) -> Fsdp2Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Fsdp2Engine:
        return self.train(False)

    def set_gradient_accumulation_boundary(self, boundary: bool) -> None:
        """Gradients are reduce-scattered after every micro-batch and accumulate sharded."""

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = False) -> None:
        loss.backward()

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        """Clip and apply the accumulated gradients, or drop them when their norm is not finite."""
        by_mesh = _grads_by_mesh(self.module)
        self._grad_norm = _global_norm(by_mesh)
        self._applied = math.isfinite(self._grad_norm)
        if self._applied:
            if self.optim.grad_clip > 0:
                norm = torch.tensor(self._grad_norm)
                for params in by_mesh.values():
                    torch.nn.utils.clip_grads_with_norm_(params, self.optim.grad_clip, norm)
            self.optimizer.step()
            self.lr_scheduler.step()
        self.zero_grad()

    def was_step_applied(self) -> bool:
        return self._applied

    def get_global_grad_norm(self) -> float | None:
        return self._grad_norm

    # --- checkpoints (rl_learner.checkpoint) -----------------------------------------------------

    def zero_optimization_stage(self) -> int:
        """0 for `rl_learner.checkpoint`'s manifest: unlike a ZeRO 1-3 engine, no data-parallel
        size is baked into the files (torch.distributed.checkpoint reshards on load)."""
        return 0

    def _state(self, optimizer: bool) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state = {"model": get_model_state_dict(self.module)}
        if optimizer and self.optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.module, self.optimizer)
        return state

    def save_checkpoint(
        self, save_dir: str, tag: str, client_state: Any = None, save_latest: bool = False
    ) -> bool:
        import torch.distributed.checkpoint as dcp

        folder = Path(save_dir) / tag
        dcp.save(self._state(optimizer=True), checkpoint_id=str(folder / "dcp"))
        if dist.get_rank() == 0 and self.lr_scheduler is not None:
            (folder / "scheduler.json").write_text(json.dumps(self.lr_scheduler.state_dict()))
        return True

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict[str, Any]]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        folder = Path(load_dir) / tag
        if not (folder / "dcp" / ".metadata").is_file():
            return None, {}
        with_optimizer = load_optimizer_states and not load_module_only and self.optimizer is not None
        state = self._state(optimizer=with_optimizer)
        dcp.load(state, checkpoint_id=str(folder / "dcp"))
        set_model_state_dict(self.module, state["model"])
        if with_optimizer:
            set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])
        scheduler = folder / "scheduler.json"
        with_scheduler = load_lr_scheduler_states and not load_module_only and self.lr_scheduler is not None
        if with_scheduler and scheduler.is_file():
            self.lr_scheduler.load_state_dict(json.loads(scheduler.read_text()))
        return os.fspath(folder), {}
