"""Serving a LoRA policy's adapter on an engine's base weights: the receiving side of adapter sync.

With `WeightSyncSpec.adapter` set (`rl_data.adapters`), a sync carries the policy's LoRA factors
only, under peft's saved names. An engine keeps its base weights as loaded and serves the
adapter of the latest version:

- `HFEngine` injects the adapter's LoRA layers into its transformers model once
  (`inject_lora`: peft's `inject_adapter_in_model`, B = 0 so version 0 is the base model, as the
  learner's freshly initialised adapter is) and copies each received factor into them;
- `VLLMEngine`'s workers write each version as a peft folder (`rl_data.adapters.write_peft_adapter`),
  which the engine serves as a new `vllm.lora.request.LoRARequest` (`AdapterVersions`: one LoRA
  id per version, the previous one released once no request in flight uses it).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from rl_data.adapters import LoraAdapter, adapter_module

__all__ = ["ENGINE_ADAPTER", "AdapterVersions", "inject_lora"]

ENGINE_ADAPTER = "rl_policy"
"""The adapter name `inject_lora` gives the policy's adapter in an engine's model."""


def inject_lora(
    model: torch.nn.Module, adapter: LoraAdapter, names: list[str], *, where: str
) -> dict[str, torch.Tensor]:
    """Inject `adapter`'s LoRA layers into `model` in place (the model keeps its class and its
    forward; peft's `inject_adapter_in_model`), frozen and in eval mode; {wire name: the live
    factor it is copied into} for the wire names `names`.

    Raises ImportError naming the extra when peft is missing, ValueError naming a wire name that
    has no factor in the injected model.
    """
    try:
        import peft
    except ImportError as error:
        raise ImportError(
            f"{where}: serving a LoRA adapter (adapter sync) needs peft: pip install 'rl-rollout[peft]'"
        ) from error
    config = peft.LoraConfig.from_peft_type(**adapter.peft_config)
    config.inference_mode = True
    peft.inject_adapter_in_model(config, model, adapter_name=ENGINE_ADAPTER)
    model.eval()
    model.requires_grad_(False)
    live = dict(model.named_parameters())
    targets: dict[str, torch.Tensor] = {}
    for name in names:
        module, factor = adapter_module(name)
        target = live.get(f"{module}.{factor}.{ENGINE_ADAPTER}.weight")
        if target is None:
            raise ValueError(
                f"{where}: adapter tensor {name!r} has no LoRA factor in the engine's model after injecting "
                f"target_modules {adapter.peft_config.get('target_modules')!r}"
            )
        targets[name] = target
    return targets


class AdapterVersions:
    """The adapter versions an engine serves as vLLM `LoRARequest`s, each a peft folder of its own.

    `folder(version)` is where that version's peft folder is written, `request(version)` its
    request (LoRA id version + 1: vLLM's ids start at 1, version 0 is the base model, served
    without a request);
    `stale(in_use)` lists the ids to remove from vLLM (every version but the current one that no
    request in flight uses), `forget(id)` removes a version's folder once vLLM dropped it.
    """

    def __init__(self, adapter: LoraAdapter, *, root: str | None = None) -> None:
        self.adapter = adapter
        self.root = Path(tempfile.mkdtemp(prefix="rl-lora-", dir=root))
        self.current: Any = None  # the LoRARequest new requests use; None: the base model
        self._served: dict[int, Path] = {}

    @staticmethod
    def lora_id(version: int) -> int:
        return int(version) + 1

    @staticmethod
    def version_of(lora_request: Any) -> int:
        """The policy version a request's `LoRARequest` (None: the base model, version 0) serves."""
        return 0 if lora_request is None else int(lora_request.lora_int_id) - 1

    def folder(self, version: int) -> Path:
        """Where version `version`'s peft folder goes (`rl_data.adapters.write_peft_adapter`)."""
        return self.root / f"v{int(version)}"

    def request(self, version: int) -> Any:
        """The `LoRARequest` of version `version`, whose folder is written; remembered as served."""
        from vllm.lora.request import LoRARequest

        folder = self.folder(version)
        self._served[self.lora_id(version)] = folder
        return LoRARequest(
            lora_name=f"policy-v{int(version)}", lora_int_id=self.lora_id(version), lora_path=str(folder)
        )

    @property
    def superseded(self) -> bool:
        """Whether a version other than the current one is still served (`stale` may find one)."""
        return len(self._served) > (0 if self.current is None else 1)

    def stale(self, in_use: set[int]) -> list[int]:
        """LoRA ids served before the current one that no request in flight uses."""
        current = None if self.current is None else self.current.lora_int_id
        return [lora_id for lora_id in self._served if lora_id != current and lora_id not in in_use]

    def forget(self, lora_id: int) -> None:
        folder = self._served.pop(lora_id, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def close(self) -> None:
        self._served.clear()
        shutil.rmtree(self.root, ignore_errors=True)
