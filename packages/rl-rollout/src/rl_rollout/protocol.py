"""The engine protocol: token ids in, token ids, log-probs and a finish reason out.

Every engine (vLLM in-process, HF transformers, an OpenAI-compatible HTTP server) implements
`Engine` and passes the same contract tests. Executors and the launcher only ever talk to this
interface, so an engine can be swapped by configuration.

    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(n=4, max_new_tokens=64))
    # -> [[Generation, Generation, Generation, Generation], [4 more]]   [prompt][sample]

Text never enters a trajectory: prompts are token ids, responses are the sampled token ids, and
`logprobs[t]` is the engine's log-probability of `token_ids[t]` under softmax(z / T), the
temperature-scaled distribution (T = 1 when greedy) before top-k / top-p truncation: exactly
what the learner recomputes with `rl_algos.logprobs_from_logits(logits, labels, temperature=T)`.
(vLLM reports top-k / top-p renormalised values when those are set; RL runs usually leave them
off.)

Weight sync, receiving side: `init_weight_sync(spec, rank)` joins the transport that
`rl_data.sync.WeightSyncSpec` describes (a process group, a folder, CUDA IPC, a plugin's);
`receive_weights(...)` applies one sync and returns a `WeightSyncReport` whose checksums the
sender compares. The engine then reports the new `policy_version`.

Partial rollout (`supports("partial_rollout")`): a `receive_weights` called from another thread
while a `generate` / `agenerate` is in flight takes effect between two decoding steps, and the
requests in flight go on under the new weights instead of waiting or starting over: no token is
thrown away. Each response then carries the version of every token (`Generation.token_versions`),
its tokens before the sync written by the old weights (with their log-probs), the ones after by
the new weights. Engines that have it recompute the in-flight requests' KV cache under the new
weights (a prefill of prompt + tokens so far), so every log-prob is the one of the weights its
version names; the request keeps its remaining token budget and its seeded sampler stream.

Images (`supports("images")`, vision-language models): `generate(prompts, params, images=...)`
takes one `rl_data.ImageInputs` or None per prompt (`agenerate(prompt, params, images=...)` one
for its prompt), the images of that prompt in the order of its placeholder runs. The prompt ids
are the model's expanded layout (`rl_data.vision.VisionProcessor`: n image tokens per image), as
the learner sees them; an engine that processes images itself (vLLM) collapses them and keeps the
expanded ids. `images` reaches the engine as given; callers with text-only prompts leave it out,
so engines written before images keep working for them. An engine without images refuses a
request that has some (`check_images`).
"""

from __future__ import annotations

import abc
import array
import asyncio
import hashlib
import itertools
import math
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from rl_data import FINISH_REASONS, ImageInputs, WeightSyncReport
from rl_data.sync import WeightSyncSpec
from rl_data.vision import image_token_counts

__all__ = [
    "FEATURES",
    "Engine",
    "EngineError",
    "Generation",
    "SamplingParams",
    "check_images",
    "check_prompts",
    "prompt_seed",
]

FEATURES = ("weight_sync", "sleep", "prefix_cache", "async", "partial_rollout", "images", "routed_experts")


def prompt_seed(seed: int | None, prompt: Sequence[int], images: ImageInputs | None = None) -> int | None:
    """The seed a request's noise is drawn from: a 62-bit hash of (`seed`, the prompt's token
    ids, and its images' grids and pixel values when it has some); None stays None. Every engine seeds a request with it (sample j of `n` with the
    engine's own rule on top: vLLM's generator sequence, `HFEngine`'s `+ j`).

    A generator seeded with the request's seed alone gives every prompt of a batch that shares
    it the same noise, and near-uniform distributions the same samples: the samples of
    different prompts would not be independent. Mixing in the prompt keeps a (seed, prompt) pair
    reproducible, in a batch or alone.
    """
    if seed is None:
        return None
    digest = hashlib.blake2b(
        str(int(seed)).encode() + b":" + array.array("q", prompt).tobytes(), digest_size=8
    )
    if images is not None and images.num_images:  # same ids, other pictures: other noise
        digest.update(images.grid_thw.numpy().tobytes())
        digest.update(images.pixel_values.numpy().tobytes())
    return int.from_bytes(digest.digest(), "little") >> 2


class EngineError(RuntimeError):
    """An engine cannot serve a request: bad prompt, unsupported feature, server failure."""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample; the same fields mean the same thing for every engine.

    temperature: 0 means greedy. top_p: nucleus mass in (0, 1]. top_k: 0 means off.
    max_new_tokens: response length cap (finish reason "length" when hit). min_new_tokens:
    EOS and stop tokens are suppressed before this many tokens. stop_token_ids: extra token ids
    that end a response (the tokenizer's EOS always does unless `ignore_eos`); the stop token is
    part of the response. stop: strings that end a response, matched on the decoded text; the
    response is cut after the tokens that complete the match (engines that cannot do that keep
    whole tokens). n: samples per prompt. seed: per-request seed, mixed with the prompt
    (`prompt_seed`), so prompts that share it draw independent samples (None: engine's generator).
    logprobs: return the sampled tokens' log-probs.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 1024
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None
    logprobs: bool = True
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def fail(field: str, value: object, allowed: str) -> None:
            raise ValueError(f"SamplingParams.{field}: {value!r} is not allowed; expected {allowed}")

        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            fail("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            fail("top_p", self.top_p, "a number in (0, 1]")
        for field in ("top_k", "min_new_tokens"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                fail(field, value, "an integer >= 0")
        for field in ("max_new_tokens", "n"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(field, value, "an integer >= 1")
        if self.min_new_tokens > self.max_new_tokens:
            fail("min_new_tokens", self.min_new_tokens, f"at most max_new_tokens ({self.max_new_tokens})")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", self.stop_token_ids, "non-negative token ids")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", self.stop, "non-empty strings")

    @property
    def greedy(self) -> bool:
        """True when temperature is 0."""
        return self.temperature == 0


class Generation(msgspec.Struct, kw_only=True):
    """One sampled response: token ids, their log-probs, why it ended, which weights made it.

    finish_reason is one of rl_data.FINISH_REASONS: "stop" (EOS, a stop token or a stop
    string), "length" (max_new_tokens or the context length reached) or "abort".
    policy_version: the version of the weights that wrote its first token (the engine's version
    when the request started, for an empty response). token_versions: `[len(token_ids)]` the
    version of each token, when a weight sync landed while it was generated (partial rollout);
    None when every token is `policy_version`'s (`versions()` gives the list either way).
    routed_experts: `[P + len(token_ids), L, K]` int16, the top-K experts of each of the L MoE
    layers at every token of prompt ‖ response (−1 where the engine did not run the token), from
    an engine with `supports("routed_experts")` asked for them; None otherwise.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    policy_version: int = 0
    token_versions: list[int] | None = None
    routed_experts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Generation.finish_reason: {self.finish_reason!r} is not one of {FINISH_REASONS}"
            )
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"Generation: {len(self.logprobs)} log-probs for {len(self.token_ids)} tokens")
        if self.token_versions is not None:
            if len(self.token_versions) != len(self.token_ids):
                raise ValueError(
                    f"Generation: {len(self.token_versions)} token versions for {len(self.token_ids)} tokens"
                )
            if any(later < earlier for earlier, later in itertools.pairwise(self.token_versions)):
                raise ValueError(
                    f"Generation.token_versions: {self.token_versions} decrease along the response"
                )

    def versions(self) -> list[int]:
        """The policy version of every token: `token_versions`, or `policy_version` repeated."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [self.policy_version] * len(self.token_ids)


def check_prompts(
    prompts: Sequence[Sequence[int]], params: SamplingParams, max_model_len: int, engine: str
) -> list[list[int]]:
    """The prompts as lists of ints, after checking each one; raises EngineError naming the prompt.

    A prompt must be non-empty, hold non-negative integer token ids, and leave room for at least
    one new token: len(prompt) < max_model_len.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise EngineError(
            f"{engine}.generate: prompts must be a sequence of token-id lists, got {type(prompts).__name__}"
        )
    checked = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)):
            raise EngineError(f"{engine}.generate: prompt {index} is text; engines take token ids")
        ids = [int(token) for token in prompt]
        if not ids:
            raise EngineError(f"{engine}.generate: prompt {index} is empty")
        if min(ids) < 0:
            raise EngineError(f"{engine}.generate: prompt {index} holds a negative token id {min(ids)}")
        if len(ids) >= max_model_len:
            raise EngineError(
                f"{engine}.generate: prompt {index} has {len(ids)} tokens; the engine's context is "
                f"{max_model_len} tokens, which leaves no room for a response"
            )
        checked.append(ids)
    return checked


def check_images(
    images: Sequence[ImageInputs | None] | None,
    prompts: Sequence[Sequence[int]],
    engine: str,
    *,
    image_token_id: int | None = None,
    merge_size: int = 1,
    refusal: str | None = None,
) -> list[ImageInputs | None]:
    """The images of each prompt (None: a text prompt), after checking them against the prompts.

    `images` is None (no prompt has images) or one `ImageInputs` / None per prompt. An engine
    that cannot take images passes `refusal` (why): any image then raises EngineError with it.
    With `image_token_id` (an engine that knows its model's vision layout), prompt i must hold
    exactly Σⱼ tⱼ·hⱼ·wⱼ / merge_size² image tokens for its images' grids (`grid_thw` [I, 3],
    `rl_data.vision.image_token_counts`); a prompt without images must hold none. Raises
    EngineError naming the prompt and the counts.
    """
    if images is None:
        images = [None] * len(prompts)
    elif isinstance(images, ImageInputs) or not isinstance(images, Sequence):
        raise EngineError(
            f"{engine}.generate: images must be a list with one ImageInputs or None per prompt, "
            f"got {type(images).__name__}"
        )
    if refusal is not None:
        if any(entry is not None for entry in images):
            raise EngineError(f"{engine}.generate: {refusal}")
        return [None] * len(prompts)
    if len(images) != len(prompts):
        raise EngineError(f"{engine}.generate: {len(images)} image entries for {len(prompts)} prompts")
    checked = []
    for index, (prompt, entry) in enumerate(zip(prompts, images)):
        if entry is not None and not isinstance(entry, ImageInputs):
            raise EngineError(
                f"{engine}.generate: images[{index}] is a {type(entry).__name__}; expected ImageInputs or None"
            )
        if entry is not None and entry.num_images == 0:
            entry = None
        if image_token_id is not None:
            found = sum(1 for token in prompt if token == image_token_id)
            wanted = 0 if entry is None else int(image_token_counts(entry.grid_thw, merge_size).sum())
            if found != wanted:
                given = (
                    "no images were given for it"
                    if entry is None
                    else f"its {entry.num_images} image(s) of grids {entry.grid_thw.tolist()} need {wanted}"
                )
                raise EngineError(
                    f"{engine}.generate: prompt {index} holds {found} image tokens (id {image_token_id}) but "
                    f"{given}; prompts carry the expanded layout (VisionProcessor.render / expand)"
                )
        checked.append(entry)
    return checked


class Engine(abc.ABC):
    """A generation engine behind the token-in/token-out protocol.

    Subclasses implement `generate` and `max_model_len`, and override the optional features they
    have (`supports(feature)` says which, from FEATURES); the defaults raise EngineError naming
    the engine and the feature.
    """

    name = "Engine"
    policy_version: int = 0

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Context length: prompt plus response tokens."""

    @abc.abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        images: Sequence[ImageInputs | None] | None = None,
    ) -> list[list[Generation]]:
        """`params.n` responses for each prompt: result[i][j] is sample j of prompts[i].

        A response is cut so that prompt + response fits in `max_model_len` (finish reason
        "length"). Raises EngineError naming the prompt for an empty or over-long prompt.
        `images`: one `ImageInputs` or None per prompt (engines with `supports("images")`).
        """

    async def agenerate(
        self, prompt: Sequence[int], params: SamplingParams, images: ImageInputs | None = None
    ) -> list[Generation]:
        """The `params.n` responses to one prompt, for many concurrent callers (multi-turn agents).

        The default runs `generate` in a worker thread; engines with their own scheduler
        (vLLM's async engine, an HTTP server) override it so concurrent requests batch together.
        `images` (None for a text prompt) is passed on only when given.
        """
        if images is None:
            return (await asyncio.to_thread(self.generate, [prompt], params))[0]
        return (await asyncio.to_thread(self.generate, [prompt], params, [images]))[0]

    def supports(self, feature: str) -> bool:
        """Whether this engine has `feature` (one of FEATURES)."""
        if feature not in FEATURES:
            raise ValueError(f"{self.name}.supports: unknown feature {feature!r}; expected one of {FEATURES}")
        return False

    def _unsupported(self, feature: str) -> EngineError:
        return EngineError(f"{self.name} does not support {feature}")

    def init_weight_sync(self, spec: WeightSyncSpec, rank: int) -> None:
        """Join the weight-sync transport of `spec` as receiver `rank` (1 + offset among receivers)."""
        raise self._unsupported("weight_sync")

    def receive_weights(self, version: int, payload: Any = None) -> WeightSyncReport:
        """Receive and apply one sync; sets policy_version = `version`. `payload`: what the spec's
        transport takes from the sender for this sync (`rl_rollout.WeightReceiver.payload_type`, the
        `IpcPayload` of CUDA IPC), None for the others."""
        raise self._unsupported("weight_sync")

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory between rollouts (level 1: keep weights on CPU; 2: drop them)."""
        raise self._unsupported("sleep")

    def wake_up(self) -> None:
        """Undo `sleep`."""
        raise self._unsupported("sleep")

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes (needed after a weight update)."""
        raise self._unsupported("prefix_cache")

    def close(self) -> None:  # noqa: B027 - engines without resources have nothing to release
        """Release the engine's resources."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
