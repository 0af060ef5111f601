"""Tests of rl_algos.logprobs against log_softmax + gather and the entropy formula in float64."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_algos.logprobs import _row_blocks, default_chunk_size, entropy_from_logits, logprobs_from_logits

# --------------------------------------------------------------------------- references


def reference_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The naive code, in float64."""
    z = logits.double() / temperature
    return torch.log_softmax(z, -1).gather(-1, labels.long()[..., None]).squeeze(-1)


def reference_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logsumexp(z) − Σ softmax(z)·z, in float64."""
    z = logits.double() / temperature
    return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)


def grad_of(output: torch.Tensor, logits: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(output, logits, upstream.to(output.dtype))
    return grad


def reference_grad(reference, logits: torch.Tensor, upstream: torch.Tensor, *args) -> torch.Tensor:
    """Gradient of `reference(logits, *args)` at the logits' values, all in float64."""
    x = logits.detach().double().requires_grad_()
    return grad_of(reference(x, *args), x, upstream.double())


@st.composite
def problems(draw):
    """Random leading shape (0-3 dims, so 1-D to 4-D logits), vocab, chunk size and temperature."""
    lead = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=3)))
    vocab = draw(st.sampled_from([1, 2, 3, 7, 31, 97, 130, 257]))
    rows = math.prod(lead)
    chunk = draw(st.one_of(st.none(), st.integers(1, rows + 3)))
    temperature = draw(st.sampled_from([1.0, 0.3, 0.7, 1.6, 4.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(*lead, vocab, generator=generator)
    labels = torch.randint(0, vocab, lead, generator=generator)
    upstream = torch.randn(lead, generator=generator, dtype=torch.float64)
    return logits, labels, upstream, chunk, temperature


# --------------------------------------------------------------------------- values and gradients


@settings(max_examples=150, deadline=None)
@given(problem=problems())
def test_chunked_logprobs_equal_log_softmax_gather_for_random_shapes(problem):
    logits, labels, upstream, chunk, temperature = problem
    logits.requires_grad_()
    ours = logprobs_from_logits(logits, labels, temperature=temperature, chunk_size=chunk)
    expected = reference_logprobs(logits, labels, temperature)
    assert ours.dtype == torch.float32
    assert ours.shape == labels.shape
    torch.testing.assert_close(ours.double(), expected, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(
        grad_of(ours, logits, upstream).double(),
        reference_grad(reference_logprobs, logits, upstream, labels, temperature),
        atol=1e-5,
        rtol=1e-5,
    )


@settings(max_examples=150, deadline=None)
@given(problem=problems())
def test_chunked_entropy_equals_logsumexp_minus_expected_logit_for_random_shapes(problem):
    logits, _, upstream, chunk, temperature = problem
    logits.requires_grad_()
    ours = entropy_from_logits(logits, temperature=temperature, chunk_size=chunk)
    expected = reference_entropy(logits, temperature)
    assert ours.dtype == torch.float32
    assert ours.shape == logits.shape[:-1]
    torch.testing.assert_close(ours.double(), expected, atol=1e-5, rtol=1e-5)
    # ∂H/∂z_j = −π_j (log π_j + H) cancels where log π_j ≈ −H, so its float32 error scales with
    # the size of log π (up to |z|) times the upstream gradient and 1/temperature.
    z_max = float(logits.detach().abs().max()) / temperature if logits.numel() else 0.0
    g_max = float(upstream.abs().max()) if upstream.numel() else 0.0
    atol = max(1e-5, 16 * torch.finfo(torch.float32).eps * (1 + 2 * z_max) * g_max / temperature)
    torch.testing.assert_close(
        grad_of(ours, logits, upstream).double(),
        reference_grad(reference_entropy, logits, upstream, temperature),
        atol=atol,
        rtol=1e-5,
    )


def test_logprobs_at_temperature_one_are_bit_identical_to_the_naive_float32_code():
    generator = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 17, 1000, generator=generator)).bfloat16()
    labels = torch.randint(0, 1000, (3, 17), generator=generator)
    naive = torch.log_softmax(logits, -1, dtype=torch.float32).gather(-1, labels[..., None]).squeeze(-1)
    assert torch.equal(logprobs_from_logits(logits, labels, chunk_size=5), naive)


def test_chunk_size_changes_neither_values_nor_gradients():
    generator = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(4, 9, 50, generator=generator)).requires_grad_()
    labels = torch.randint(0, 50, (4, 9), generator=generator)
    upstream = torch.randn(4, 9, generator=generator)
    results = []
    for chunk in (1, 2, 7, 36, 1000, None):
        lp = logprobs_from_logits(logits, labels, temperature=0.8, chunk_size=chunk)
        h = entropy_from_logits(logits, temperature=0.8, chunk_size=chunk)
        results.append((lp, h, grad_of(lp, logits, upstream), grad_of(h, logits, upstream)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_give_float32_values_and_half_precision_gradients(dtype):
    generator = torch.Generator().manual_seed(2)
    logits = (3 * torch.randn(2, 11, 300, generator=generator)).to(dtype).requires_grad_()
    labels = torch.randint(0, 300, (2, 11), generator=generator)
    upstream = torch.randn(2, 11, generator=generator, dtype=torch.float64)

    lp = logprobs_from_logits(logits, labels, temperature=0.9, chunk_size=4)
    h = entropy_from_logits(logits, temperature=0.9, chunk_size=4)
    assert lp.dtype == h.dtype == torch.float32
    # The reference sees the same half-precision values, upcast: only float32 rounding differs.
    torch.testing.assert_close(lp.double(), reference_logprobs(logits, labels, 0.9), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(h.double(), reference_entropy(logits, 0.9), atol=1e-5, rtol=1e-5)

    for ours, exact in [
        (lp, reference_grad(reference_logprobs, logits, upstream, labels, 0.9)),
        (h, reference_grad(reference_entropy, logits, upstream, 0.9)),
    ]:
        grad = grad_of(ours, logits, upstream)
        assert grad.dtype == dtype
        assert grad.shape == logits.shape
        # Within the half-precision rounding of the exact gradient (relative 2^-8 for bf16).
        torch.testing.assert_close(grad.double(), exact, atol=1e-3, rtol=1e-2)


def test_float64_logits_are_computed_and_returned_in_float64():
    logits = torch.randn(3, 6, dtype=torch.float64)
    labels = torch.tensor([0, 5, 2])
    assert logprobs_from_logits(logits, labels).dtype == torch.float64
    assert entropy_from_logits(logits).dtype == torch.float64
    torch.testing.assert_close(logprobs_from_logits(logits, labels), reference_logprobs(logits, labels))


def test_gradcheck_in_float64_on_a_tiny_case():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3), generator=generator)
    assert torch.autograd.gradcheck(
        lambda x: logprobs_from_logits(x, labels, temperature=0.7, chunk_size=2), (logits,)
    )
    assert torch.autograd.gradcheck(
        lambda x: entropy_from_logits(x, temperature=1.3, chunk_size=4), (logits,)
    )


# --------------------------------------------------------------------------- special values


@pytest.mark.parametrize("vocab", [1, 2, 10, 151936])
def test_entropy_of_uniform_logits_is_log_vocab(vocab):
    logits = torch.full((3, vocab), 0.25)
    torch.testing.assert_close(entropy_from_logits(logits), torch.full((3,), math.log(vocab)))


def test_entropy_of_a_very_peaked_distribution_is_zero_and_has_zero_gradient():
    logits = torch.zeros(4, 1000)
    logits[torch.arange(4), torch.tensor([0, 7, 500, 999])] = 200.0
    logits.requires_grad_()
    h = entropy_from_logits(logits, chunk_size=3)
    assert float(h.detach().abs().max()) < 1e-6
    assert float(grad_of(h, logits, torch.ones(4)).abs().max()) < 1e-6


def test_log_prob_of_the_only_token_of_a_vocab_of_one_is_zero():
    logits = torch.randn(5, 1, requires_grad=True)
    lp = logprobs_from_logits(logits, torch.zeros(5, dtype=torch.long))
    assert torch.equal(lp, torch.zeros(5))
    assert torch.equal(grad_of(lp, logits, torch.randn(5)), torch.zeros(5, 1))


def test_masked_minus_inf_logits_count_as_absent_tokens_with_zero_gradient():
    generator = torch.Generator().manual_seed(4)
    kept = torch.randn(6, 20, generator=generator)
    logits = torch.cat([kept, torch.full((6, 12), -math.inf)], dim=-1).requires_grad_()
    labels = torch.randint(0, 20, (6,), generator=generator)
    upstream = torch.randn(6, generator=generator)

    lp = logprobs_from_logits(logits, labels, chunk_size=4)
    h = entropy_from_logits(logits, chunk_size=4)
    torch.testing.assert_close(lp.double(), reference_logprobs(kept, labels))
    torch.testing.assert_close(h.double(), reference_entropy(kept))
    for ours, kept_grad in [
        (lp, reference_grad(reference_logprobs, kept, upstream, labels)),
        (h, reference_grad(reference_entropy, kept, upstream)),
    ]:
        grad = grad_of(ours, logits, upstream)
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(grad[:, :20].double(), kept_grad, atol=1e-6, rtol=1e-5)
        assert torch.equal(grad[:, 20:], torch.zeros(6, 12))


def test_a_label_whose_logit_is_minus_inf_has_log_prob_minus_inf_and_a_finite_gradient():
    logits = torch.tensor([[0.0, 1.0, -math.inf], [2.0, -math.inf, 0.5]], requires_grad=True)
    labels = torch.tensor([2, 0])
    lp = logprobs_from_logits(logits, labels)
    assert lp[0] == -math.inf
    grad = grad_of(lp, logits, torch.ones(2))
    torch.testing.assert_close(grad, grad_of(reference_logprobs(logits, labels), logits, torch.ones(2)))


# --------------------------------------------------------------------------- layouts and autograd


def test_shifted_and_transposed_views_are_read_in_place_with_the_same_results():
    generator = torch.Generator().manual_seed(5)
    base = torch.randn(3, 8, 40, generator=generator, requires_grad=True)
    labels = torch.randint(0, 40, (3, 7), generator=generator)
    upstream = torch.randn(3, 7, generator=generator)
    shifted = base[:, :-1]  # the usual next-token shift: leading dims cannot be merged in a view
    assert not shifted.is_contiguous()
    for _, block in _row_blocks(shifted, chunk_size=4):
        assert block.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()

    for view, view_labels, view_upstream in [
        (shifted, labels, upstream),
        (shifted.transpose(0, 1), labels.T, upstream.T),
    ]:
        lp = logprobs_from_logits(view, view_labels, chunk_size=4)
        h = entropy_from_logits(view, chunk_size=4)
        torch.testing.assert_close(lp.double(), reference_logprobs(view, view_labels), atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(h.double(), reference_entropy(view), atol=1e-5, rtol=1e-6)
        for ours, expected in [(lp, reference_logprobs(view, view_labels)), (h, reference_entropy(view))]:
            torch.testing.assert_close(
                grad_of(ours, base, view_upstream),
                grad_of(expected, base, view_upstream),
                atol=1e-6,
                rtol=1e-5,
            )


def test_gradients_of_a_loss_using_both_functions_match_the_naive_loss():
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 5, 33, generator=generator, requires_grad=True)
    labels = torch.randint(0, 33, (2, 5), generator=generator)
    advantages = torch.randn(2, 5, generator=generator)
    ours = -(logprobs_from_logits(logits, labels, chunk_size=3) * advantages).mean()
    ours = ours - 0.01 * entropy_from_logits(logits, chunk_size=3).mean()
    naive = -(reference_logprobs(logits, labels) * advantages).mean()
    naive = naive - 0.01 * reference_entropy(logits).mean()
    ours.backward()
    ours_grad, logits.grad = logits.grad, None
    naive.backward()
    torch.testing.assert_close(ours_grad, logits.grad, atol=1e-6, rtol=1e-5)


def test_without_grad_no_autograd_graph_is_built():
    logits = torch.randn(4, 10)
    labels = torch.randint(0, 10, (4,))
    for out in (logprobs_from_logits(logits, labels), entropy_from_logits(logits)):
        assert out.grad_fn is None
        assert not out.requires_grad
    with torch.no_grad():
        trainable = logits.clone().requires_grad_()
        for out in (logprobs_from_logits(trainable, labels), entropy_from_logits(trainable)):
            assert out.grad_fn is None
            assert not out.requires_grad
    trainable = logits.clone().requires_grad_()
    for out in (logprobs_from_logits(trainable, labels), entropy_from_logits(trainable)):
        assert out.requires_grad
        assert out.grad_fn is not None


def test_editing_the_logits_in_place_after_the_forward_is_caught_by_autograd():
    logits = torch.randn(3, 10, requires_grad=True)
    scaled = logits * 2  # a non-leaf that can be modified in place
    lp = logprobs_from_logits(scaled, torch.tensor([1, 2, 3]))
    with torch.no_grad():
        scaled.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()


def test_one_dimensional_logits_give_a_scalar_and_int32_labels_work():
    logits = torch.randn(12)
    label = torch.tensor(4, dtype=torch.int32)
    lp = logprobs_from_logits(logits, label)
    assert lp.shape == ()
    torch.testing.assert_close(lp.double(), reference_logprobs(logits, label))
    assert entropy_from_logits(logits).shape == ()


def test_empty_batch_gives_empty_outputs_and_gradients():
    logits = torch.randn(0, 7, 5, requires_grad=True)
    labels = torch.zeros(0, 7, dtype=torch.long)
    lp = logprobs_from_logits(logits, labels)
    h = entropy_from_logits(logits)
    assert lp.shape == h.shape == (0, 7)
    assert grad_of(lp + h, logits, torch.zeros(0, 7)).shape == (0, 7, 5)


def test_default_chunk_size_is_a_few_mib_on_cpu_and_larger_on_accelerators():
    for vocab in (1, 1000, 32000, 151936, 10**7):
        rows = default_chunk_size(vocab)
        assert rows >= max(1, torch.get_num_threads())
        assert rows * vocab * 4 <= max(4 * 2**20, torch.get_num_threads() * vocab * 4)
        assert default_chunk_size(vocab, "cuda") >= 1
    assert default_chunk_size(151936, "cuda") > default_chunk_size(151936)


# --------------------------------------------------------------------------- bad arguments


def test_bad_arguments_raise_naming_the_argument():
    logits = torch.randn(2, 3, 5)
    labels = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(TypeError, match="logits must be a floating-point tensor"):
        logprobs_from_logits(torch.zeros(2, 3, 5, dtype=torch.long), labels)
    with pytest.raises(TypeError, match=r"logits must be a torch\.Tensor"):
        entropy_from_logits([[0.0, 1.0]])
    with pytest.raises(ValueError, match=r"logits must have shape \[\.\.\., vocab\]"):
        logprobs_from_logits(torch.tensor(1.0), torch.tensor(0))
    with pytest.raises(ValueError, match="logits must have a vocab dimension of size >= 1"):
        entropy_from_logits(torch.zeros(2, 0))
    with pytest.raises(TypeError, match="labels must be an integer tensor"):
        logprobs_from_logits(logits, labels.float())
    with pytest.raises(
        ValueError,
        match=r"labels must have shape logits\.shape\[:-1\] = \(2, 3\), got labels shape \(3, 2\) "
        r"for logits shape \(2, 3, 5\)",
    ):
        logprobs_from_logits(logits, labels.T)
    with pytest.raises(
        ValueError, match=r"labels must be token ids in \[0, 5\) \(vocab size .* = 5\), got 5"
    ):
        logprobs_from_logits(logits, torch.full((2, 3), 5))
    bad = labels.clone()
    bad[1, 2] = -1
    with pytest.raises(ValueError, match=r"labels .* got -1 at index \(1, 2\)"):
        logprobs_from_logits(logits, bad)
    for fn in (
        lambda **kw: logprobs_from_logits(logits, labels, **kw),
        lambda **kw: entropy_from_logits(logits, **kw),
    ):
        with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
            fn(temperature=0.0)
        with pytest.raises(ValueError, match="temperature must be > 0"):
            fn(temperature=-1.0)
        with pytest.raises(ValueError, match="temperature must be finite"):
            fn(temperature=math.inf)
        with pytest.raises(TypeError, match="temperature must be a number"):
            fn(temperature=math.nan)
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            fn(chunk_size=0)
        with pytest.raises(TypeError, match="chunk_size must be a positive int"):
            fn(chunk_size=2.0)
        with pytest.raises(TypeError, match="chunk_size must be a positive int"):
            fn(chunk_size=True)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_results_match_cpu(dtype):
    generator = torch.Generator().manual_seed(7)
    logits = (3 * torch.randn(3, 70, 3001, generator=generator)).to(dtype)
    labels = torch.randint(0, 3001, (3, 70), generator=generator)
    upstream = torch.randn(3, 70, generator=generator)
    results = {}
    for device in ("cpu", "cuda"):
        x = logits.to(device).requires_grad_()
        lp = logprobs_from_logits(x, labels.to(device), temperature=0.8, chunk_size=16)
        h = entropy_from_logits(x, temperature=0.8)
        results[device] = [
            t.cpu().float()
            for t in (lp, h, grad_of(lp, x, upstream.to(device)), grad_of(h, x, upstream.to(device)))
        ]
        assert lp.device.type == h.device.type == device
    grad_tol = (
        1e-5 if dtype == torch.float32 else 1e-2
    )  # float32 sums in another order: ~2e-6 apart on an H100
    for index, (cpu, cuda) in enumerate(zip(results["cpu"], results["cuda"])):
        tol = 1e-5 if index < 2 else grad_tol
        torch.testing.assert_close(cuda, cpu, atol=tol, rtol=tol)
