"""`HFEngine`: the simple fallback engine, a `transformers` causal LM decoded batch by batch.

No server, no paged KV cache: every request becomes `n` rows, rows are grouped into batches of
at most `max_batch_size` (shortest prompts together), and each batch is decoded by a plain loop
over the model's forward pass with its KV cache. Prompts are LEFT-padded; the attention mask
hides the pads and the position ids count real tokens only, so a row's logits do not depend on
how much padding its batch needs (up to floating-point summation order).

    engine = HFEngine("/path/to/checkpoint", dtype="float32", max_batch_size=32)
    engine.generate([[1, 2, 3]], SamplingParams(n=4, temperature=1.0, max_new_tokens=64))

Per token t of a row (logits z_t `[V]`, temperature T, T = 1 when greedy):

    logprob_t = log softmax(z_t / T)[token_t]                 (before top-k / top-p, no min-tokens mask)
    token_t   = argmax z_t                                    (greedy)
              ~ softmax(top_p(top_k(z_t / T)))                (sampling, the row's own torch.Generator)

Why a hand-written loop instead of `model.generate`: each row samples from its own
`torch.Generator`, seeded with `prompt_seed(seed, prompt) + j` for sample j of a request with a
seed (the prompt mixed in, as every engine does) and from the engine's generator otherwise. A
row's draws therefore do not depend on the other rows of its batch; only floating-point
differences in the logits (batch shape, padding) could change a draw, which needs a uniform to
fall within ~1e-7 of a bucket edge.

A row ends with "stop" on EOS (unless `ignore_eos`), on a `stop_token_ids` token (both kept as
the last token) or when a stop string appears in its incrementally decoded text (the response
is cut after the token that completes the match); with "length" at `max_new_tokens` or when
prompt + response fills `max_model_len`. Rows that end leave the batch (their KV cache rows are
dropped), so no token after a row's end is ever produced for it.

Vision-language models (`rl_data.vision.is_vision_model`: the Qwen2-VL family, loaded with
`AutoModelForImageTextToText`; `supports("images")`): `generate(prompts, params, images)` takes one
`rl_data.ImageInputs` (or None) per prompt, the prompt in the expanded layout (n image tokens per
image, `check_images`). A batch's prefill passes the `pixel_values` [P, D] and `image_grid_thw`
[I, 3] of its rows concatenated in row order (the tower's embeddings fill the image tokens in that
order) and the mRoPE position ids the engine computes itself (`get_rope_index` with
`mm_token_type_ids` = 1 on image tokens, over the real tokens of each left-padded row), as
`[4, rows, width]`: the text positions (which build the attention mask) then the 3 mRoPE rows.
Each row's mRoPE delta δ = max position + 1 - real length is kept, and a decoded token at text
position p gets mRoPE position p + δ in all 3 rows (what the model's own generate does, with no
per-model state: concurrent batches and re-prefills cannot see another batch's deltas). The
images are needed only by prefills (the first, and the re-prefill after a weight sync). The
placeholder tokens (`rl_data.vision.vision_token_ids`: image, video, vision start and end) are
outside the policy's support: their logits are −∞ before sampling and before the log-probs, as
in the learner's forward, so a response never holds an image token without an image.

Weight sync: `init_weight_sync` builds an `rl_rollout.WeightReceiver` whose `apply` copies each
named tensor into the model's `state_dict()` entry (dtype cast included). Tied weights share
storage, so writing one name updates both; a name missing from the state dict is accepted only
when the model declares it tied to another parameter.

LoRA adapter sync (a spec with `adapter`, `rl_rollout.adapters`): the first `init_weight_sync`
injects the policy's LoRA layers into the model (peft, B = 0: the base model), checked against
the base weights' shapes; each sync then copies the received factors into them under the same
lock, so the adapter swaps between two decoding steps exactly as full weights do.

Partial rollout (`supports("partial_rollout")`): `generate` holds the engine's lock while it
decodes, but between two forward passes it lets a `receive_weights` waiting on another thread
in (a sync waits at most one decoding step). When the weights changed, the rows in flight are
re-prefilled: their KV cache is rebuilt by one forward pass over prompt + tokens so far under the
new weights, and decoding goes on from there. A row keeps its tokens, their log-probs (the old
weights'), its remaining budget and its `torch.Generator` (the seeded stream goes on where it
was); `Generation.token_versions` says which version wrote each token, and the log-probs after
the sync are the new weights' teacher-forced ones (no KV of the old weights is ever attended to).

Routes (`return_routed_experts=True`, a mixture-of-experts model; `supports("routed_experts")`):
forward hooks on the routers (`rl_data.routes.moe_routers`) keep the top-K expert indices of every
token each forward runs, and `Generation.routed_experts` holds them for prompt ‖ response, [P + R,
L, K]. A token's route is the one of the forward that first ran it (a re-prefill after a weight sync
adds only the token it runs for the first time); the last sampled token is never run: −1.

Sleep (the hybrid engine's contract, on every device): `sleep` frees the engine's device memory (on
CUDA the weights move to host memory and the cache is emptied; on CPU nothing needs to move) and
`wake_up` restores it. While asleep, `generate` and `receive_weights` are refused with an
`EngineError` (wake the engine before a weight sync, as vLLM needs its weights in place to load
new ones); after `wake_up` the engine generates exactly what it did before. `agenerate` batches concurrent callers: requests arriving within
`batch_wait_s` of each other with equal `SamplingParams` go through one `generate` call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections.abc import Iterable, Sequence

import torch

from rl_data import ImageInputs, WeightSyncReport, check_layout_shapes
from rl_data.adapters import LoraAdapter, check_adapter_shapes
from rl_data.errors import check_integer
from rl_data.routes import ROUTE_DTYPE, moe_routers, unreported_routes
from rl_data.sync import WeightSyncSpec
from rl_data.sync.ipc import IpcPayload
from rl_data.vision import VISION_MODEL_TYPES, is_vision_model, vision_token_ids

from ..adapters import inject_lora
from ..protocol import (
    Engine,
    EngineError,
    Generation,
    SamplingParams,
    check_images,
    check_prompts,
    prompt_seed,
)
from ..weights import WeightReceiver

__all__ = ["HFEngine"]

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"HFEngine: dtype {dtype!r} is not one of {sorted(_DTYPES)} or a torch.dtype")
    return _DTYPES[dtype]


def _as_id_set(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(item) for item in value}


class _StopText:
    """Incremental detokenization of one response, watching for stop strings.

    Keeps a small window of ids (vLLM's prefix/read offsets): the text of `ids[prefix:read]`
    was already emitted; `ids[prefix:]` decoded minus that prefix is the new text, held back
    while it ends in an incomplete UTF-8 sequence (U+FFFD). Only the last
    max(len(stop)) + len(new text) characters are searched, so each token costs O(window).
    """

    def __init__(self, tokenizer, stops: Sequence[str]) -> None:
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.longest = max(len(stop) for stop in self.stops)
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.tail = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def push(self, token: int) -> bool:
        """Add one token; True if a stop string is complete in the text so far."""
        self.ids.append(token)
        emitted = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(emitted) or text.endswith("\ufffd"):
            return False
        self.prefix, self.read = self.read, len(self.ids)
        self.tail += text[len(emitted) :]
        hit = any(stop in self.tail for stop in self.stops)
        self.tail = self.tail[-(self.longest - 1) :] if self.longest > 1 else ""
        return hit


class _Request:
    __slots__ = ("future", "images", "loop", "params", "prompt")

    def __init__(self, prompt: list[int], params: SamplingParams, loop, future, images=None) -> None:
        self.prompt, self.params, self.loop, self.future = prompt, params, loop, future
        self.images: ImageInputs | None = images


class HFEngine(Engine):
    """A transformers causal LM behind the engine protocol (see the module docstring).

    Args:
        model: a checkpoint folder (or hub name, offline-cached) for `AutoModelForCausalLM`
            (`AutoModelForImageTextToText` for a VL folder, `is_vision_model`), or a loaded
            `PreTrainedModel`.
        tokenizer: needed for stop strings and the default EOS / pad ids; loaded from `model`
            when that is a path and this is None.
        device: where the model runs ("cpu", "cuda:0"); default CUDA if available, else CPU.
        dtype: weights' dtype ("float32", "bfloat16", ... or a torch.dtype); None keeps the
            checkpoint's (loaded model: unchanged).
        max_model_len: context length (prompt + response); default `config.max_position_embeddings`.
        max_batch_size: most rows (prompt × sample) decoded together.
        eos_token_ids: ids that end a response unless `ignore_eos`; default the tokenizer's EOS
            plus the model's `generation_config.eos_token_id`.
        pad_token_id: left-padding id (never attended to); default tokenizer / config pad, else EOS.
        seed: seeds the engine's generator, used for rows of requests without a seed.
        batch_wait_s: how long `agenerate` waits for more concurrent requests to batch together.
        return_routed_experts: record each token's experts (an MoE model; module docstring).
    """

    name = "HFEngine"

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        max_model_len: int | None = None,
        max_batch_size: int = 64,
        eos_token_ids: int | Iterable[int] | None = None,
        pad_token_id: int | None = None,
        seed: int | None = None,
        batch_wait_s: float = 0.005,
        return_routed_experts: bool = False,
    ) -> None:
        check_integer("HFEngine: max_batch_size", max_batch_size, 1)
        if not batch_wait_s >= 0:
            raise ValueError(f"HFEngine: batch_wait_s must be >= 0 seconds, got {batch_wait_s!r}")
        torch_dtype = _resolve_dtype(dtype)
        self.device = torch.device(
            device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

            path = os.fspath(model)
            loader = AutoModelForImageTextToText if is_vision_model(path) else AutoModelForCausalLM
            model = loader.from_pretrained(path, dtype=torch_dtype or "auto")
            if tokenizer is None:
                tokenizer = AutoTokenizer.from_pretrained(path)
        elif not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"HFEngine: model must be a checkpoint path or a torch.nn.Module, got {type(model).__name__}"
            )
        elif torch_dtype is not None:
            model = model.to(torch_dtype)
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.tokenizer = tokenizer
        self._routers: list[torch.nn.Module] | None = None
        if return_routed_experts:
            try:
                self._routers = moe_routers(self.model)[0]
            except ValueError as error:
                raise ValueError(f"HFEngine: return_routed_experts: {error}") from None
        config = self.model.config
        self.vision = getattr(config, "model_type", None) in VISION_MODEL_TYPES
        self.image_token_id = int(config.image_token_id) if self.vision else None
        # how `check_images` reads a request's images: this model's layout, or why it takes none
        self._image_layout = (
            {
                "image_token_id": self.image_token_id,
                "merge_size": int(config.vision_config.spatial_merge_size),
            }
            if self.vision
            else {
                "refusal": f"prompts with images need a vision-language model ({', '.join(VISION_MODEL_TYPES)}); "
                f"this one is {getattr(config, 'model_type', None)!r}"
            }
        )
        # placeholder tokens the policy never samples (rl_data.vision.vision_token_ids)
        self._never = torch.tensor(vision_token_ids(config) if self.vision else [], dtype=torch.long)
        if max_model_len is None:
            max_model_len = getattr(config.get_text_config(), "max_position_embeddings", None)
            if max_model_len is None:
                raise ValueError(
                    "HFEngine: the model config has no max_position_embeddings; pass max_model_len"
                )
        check_integer("HFEngine: max_model_len", max_model_len, 2)
        self._max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        generation_config = getattr(self.model, "generation_config", None)
        if eos_token_ids is None:
            eos = _as_id_set(getattr(tokenizer, "eos_token_id", None))
            eos |= _as_id_set(getattr(generation_config, "eos_token_id", None))
        else:
            eos = _as_id_set(eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        if pad_token_id is None:
            for candidate in (
                getattr(tokenizer, "pad_token_id", None),
                getattr(generation_config, "pad_token_id", None),
                getattr(config, "pad_token_id", None),
            ):
                if isinstance(candidate, int):
                    pad_token_id = candidate
                    break
            else:
                pad_token_id = min(self.eos_token_ids) if self.eos_token_ids else 0
        self.pad_token_id = int(pad_token_id)
        self._rng = torch.Generator()
        if seed is None:
            self._rng.seed()
        else:
            self._rng.manual_seed(seed)
        self.batch_wait_s = float(batch_wait_s)
        self.policy_version = 0
        self._lock = threading.RLock()
        # partial rollout: syncs waiting for the lock; the decoding loop lets them in between steps
        self._syncs_waiting = 0
        self._waiting_lock = threading.Lock()
        self._synced = threading.Condition(self._lock)
        self._receiver: WeightReceiver | None = None
        # LoRA adapter sync: the adapter served and {wire name: live LoRA factor} (`_join_adapter_sync`)
        self._adapter: LoraAdapter | None = None
        self._adapter_targets: dict[str, torch.Tensor] | None = None
        self._asleep = False
        self._queue: queue.Queue[_Request | None] | None = None
        self._worker: threading.Thread | None = None

    # --- protocol ---------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def supports(self, feature: str) -> bool:
        super().supports(feature)  # validates the name
        return feature in ("weight_sync", "async", "sleep", "partial_rollout") or (
            (feature == "images" and self.vision)
            or (feature == "routed_experts" and self._routers is not None)
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[list[Generation]]:
        """`params.n` responses per prompt (the protocol's `generate`); `images`: one ImageInputs or
        None per prompt, for a VL model (see the module docstring)."""
        if not isinstance(params, SamplingParams):
            raise EngineError(
                f"{self.name}.generate: params must be a SamplingParams, got {type(params).__name__}"
            )
        checked = check_prompts(prompts, params, self.max_model_len, self.name)
        checked_images = check_images(images, checked, self.name, **self._image_layout)
        if params.stop and self.tokenizer is None:
            raise EngineError(
                f"{self.name}.generate: stop strings {params.stop!r} need a tokenizer; none was given"
            )
        with self._lock:
            if self._asleep:
                raise EngineError(f"{self.name}.generate: the engine is asleep; call wake_up() first")
            rows = [(index, sample) for index in range(len(checked)) for sample in range(params.n)]
            seeds = self._row_seeds(params, checked, checked_images)
            order = sorted(range(len(rows)), key=lambda row: len(checked[rows[row][0]]))
            results: list[Generation | None] = [None] * len(rows)
            for start in range(0, len(order), self.max_batch_size):
                chunk = order[start : start + self.max_batch_size]
                outputs = self._decode(
                    [checked[rows[row][0]] for row in chunk],
                    [seeds[row] for row in chunk],
                    params,
                    [checked_images[rows[row][0]] for row in chunk],
                )
                for row, generation in zip(chunk, outputs):
                    results[row] = generation
        return [results[index * params.n : (index + 1) * params.n] for index in range(len(checked))]

    def _row_seeds(
        self, params: SamplingParams, prompts: list[list[int]], images: list[ImageInputs | None]
    ) -> list[int]:
        """The seed of every row (prompt i's sample j at i·n + j): 0 when greedy; `prompt_seed` + j
        with a request seed (each prompt, and its pixels, hashed once); else draws of the engine's
        generator, row by row."""
        rows = len(prompts) * params.n
        if params.greedy:
            return [0] * rows
        if params.seed is not None:
            bases = [prompt_seed(params.seed, prompt, entry) for prompt, entry in zip(prompts, images)]
            return [(base + sample) % (1 << 63) for base in bases for sample in range(params.n)]
        return [int(torch.randint(0, 1 << 62, (1,), generator=self._rng)) for _ in range(rows)]

    # --- the decoding loop --------------------------------------------------------------------------

    @torch.no_grad()
    def _decode(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        params: SamplingParams,
        images: list[ImageInputs | None] | None = None,
    ) -> list[Generation]:
        """Decode one batch of rows; returns one Generation per row, in order."""
        device, rows = self.device, len(prompts)
        images = images if images is not None else [None] * rows
        input_ids, attention, positions = self._left_padded(prompts)
        inputs, deltas = self._prefill_inputs(input_ids, attention, positions, images)
        limits = [min(params.max_new_tokens, self.max_model_len - len(prompt)) for prompt in prompts]
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        suppress = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        generators = None
        if not params.greedy:
            generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
        watchers = [_StopText(self.tokenizer, params.stop) for _ in prompts] if params.stop else None
        temperature = params.temperature if not params.greedy else 1.0
        tokens_out: list[list[int]] = [[] for _ in prompts]
        logprobs_out: list[list[float]] = [[] for _ in prompts]
        versions_out: list[list[int]] = [[] for _ in prompts]
        finish: list[str] = ["length"] * rows
        active = list(range(rows))  # original row of each batch row
        routes = _RouteRecorder(self._routers, rows) if self._routers is not None else None
        cache, step = None, 0
        self._let_syncs_in()
        version = self.policy_version
        while True:
            self._let_syncs_in()
            if self.policy_version != version:  # new weights: rebuild the rows' KV cache under them
                version = self.policy_version
                input_ids, attention, positions = self._left_padded(
                    [prompts[row] + tokens_out[row] for row in active]
                )
                inputs, deltas = self._prefill_inputs(
                    input_ids, attention, positions, [images[row] for row in active]
                )
                cache = None
            with routes if routes is not None else contextlib.nullcontext():
                output = self.model(**inputs, attention_mask=attention, past_key_values=cache, use_cache=True)
            if routes is not None:
                routes.keep(active, attention.sum(-1).tolist(), inputs["input_ids"].shape[1])
            cache = output.past_key_values
            scores = output.logits[:, -1, :].float() / temperature  # [A, V]
            if self._never.numel():  # a VL model's placeholders are not in the policy's support
                scores = scores.index_fill(1, self._never.to(device), float("-inf"))
            choice = scores
            if step < params.min_new_tokens and suppress.numel():
                choice = scores.index_fill(1, suppress, float("-inf"))
            if params.greedy:
                tokens = choice.argmax(dim=-1)
            else:
                tokens = self._sample(choice, params, [generators[row] for row in active])
            if params.logprobs:
                picked = torch.log_softmax(scores, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
            keep: list[int] = []
            for position, (row, token) in enumerate(zip(active, tokens.tolist())):
                tokens_out[row].append(token)
                versions_out[row].append(version)
                if params.logprobs:
                    logprobs_out[row].append(picked[position])
                if token in stop_ids or (watchers is not None and watchers[row].push(token)):
                    finish[row] = "stop"
                elif len(tokens_out[row]) < limits[row]:
                    keep.append(position)
            if not keep:
                break
            step += 1
            last_positions = positions[:, -1:] + 1
            if len(keep) < len(active):
                index = torch.tensor(keep, dtype=torch.long, device=device)
                cache.batch_select_indices(index)
                attention, last_positions, tokens = attention[index], last_positions[index], tokens[index]
                deltas = deltas[index] if deltas is not None else None
                active = [active[position] for position in keep]
            input_ids = tokens.unsqueeze(1)
            attention = torch.cat([attention, attention.new_ones((len(active), 1))], dim=1)
            positions = last_positions
            inputs = {"input_ids": input_ids, "position_ids": self._step_positions(positions, deltas)}
        return [
            Generation(
                token_ids=tokens_out[row],
                logprobs=logprobs_out[row] if params.logprobs else None,
                finish_reason=finish[row],
                policy_version=versions_out[row][0] if versions_out[row] else version,
                token_versions=versions_out[row] if len(set(versions_out[row])) > 1 else None,
                routed_experts=routes.of(row, len(prompts[row]) + len(tokens_out[row])) if routes else None,
            )
            for row in range(rows)
        ]

    def _left_padded(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask, position_ids) `[rows, width]` on the engine's device: the
        sequences left-padded to the longest, positions counting real tokens only."""
        width = max(len(sequence) for sequence in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            input_ids[row, width - len(sequence) :] = torch.tensor(sequence, dtype=torch.long)
            attention[row, width - len(sequence) :] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        return input_ids, attention, (attention.cumsum(-1) - 1).clamp(min=0)

    def _prefill_inputs(
        self,
        input_ids: torch.Tensor,
        attention: torch.Tensor,
        positions: torch.Tensor,
        images: list[ImageInputs | None],
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """(model inputs of a prefill, mRoPE deltas `[rows, 1]` or None for a text model).

        Text model: input ids and the text positions `[rows, width]`. VL model: also the rows'
        pixel values and grids (row order) and position ids `[4, rows, width]` = the text
        positions, then `get_rope_index`'s 3 mRoPE rows; δ = max mRoPE position + 1 - real length.
        """
        if not self.vision:
            return {"input_ids": input_ids, "position_ids": positions}, None
        present = [entry for entry in images if entry is not None]
        grid = torch.cat([entry.grid_thw for entry in present]).to(self.device) if present else None
        image_tokens = (input_ids == self.image_token_id) & attention.bool()
        rope, deltas = self.model.model.get_rope_index(input_ids, image_tokens.int(), grid, None, attention)
        inputs = {"input_ids": input_ids, "position_ids": torch.cat([positions.unsqueeze(0), rope])}
        if present:
            dtype = next(self.model.model.visual.parameters()).dtype
            inputs["pixel_values"] = torch.cat([entry.pixel_values for entry in present]).to(
                self.device, dtype
            )
            inputs["image_grid_thw"] = grid
        return inputs, deltas.to(self.device).reshape(-1, 1)

    @staticmethod
    def _step_positions(positions: torch.Tensor, deltas: torch.Tensor | None) -> torch.Tensor:
        """Position ids of one decoding step: the text positions `[rows, 1]`, or for a VL model
        `[4, rows, 1]` = text position p, then p + δ in each of the 3 mRoPE rows."""
        if deltas is None:
            return positions
        rope = (positions + deltas).unsqueeze(0).expand(3, -1, -1)
        return torch.cat([positions.unsqueeze(0), rope])

    def _let_syncs_in(self) -> None:
        """Between two decoding steps (the lock held): wait while `receive_weights` calls are
        waiting for the lock, so that they run now (partial rollout)."""
        while self._syncs_waiting:  # a receiver interrupted before it took the lock never notifies
            self._synced.wait(timeout=0.5)

    @staticmethod
    def _sample(
        scores: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]
    ) -> torch.Tensor:
        """One token per row of `scores` `[A, V]` (already divided by T), after top-k and top-p."""
        if params.top_k and params.top_k < scores.shape[-1]:
            kth = scores.topk(params.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            ordered, order = scores.sort(dim=-1, descending=True)
            probs = ordered.softmax(dim=-1)
            # drop a token when the mass of the tokens ranked above it already reaches top_p
            drop = (probs.cumsum(dim=-1) - probs) >= params.top_p
            drop[:, 0] = False
            scores = scores.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
        probs = scores.softmax(dim=-1)
        return torch.cat(
            [
                torch.multinomial(probs[row], 1, generator=generator)
                for row, generator in enumerate(generators)
            ]
        )

    # --- async batching ---------------------------------------------------------------------------

    async def agenerate(
        self, prompt: Sequence[int], params: SamplingParams, images: ImageInputs | None = None
    ) -> list[Generation]:
        """The `params.n` responses to `prompt` (with its `images`, VL models); concurrent calls
        are decoded together.

        Requests that reach the engine within `batch_wait_s` of the first one and have equal
        `params` share one `generate` call (greedy results equal the unbatched ones up to
        floating point, sampled rows keep their own generators).
        """
        checked = check_prompts([prompt], params, self.max_model_len, self.name)[0]
        [images] = check_images(
            None if images is None else [images], [checked], self.name, **self._image_layout
        )
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._ensure_worker().put(_Request(checked, params, loop, future, images))
        return await future

    def _ensure_worker(self) -> queue.Queue:
        with self._lock:
            if self._worker is None or not self._worker.is_alive():
                self._queue = queue.Queue()
                self._worker = threading.Thread(
                    target=self._serve, args=(self._queue,), name="HFEngine-batcher", daemon=True
                )
                self._worker.start()
            return self._queue

    def _serve(self, requests: queue.Queue) -> None:
        import time

        while True:
            first = requests.get()
            if first is None:
                return
            batch, deadline, closing = [first], time.monotonic() + self.batch_wait_s, False
            while len(batch) < self.max_batch_size:
                try:
                    item = requests.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                    break
                batch.append(item)
            groups: dict[SamplingParams, list[_Request]] = {}
            for request in batch:
                groups.setdefault(request.params, []).append(request)
            for params, members in groups.items():
                try:
                    prompts, images = [m.prompt for m in members], [m.images for m in members]
                    if any(entry is not None for entry in images):
                        results = self.generate(prompts, params, images)
                    else:  # text requests call generate as before images existed (subclasses may)
                        results = self.generate(prompts, params)
                except Exception as error:  # handed to every caller of the group
                    for member in members:
                        member.loop.call_soon_threadsafe(_settle, member.future, None, error)
                    continue
                for member, result in zip(members, results):
                    member.loop.call_soon_threadsafe(_settle, member.future, result, None)
            if closing:
                return

    # --- weight sync --------------------------------------------------------------------------------

    def init_weight_sync(self, spec: WeightSyncSpec, rank: int) -> None:
        """Join `spec`'s transport as receiver `rank`; replaces (and closes) an earlier receiver."""
        if not isinstance(spec, WeightSyncSpec):
            raise EngineError(
                f"{self.name}.init_weight_sync: spec must be a WeightSyncSpec, got {type(spec).__name__}"
            )
        if spec.transport == "ipc" and self.device.type != "cuda":
            raise EngineError(
                f"{self.name}.init_weight_sync: the 'ipc' transport needs a CUDA engine, this one is on {self.device}"
            )
        if spec.adapter is None and self._adapter is not None:
            raise EngineError(
                f"{self.name}.init_weight_sync: this engine serves a LoRA adapter since an earlier adapter "
                "sync; it cannot take a full-weight spec (start a new engine)"
            )
        try:
            if spec.adapter is not None:
                self._join_adapter_sync(spec)
            else:
                shapes = {name: tuple(tensor.shape) for name, tensor in self.model.state_dict().items()}
                check_layout_shapes(spec.layout, shapes, where=f"{self.name}.init_weight_sync")
        except ValueError as error:
            raise EngineError(str(error)) from None
        with self._lock:
            if self._receiver is not None:
                self._receiver.close()
                self._receiver = None
            buffers = "cpu" if spec.transport in ("file", "shm") or spec.backend == "gloo" else self.device
            self._receiver = WeightReceiver(spec, rank, self._apply_weights, device=buffers)

    def _join_adapter_sync(self, spec: WeightSyncSpec) -> None:
        """LoRA adapter sync (`rl_rollout.adapters`): inject the adapter's LoRA layers once (B = 0:
        the base model until the first sync), then every sync copies the factors into them."""
        where = f"{self.name}.init_weight_sync"
        if self._adapter_targets is not None:
            if spec.adapter != self._adapter or set(spec.layout.names()) != set(self._adapter_targets):
                raise ValueError(f"{where}: a different LoRA adapter than the one this engine serves")
            return
        base = {name: tuple(tensor.shape) for name, tensor in self.model.state_dict().items()}
        check_adapter_shapes(spec.layout, base, spec.adapter, where=where)
        with self._lock:
            self._adapter_targets = inject_lora(
                self.model, spec.adapter, list(spec.layout.names()), where=where
            )
            self._adapter = spec.adapter

    def receive_weights(self, version: int, payload: IpcPayload | None = None) -> WeightSyncReport:
        """Receive one sync and copy it into the model (with an adapter sync: into the LoRA factors); policy_version becomes `version` on success.

        Called while a `generate` decodes on another thread, it runs at that loop's next step
        (partial rollout: the rows in flight go on under the new weights, see the module docstring).
        """
        with self._waiting_lock:
            self._syncs_waiting += 1
        acquired = False
        try:
            acquired = self._lock.acquire()
            return self._receive(version, payload)
        finally:
            with self._waiting_lock:
                self._syncs_waiting -= 1
            if acquired:
                self._synced.notify_all()
                self._lock.release()

    def _receive(self, version: int, payload: IpcPayload | None) -> WeightSyncReport:
        if self._receiver is None:
            raise EngineError(f"{self.name}.receive_weights: call init_weight_sync(spec, rank) first")
        if self._asleep:
            raise EngineError(f"{self.name}.receive_weights: the engine is asleep; call wake_up() first")
        self._state = self._adapter_targets if self._adapter is not None else self.model.state_dict()
        try:
            report = self._receiver.receive(version, payload)
        finally:
            self._state = None
        self.policy_version = version
        return report

    def _tied_names(self) -> set[str]:
        tied = getattr(self.model, "_tied_weights_keys", None) or ()
        names = set(tied.keys()) | set(tied.values()) if isinstance(tied, dict) else set(tied)
        if getattr(self.model.config, "tie_word_embeddings", False):
            names.add("lm_head.weight")
        return names

    def _apply_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = self._state
        with torch.no_grad():
            for name, tensor in named:
                target = state.get(name)
                if target is None:
                    if name in self._tied_names():
                        continue  # shares storage with a parameter that has (or gets) its own entry
                    known = ", ".join(list(state)[:3])
                    raise EngineError(
                        f"{self.name}.receive_weights: parameter {name!r} is not in the model "
                        f"({len(state)} entries, e.g. {known}) and is not a tied weight"
                    )
                if tuple(target.shape) != tuple(tensor.shape):
                    raise EngineError(
                        f"{self.name}.receive_weights: parameter {name!r} arrived with shape "
                        f"{tuple(tensor.shape)}, the model's is {tuple(target.shape)}"
                    )
                target.copy_(tensor)

    # --- memory -------------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the device memory until `wake_up`: on CUDA move the weights to host memory and empty
        the cache (level 1 and 2 alike: the weights are kept); on CPU only refuse work until then."""
        if level not in (1, 2):
            raise ValueError(f"{self.name}.sleep: level must be 1 or 2, got {level!r}")
        with self._lock:
            if not self._asleep:
                if self.device.type == "cuda":
                    self.model.to("cpu")
                    torch.cuda.empty_cache()
                self._asleep = True

    @property
    def asleep(self) -> bool:
        return self._asleep

    def wake_up(self) -> None:
        """Move the weights back to the engine's device; a no-op when awake."""
        with self._lock:
            if self._asleep:
                if self.device.type == "cuda":
                    self.model.to(self.device)
                self._asleep = False

    def close(self) -> None:
        """Stop the agenerate batcher and leave the weight-sync group."""
        worker, requests = self._worker, self._queue
        if worker is not None and worker.is_alive() and requests is not None:
            requests.put(None)
            worker.join(timeout=30)
        self._worker = None
        with self._lock:
            if self._receiver is not None:
                self._receiver.close()
                self._receiver = None


class _RouteRecorder:
    """Forward hooks on an MoE model's routers that keep, row by row, the top-K experts of every
    token a forward runs the first time (module docstring)."""

    def __init__(self, routers: list[torch.nn.Module], rows: int) -> None:
        self._routers = routers
        self._step: list[torch.Tensor] = []
        self._handles: list = []
        self._rows: list[list[torch.Tensor]] = [[] for _ in range(rows)]  # [tokens, L, K] chunks
        self._known = [0] * rows  # tokens of each row with a route

    def _hook(self, _module: torch.nn.Module, _inputs, output) -> None:
        self._step.append(output[2].detach())

    def __enter__(self) -> _RouteRecorder:
        self._step = []
        self._handles = [router.register_forward_hook(self._hook) for router in self._routers]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def keep(self, active: list[int], lengths: list[int], width: int) -> None:
        """After a forward over `[A, width]` left-padded rows (`lengths` real tokens each, the
        row's whole sequence so far): append the routes of the tokens not seen before."""
        step = torch.stack(self._step, dim=1).to("cpu", ROUTE_DTYPE)  # [A·width, L, K]
        step = step.reshape(len(active), width, *step.shape[1:])
        for position, (row, length) in enumerate(zip(active, lengths)):
            new = length - self._known[row] if width > 1 else 1
            self._rows[row].append(step[position, width - new :])
            self._known[row] += new

    def of(self, row: int, tokens: int) -> torch.Tensor:
        """[tokens, L, K] routes of a row's prompt ‖ response; −1 for tokens never run."""
        kept = torch.cat(self._rows[row])
        return torch.cat([kept, unreported_routes(tokens - kept.shape[0], *kept.shape[1:])])


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
