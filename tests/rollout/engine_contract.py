"""The contract every `rl_rollout.protocol.Engine` passes, as a base class of pytest tests.

To plug an engine in, subclass `EngineContract` in a test module, provide a class-scoped
`engine` fixture built on the tiny checkpoint, and declare the engine's capabilities:

    from tests.rollout.engine_contract import EngineContract

    class TestMyEngine(EngineContract):
        logprob_atol = 1e-4              # |engine log-prob - float64 reference| allowed per token
        supports_weight_sync = True      # the weight-update tests run (else: skipped,
                                         # and init_weight_sync must raise EngineError)
        weight_sync_transports = ("file", "shm")   # the in-process-sender transports it takes

        @pytest.fixture(scope="class")
        @classmethod
        def engine(cls, checkpoint):
            engine = MyEngine(checkpoint, dtype="float32")
            yield engine
            engine.close()

`checkpoint` is the folder the engine must load (the session's `tiny_checkpoint` unless a
subclass overrides the fixture). The contract builds its own float64 `transformers` model from
that folder as the reference, so the engine must hold exactly those weights (float32 engines
match to ~1e-5; lower precisions declare a larger `logprob_atol`).

What the contract pins, for every engine:
- shapes: `params.n` generations per prompt, in prompt order; greedy n > 1 gives n equal copies;
- greedy decoding is deterministic and consistent with the reference: each greedy token is the
  reference's argmax (up to near ties within 2 · logprob_atol);
- token ids lie in the vocabulary; log-probs are finite, ≤ 0 and equal log softmax(z / T) of the
  reference forward pass at the sampled tokens (T = 1 when greedy) within `logprob_atol`;
- seeded sampling is reproducible and different seeds / samples differ; prompts that share a
  seed draw independent samples (`prompt_seed`); `logprobs=False` gives None;
- `max_new_tokens` ends with "length"; EOS and `stop_token_ids` end with "stop", the stop token
  kept as the last token; `ignore_eos` runs through EOS; `min_new_tokens` suppresses stop tokens;
- stop strings cut the response after the token that completes the match (finish "stop");
- an empty or over-long prompt raises EngineError naming its index; a prompt close to the context
  length gets a response cut to fit, with "length";
- `agenerate` from many concurrent callers gives what `generate` gives for greedy;
- weight sync (when supported), through every transport in `weight_sync_transports` whose
  sender can live in the test process ("file": `rl_data.sync.file.write_buckets`; "shm": an
  `rl_data.sync.shm.ShmPublisher`, the engine's receiver in its own worker process for vLLM):
  weights sent and applied with `receive_weights` change greedy outputs to those of the
  reference with the new weights, set `policy_version` (also on generations) and report the
  sender's checksums; a sender with another layout is refused. The test restores the original
  weights (as the next version) afterwards, so the class-scoped engine serves the other tests
  unchanged whatever the order (with "shm" that third version reuses the first one's slot).

- partial rollout (when `supports_partial_rollout`): a `receive_weights` from another thread while
  a greedy `generate` runs lands between two decoding steps; every response still has all the
  tokens its budget allowed, its versions are the old one up to a boundary and the new one after
  it, the tokens before the boundary carry the old weights' log-probs (and argmaxes) and the
  ones after the new weights' teacher-forced log-probs over prompt + every token before them
  (the in-flight KV cache was recomputed, not mixed). Engines that lack it say so through
  `supports("partial_rollout")`.

Engines need a weight-sync receiver that accepts `init_weight_sync` more than once (each call
replaces the previous receiver), because every weight test joins its own file transport.
"""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch

from rl_data import compare_checksums, pack_bucket, plan_buckets
from rl_data.sync import WeightSyncError, WeightSyncSpec
from rl_data.sync.file import write_buckets
from rl_data.sync.shm import ShmPublisher, shm_directory
from rl_rollout.protocol import Engine, EngineError, Generation, SamplingParams

__all__ = ["CONTRACT_TEXTS", "EngineContract", "reference_logprobs"]

# Prompts of different lengths (so batches need padding), as text; the contract tokenizes them.
CONTRACT_TEXTS = (
    "What is 3 + 4?",
    "The quick brown fox jumps over the lazy dog while the cat sleeps",
    "Hello!",
    "A language model predicts the next token given all the tokens before it.",
)


def reference_logprobs(
    model, prompt: list[int], response: list[int], temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced log softmax(z / T) of `model` over the response positions.

    Returns (`[R]` log-probs of the response tokens, `[R, V]` full log-prob rows), in the
    model's dtype (float64 for the contract's reference).
    """
    ids = torch.tensor([prompt + response], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    rows = torch.log_softmax(logits.double() / (temperature or 1.0), dim=-1)
    return rows.gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1), rows


def _ids(generations: list[list[Generation]]) -> list[list[list[int]]]:
    return [[sample.token_ids for sample in per_prompt] for per_prompt in generations]


class EngineContract:
    """Contract tests for one engine; subclasses provide the `engine` fixture (see the module docstring)."""

    logprob_atol: float = 1e-4
    supports_weight_sync: bool = False
    supports_partial_rollout: bool = False
    weight_sync_transports: tuple[str, ...] = ("file", "shm")
    # rank the engine's receiver takes in the file transport (file transport ignores it, but engines check it)
    weight_sync_rank: int = 1

    # --- fixtures -------------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tiny_checkpoint):
        """The folder the engine loads; the contract's reference model is built from it."""
        return tiny_checkpoint

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, checkpoint) -> Engine:
        raise NotImplementedError("an EngineContract subclass must provide a class-scoped `engine` fixture")

    @pytest.fixture(scope="class")
    @classmethod
    def reference(cls, checkpoint):
        """The checkpoint as a float64 transformers model, the ground truth for log-probs."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
        return model.eval()

    @pytest.fixture(scope="class")
    @classmethod
    def contract_tokenizer(cls, checkpoint):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(checkpoint)

    @pytest.fixture(scope="class")
    @classmethod
    def prompts(cls, contract_tokenizer) -> list[list[int]]:
        return [contract_tokenizer(text)["input_ids"] for text in CONTRACT_TEXTS]

    @pytest.fixture(scope="class")
    @classmethod
    def greedy_run(cls, engine, prompts) -> list[Generation]:
        """One greedy generation per prompt, 24 tokens, through EOS (the baseline of several tests)."""
        params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
        return [per_prompt[0] for per_prompt in engine.generate(prompts, params)]

    # --- helpers --------------------------------------------------------------------------------

    def assert_matches_reference(self, model, prompt, generation, temperature=0.0, where=""):
        """Log-probs equal the reference's within logprob_atol; greedy tokens are its argmax (up to ties)."""
        assert generation.logprobs is not None, f"{where}: logprobs requested but None returned"
        expected, rows = reference_logprobs(model, prompt, generation.token_ids, temperature)
        got = torch.tensor(generation.logprobs, dtype=torch.float64)
        error = (got - expected).abs().max().item() if len(got) else 0.0
        assert error <= self.logprob_atol, (
            f"{where}: log-probs differ from the float64 reference by up to {error:.3g} "
            f"(allowed {self.logprob_atol:g}); engine {got.tolist()[:6]}..., reference {expected.tolist()[:6]}..."
        )
        if temperature == 0:
            gap = (rows.max(dim=-1).values - expected).max().item() if len(got) else 0.0
            assert gap <= 2 * self.logprob_atol, (
                f"{where}: a greedy token is {gap:.3g} below the reference's best token (not an argmax)"
            )

    # --- shapes and determinism -----------------------------------------------------------------

    def test_returns_n_generations_per_prompt_in_prompt_order(self, engine, prompts):
        params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
        forward = engine.generate(prompts, params)
        backward = engine.generate(prompts[::-1], params)
        assert [len(per_prompt) for per_prompt in forward] == [1] * len(prompts)
        assert _ids(backward) == _ids(forward)[::-1]
        sampled = engine.generate(prompts[:2], SamplingParams(temperature=1.0, n=3, max_new_tokens=5, seed=1))
        assert [len(per_prompt) for per_prompt in sampled] == [3, 3]
        assert all(isinstance(sample, Generation) for per_prompt in sampled for sample in per_prompt)

    def test_greedy_is_deterministic(self, engine, prompts, greedy_run):
        params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
        again = engine.generate(prompts, params)
        assert [per_prompt[0].token_ids for per_prompt in again] == [g.token_ids for g in greedy_run]

    def test_greedy_with_n_gives_n_equal_samples(self, engine, prompts, greedy_run):
        params = SamplingParams(temperature=0.0, n=3, max_new_tokens=24, ignore_eos=True)
        result = engine.generate(prompts[:1], params)[0]
        assert [sample.token_ids for sample in result] == [greedy_run[0].token_ids] * 3

    def test_token_ids_are_inside_the_vocabulary(self, engine, prompts, reference):
        vocab = reference.config.vocab_size
        result = engine.generate(prompts, SamplingParams(temperature=1.0, n=4, max_new_tokens=16, seed=3))
        tokens = [token for per_prompt in result for sample in per_prompt for token in sample.token_ids]
        assert tokens
        assert all(isinstance(token, int) and 0 <= token < vocab for token in tokens)

    def test_generations_carry_the_engine_policy_version(self, engine, prompts):
        result = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=2))
        assert result[0][0].policy_version == engine.policy_version

    # --- log-probs ------------------------------------------------------------------------------

    def test_greedy_logprobs_match_the_teacher_forced_reference(self, engine, prompts, greedy_run, reference):
        for index, (prompt, generation) in enumerate(zip(prompts, greedy_run)):
            assert len(generation.token_ids) == 24
            assert all(math.isfinite(value) and value <= 0 for value in generation.logprobs)
            self.assert_matches_reference(reference, prompt, generation, 0.0, where=f"prompt {index}")

    @pytest.mark.parametrize("temperature", [0.7, 1.3])
    def test_sampled_logprobs_are_of_the_temperature_scaled_distribution(
        self, engine, prompts, reference, temperature
    ):
        params = SamplingParams(temperature=temperature, n=2, max_new_tokens=12, seed=11, ignore_eos=True)
        result = engine.generate(prompts[:2], params)
        for index, (prompt, per_prompt) in enumerate(zip(prompts, result)):
            for sample_index, sample in enumerate(per_prompt):
                assert all(math.isfinite(value) and value <= 0 for value in sample.logprobs)
                self.assert_matches_reference(
                    reference, prompt, sample, temperature, where=f"prompt {index} sample {sample_index}"
                )

    def test_logprobs_false_returns_none(self, engine, prompts):
        result = engine.generate(
            prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=3, logprobs=False)
        )
        assert result[0][0].logprobs is None
        assert len(result[0][0].token_ids) >= 1

    # --- sampling -------------------------------------------------------------------------------

    def test_seeded_sampling_is_reproducible_and_seeds_differ(self, engine, prompts):
        params = SamplingParams(temperature=1.0, n=2, max_new_tokens=16, seed=1234, ignore_eos=True)
        first = engine.generate(prompts[:2], params)
        second = engine.generate(prompts[:2], params)
        assert _ids(first) == _ids(second)
        other = engine.generate(prompts[:2], SamplingParams(temperature=1.0, n=2, max_new_tokens=16, seed=99))
        assert _ids(other) != _ids(first)

    def test_prompts_that_share_a_seed_draw_independent_samples(self, engine, prompts):
        # The tiny model is close to uniform over ~500 tokens: drawn with the same noise, two
        # prompts' samples would agree at (nearly) every position; drawn independently, at ~1 in 500.
        params = SamplingParams(temperature=1.0, n=2, max_new_tokens=16, seed=7, ignore_eos=True)
        first, second = engine.generate(prompts[:2], params)
        for j, (a, b) in enumerate(zip(first, second, strict=True)):
            same = sum(x == y for x, y in zip(a.token_ids, b.token_ids))
            assert same <= 4, f"sample {j}: {same} of 16 tokens equal across two prompts with seed 7"

    def test_samples_of_one_prompt_differ(self, engine, prompts):
        params = SamplingParams(temperature=1.0, n=4, max_new_tokens=16, seed=5, ignore_eos=True)
        samples = engine.generate(prompts[:1], params)[0]
        assert len({tuple(sample.token_ids) for sample in samples}) > 1

    # --- ending a response ----------------------------------------------------------------------

    def test_max_new_tokens_ends_with_length(self, engine, prompts):
        result = engine.generate(
            prompts, SamplingParams(temperature=1.0, max_new_tokens=5, seed=2, ignore_eos=True)
        )
        for per_prompt in result:
            assert len(per_prompt[0].token_ids) == 5
            assert per_prompt[0].finish_reason == "length"

    def test_stop_token_id_ends_with_stop_and_keeps_the_token(self, engine, prompts, greedy_run):
        baseline = greedy_run[0].token_ids
        stop_token = baseline[2]
        cut = baseline.index(stop_token) + 1
        params = SamplingParams(
            temperature=0.0, max_new_tokens=24, stop_token_ids=(stop_token,), ignore_eos=True
        )
        generation = engine.generate(prompts[:1], params)[0][0]
        assert generation.token_ids == baseline[:cut]
        assert generation.finish_reason == "stop"
        assert len(generation.logprobs) == cut

    def test_min_new_tokens_suppresses_stop_tokens(self, engine, prompts, greedy_run):
        baseline = greedy_run[0].token_ids
        stop_token = baseline[0]
        params = SamplingParams(
            temperature=0.0,
            max_new_tokens=12,
            min_new_tokens=4,
            stop_token_ids=(stop_token,),
            ignore_eos=True,
        )
        generation = engine.generate(prompts[:1], params)[0][0]
        assert stop_token not in generation.token_ids[:4]
        assert len(generation.token_ids) >= 4
        if generation.finish_reason == "stop":
            assert generation.token_ids[-1] == stop_token
        else:
            assert len(generation.token_ids) == 12

    def test_eos_ends_with_stop_and_ignore_eos_runs_through_it(self, engine, prompts, contract_tokenizer):
        # The tiny model is close to uniform over ~500 tokens, so ~1 in 400 sampled tokens is EOS:
        # 4 prompts x 32 samples x 32 tokens hit it ~10 times. Each prompt gets its own seed, since
        # engines that derive sample j's noise from seed + j would reuse it across prompts.
        eos = contract_tokenizer.eos_token_id
        stopped, through = [], []
        for index, prompt in enumerate(prompts):
            params = SamplingParams(temperature=1.0, n=32, max_new_tokens=32, seed=1000 * (index + 1))
            stopped += engine.generate([prompt], params)[0]
            through += engine.generate([prompt], msgspec_replace(params, ignore_eos=True))[0]
        ended_on_eos = 0
        for index, (sample, long_sample) in enumerate(zip(stopped, through)):
            assert (len(long_sample.token_ids), long_sample.finish_reason) == (32, "length")
            if eos in sample.token_ids:
                ended_on_eos += 1
                assert sample.token_ids.index(eos) == len(sample.token_ids) - 1, f"sample {index}: EOS inside"
                assert sample.finish_reason == "stop", f"sample {index}"
                assert long_sample.token_ids[: len(sample.token_ids)] == sample.token_ids, f"sample {index}"
            else:
                assert (len(sample.token_ids), sample.finish_reason) == (32, "length"), f"sample {index}"
                assert long_sample.token_ids == sample.token_ids, f"sample {index}"
        assert ended_on_eos > 0, "no sample reached EOS; the EOS path was not exercised"
        assert any(eos in sample.token_ids[:-1] for sample in through), "ignore_eos never ran through an EOS"

    def _stop_string_case(self, tokenizer, greedy_run, spanning: bool):
        """A stop string found in a greedy response and the prefix length that completes it."""

        def decoded(ids, skip):
            return tokenizer.decode(ids, skip_special_tokens=skip)

        def ascii_word(text):
            return text.isascii() and text.strip() and text.isprintable()

        for prompt_index, generation in enumerate(greedy_run):
            ids = generation.token_ids
            for position in range(2, len(ids) - 1):
                piece, before = tokenizer.decode([ids[position]]), tokenizer.decode([ids[position - 1]])
                if not ascii_word(piece) or (spanning and not ascii_word(before)):
                    continue
                if (
                    ids[position] in tokenizer.all_special_ids
                    or ids[position - 1] in tokenizer.all_special_ids
                ):
                    continue
                stop = (before[-1] + piece[0]) if spanning else piece[: max(1, min(2, len(piece) - 1))]
                if not stop.strip():
                    continue
                cuts = set()
                for skip in (True, False):
                    cuts.add(next(k for k in range(1, len(ids) + 1) if stop in decoded(ids[:k], skip)))
                if len(cuts) == 1 and 1 < (cut := cuts.pop()) < len(ids):
                    return prompt_index, stop, cut
        pytest.fail(f"no usable {'spanning ' if spanning else ''}stop string in the greedy responses")

    @pytest.mark.parametrize("spanning", [False, True], ids=["inside-a-token", "across-tokens"])
    def test_stop_string_cuts_after_the_completing_token(
        self, engine, prompts, greedy_run, contract_tokenizer, spanning
    ):
        prompt_index, stop, cut = self._stop_string_case(contract_tokenizer, greedy_run, spanning)
        params = SamplingParams(temperature=0.0, max_new_tokens=24, stop=(stop,), ignore_eos=True)
        generation = engine.generate([prompts[prompt_index]], params)[0][0]
        assert generation.token_ids == greedy_run[prompt_index].token_ids[:cut], f"stop string {stop!r}"
        assert generation.finish_reason == "stop"
        assert len(generation.logprobs) == cut

    # --- prompts and the context ----------------------------------------------------------------

    def test_empty_prompt_raises_naming_its_index(self, engine, prompts):
        with pytest.raises(EngineError, match="prompt 1 is empty"):
            engine.generate([prompts[0], []], SamplingParams(max_new_tokens=2))

    def test_overlong_prompt_raises_naming_its_index(self, engine, prompts):
        too_long = (prompts[1] * engine.max_model_len)[: engine.max_model_len]
        with pytest.raises(EngineError, match="prompt 2 has"):
            engine.generate([prompts[0], prompts[1], too_long], SamplingParams(max_new_tokens=2))

    def test_prompt_near_the_context_length_is_cut_with_length(self, engine, prompts):
        room = 3
        long_prompt = (prompts[1] * engine.max_model_len)[: engine.max_model_len - room]
        params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
        result = engine.generate([long_prompt, prompts[0]], params)
        assert len(result[0][0].token_ids) == room
        assert result[0][0].finish_reason == "length"
        assert len(result[1][0].token_ids) == 10

    # --- async ------------------------------------------------------------------------------------

    def test_concurrent_agenerate_matches_generate_for_greedy(self, engine, prompts):
        many = [
            prompt[: max(1, len(prompt) - shift)] for shift in range(3) for prompt in prompts
        ]  # 12 prompts
        params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
        expected = engine.generate(many, params)

        async def run_all():
            return await asyncio.gather(*(engine.agenerate(prompt, params) for prompt in many))

        got = asyncio.run(run_all())
        assert _ids(list(got)) == _ids(expected)
        for index, (mine, theirs) in enumerate(zip(got, expected)):
            diff = max(abs(a - b) for a, b in zip(mine[0].logprobs, theirs[0].logprobs))
            assert diff <= self.logprob_atol, f"prompt {index}: agenerate log-probs differ by {diff:.3g}"

    # --- weight sync ------------------------------------------------------------------------------

    def test_supports_weight_sync_as_declared(self, engine, reference, tmp_path):
        assert engine.supports("weight_sync") is self.supports_weight_sync
        if not self.supports_weight_sync:
            spec = _file_spec(reference, tmp_path)
            with pytest.raises(EngineError, match="weight_sync"):
                engine.init_weight_sync(spec, self.weight_sync_rank)

    @pytest.mark.parametrize("transport", ["file", "shm"])
    def test_weight_update_through_each_transport(
        self, engine, prompts, greedy_run, reference, tmp_path, transport
    ):
        if not self.supports_weight_sync or transport not in self.weight_sync_transports:
            pytest.skip(f"{type(engine).__name__} declares no weight sync over {transport!r}")
        original = {name: param.detach().float().clone() for name, param in reference.named_parameters()}
        generator = torch.Generator().manual_seed(0)
        perturbed = {
            name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
            for name, tensor in original.items()
        }
        spec, write, close = _sender(transport, _layout(reference), tmp_path)
        engine.init_weight_sync(spec, self.weight_sync_rank)
        version = engine.policy_version + 1
        params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
        try:
            sent = write(perturbed, version)
            report = engine.receive_weights(version)
            assert report.version == version
            assert compare_checksums(sent, report) == []
            assert engine.policy_version == version
            updated = copy.deepcopy(reference)
            updated.load_state_dict(
                {name: tensor.double() for name, tensor in perturbed.items()}, strict=False
            )
            result = [per_prompt[0] for per_prompt in engine.generate(prompts, params)]
            assert [g.token_ids for g in result] != [g.token_ids for g in greedy_run], "weights had no effect"
            for index, (prompt, generation) in enumerate(zip(prompts, result)):
                assert generation.policy_version == version
                self.assert_matches_reference(
                    updated, prompt, generation, 0.0, where=f"new weights, prompt {index}"
                )
        finally:
            try:
                write(original, version + 1)
                engine.receive_weights(version + 1)
            finally:
                close()
        assert engine.policy_version == version + 1
        restored = [per_prompt[0] for per_prompt in engine.generate(prompts, params)]
        assert [g.token_ids for g in restored] == [g.token_ids for g in greedy_run]
        assert all(g.policy_version == version + 1 for g in restored)

    @pytest.mark.parametrize("transport", ["file", "shm"])
    def test_weight_update_with_a_mismatched_layout_raises(self, engine, reference, tmp_path, transport):
        if not self.supports_weight_sync or transport not in self.weight_sync_transports:
            pytest.skip(f"{type(engine).__name__} declares no weight sync over {transport!r}")
        names = [name for name, _ in reference.named_parameters()]
        # A sender whose layout differs (one parameter left out) writes a version this receiver rejects.
        smaller = plan_buckets(
            (
                (name, torch.float32, param.shape)
                for name, param in reference.named_parameters()
                if name != names[-1]
            ),
            bucket_bytes=1 << 16,
        )
        state = {name: param.detach().float() for name, param in reference.named_parameters()}
        # the engine expects the full layout; the sender in its folder writes the smaller one
        spec, _, _ = _sender(transport, _layout(reference), tmp_path, start=False)
        engine.init_weight_sync(spec, self.weight_sync_rank)
        version = engine.policy_version
        _, write, close = _sender(transport, smaller, tmp_path, directory=spec.directory)
        try:
            write(state, version + 1)
            with pytest.raises((EngineError, WeightSyncError), match="layout"):
                engine.receive_weights(version + 1)
        finally:
            close()
        assert engine.policy_version == version

    def test_init_weight_sync_with_a_wrong_shape_names_the_parameter_and_both_shapes(
        self, engine, reference, tmp_path
    ):
        if not self.supports_weight_sync or "file" not in self.weight_sync_transports:
            pytest.skip(f"{type(engine).__name__} declares no weight sync over 'file'")
        name, param = next(iter(reference.named_parameters()))
        wrong = (param.shape[0] + 1, *param.shape[1:])
        layout = plan_buckets(
            ((n, torch.float32, wrong if n == name else p.shape) for n, p in reference.named_parameters()),
            bucket_bytes=1 << 16,
        )
        spec = WeightSyncSpec(transport="file", layout=layout, directory=str(tmp_path))
        with pytest.raises(EngineError) as raised:
            engine.init_weight_sync(spec, self.weight_sync_rank)
        message = str(raised.value)
        assert repr(name) in message
        assert str(list(wrong)) in message
        assert str(list(param.shape)) in message

    # --- partial rollout ------------------------------------------------------------------------

    def test_supports_partial_rollout_as_declared(self, engine):
        assert engine.supports("partial_rollout") is self.supports_partial_rollout

    def test_weight_sync_mid_request_keeps_every_token_and_versions_each(
        self, engine, prompts, greedy_run, reference, tmp_path
    ):
        if not self.supports_partial_rollout:
            pytest.skip(
                f"{type(engine).__name__} declares no partial rollout (supports('partial_rollout') is False)"
            )
        import threading
        import time

        original = {name: param.detach().float().clone() for name, param in reference.named_parameters()}
        generator = torch.Generator().manual_seed(1)
        perturbed = {
            name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator)
            for name, tensor in original.items()
        }
        models = {"original": reference, "perturbed": copy.deepcopy(reference)}
        models["perturbed"].load_state_dict({n: t.double() for n, t in perturbed.items()}, strict=False)
        spec, write, close = _sender("file", _layout(reference), tmp_path)
        engine.init_weight_sync(spec, self.weight_sync_rank)
        budget = 64
        params = SamplingParams(temperature=0.0, max_new_tokens=budget, ignore_eos=True)
        started = time.perf_counter()
        engine.generate(prompts, params)
        seconds = time.perf_counter() - started  # how long a request runs: when to sync
        held, boundaries = "original", []
        try:
            for attempt in range(4):  # a sync that lands before or after every request is retried
                old, new = held, ("perturbed" if held == "original" else "original")
                old_version, new_version = engine.policy_version, engine.policy_version + 1
                write(perturbed if new == "perturbed" else original, new_version)
                result: list = []
                thread = threading.Thread(
                    target=lambda out=result: out.append(engine.generate(prompts, params))
                )
                thread.start()
                time.sleep(seconds * (0.3 + 0.1 * attempt))
                engine.receive_weights(new_version)
                held = new
                thread.join(timeout=120)
                assert result, "generate did not return"
                boundaries = []
                for index, (prompt, [generation]) in enumerate(zip(prompts, result[0])):
                    where = f"attempt {attempt}, prompt {index}"
                    assert len(generation.token_ids) == budget, f"{where}: tokens lost at the sync"
                    versions = generation.versions()
                    boundary = versions.count(old_version)
                    assert versions == [old_version] * boundary + [new_version] * (budget - boundary), where
                    assert generation.policy_version == versions[0], where
                    assert (generation.token_versions is None) == (boundary in (0, budget)), where
                    for name, part in ((old, slice(0, boundary)), (new, slice(boundary, budget))):
                        expected, rows = reference_logprobs(models[name], prompt, generation.token_ids)
                        got = torch.tensor(generation.logprobs, dtype=torch.float64)[part]
                        error = (got - expected[part]).abs().max().item() if len(got) else 0.0
                        assert error <= self.logprob_atol, (
                            f"{where}: tokens {part.start}..{part.stop} are version {versions[part.start]}'s "
                            f"but their log-probs differ from the {name} weights' by {error:.3g}"
                        )
                        gap = (rows.max(dim=-1).values - expected)[part]
                        assert len(gap) == 0 or gap.max().item() <= 2 * self.logprob_atol, where
                    if old == "original":  # before the sync: what the engine decodes without one
                        known = min(boundary, len(greedy_run[index].token_ids))
                        assert generation.token_ids[:known] == greedy_run[index].token_ids[:known], where
                    boundaries.append(boundary)
                if any(0 < boundary < budget for boundary in boundaries):
                    break
            assert any(0 < boundary < budget for boundary in boundaries), (
                f"no sync landed mid-request in 4 attempts (boundaries {boundaries})"
            )
        finally:
            if held != "original":
                write(original, engine.policy_version + 1)
                engine.receive_weights(engine.policy_version + 1)
            close()
        restored = [per_prompt[0] for per_prompt in engine.generate(prompts, params)]
        assert [g.token_ids[:24] for g in restored] == [g.token_ids for g in greedy_run]


def msgspec_replace(params: SamplingParams, **changes) -> SamplingParams:
    import msgspec

    return msgspec.structs.replace(params, **changes)


def _layout(reference):
    return plan_buckets(
        ((name, torch.float32, param.shape) for name, param in reference.named_parameters()),
        bucket_bytes=1 << 16,
    )


def _file_spec(reference, directory) -> WeightSyncSpec:
    return WeightSyncSpec(transport="file", layout=_layout(reference), directory=str(directory))


def _sender(transport: str, layout, tmp_path, *, directory: str | None = None, start: bool = True):
    """(spec, write(tensors, version) -> report, close()) of an in-process sender over `transport`.

    "file" writes under tmp_path; "shm" publishes from an `ShmPublisher` in a fresh folder under
    /dev/shm (or `directory`), created only when `start`.
    """
    if transport == "file":
        spec = WeightSyncSpec(transport="file", layout=layout, directory=directory or str(tmp_path))

        def write(tensors, version):
            return write_buckets(
                spec.directory, layout, lambda b, out: pack_bucket(b, tensors, out=out), version=version
            )

        return spec, write, lambda: None
    spec = WeightSyncSpec(
        transport="shm", layout=layout, directory=directory or shm_directory(), timeout_s=60
    )
    if not start:
        return spec, None, lambda: None
    publisher = ShmPublisher(spec.directory, layout, timeout_s=60)

    def publish(tensors, version):
        return publisher.publish(lambda b, out: pack_bucket(b, tensors, out=out), version=version)

    return spec, publish, publisher.close
