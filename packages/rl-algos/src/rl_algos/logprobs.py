"""Token log-probabilities and entropies from logits, chunked over rows to bound memory.

Given logits z = logits / temperature over a vocabulary of V tokens,

    log π(a | s) = z_a − logsumexp(z),
    H(π(· | s)) = logsumexp(z) − Σ_j softmax(z)_j · z_j = −Σ_j π_j log π_j.

The textbook code, ``torch.log_softmax(logits, -1, dtype=torch.float32).gather(-1, labels[..., None])``,
materialises float32 `[batch, seq, vocab]` tensors (on CPU a float32 copy of the logits and the
log-softmax) to keep one number per token, and autograd keeps the log-softmax alive for the
backward pass. With a Qwen-size vocabulary (V = 151,936), batch 4 and 4,096 tokens per row, the
bf16 logits take 5.0 GB and every float32 tensor of their shape 10.0 GB. Measured on CPU with
bf16 logits (benchmarks/chunked_logprobs.py), the naive code needs 3.8x the logits' size on top
of them for the forward pass (19 GB at that size) and 5.7x for forward + backward (29 GB),
where the answer is 64 KB.

Here the flattened rows are processed `chunk_size` rows at a time: each chunk is upcast to
float32 into a reused buffer and reduced, so the extra memory is O(chunk_size · V) instead of
O(rows · V). The backward pass is written by hand (a `torch.autograd.Function`): it saves only
a reference to the logits, the labels and one float32 logsumexp per row, and recomputes the
softmax of each chunk when the gradient is asked for. The only full-size tensor it allocates is
the gradient itself, in the logits' dtype. Measured as above: a few MB for the forward pass,
1.0x the logits' size (the gradient) for forward + backward, and 3-6x faster than the naive
code on CPU, where a chunk that stays in cache makes the passes over it cheap. Values equal
those of the naive code to float32 rounding (the log-probabilities come from the same
`log_softmax` kernel, so they are usually bit-identical).

Outputs are float32 whatever the logits' dtype (bf16, fp16, fp32), except that float64 logits
are computed and returned in float64 (for `torch.autograd.gradcheck`). Gradients have the
logits' dtype and shape.

By default the chunk is sized in bytes rather than rows: about 4 MiB of float32 per chunk on
CPU (cache-sized) and 256 MiB on accelerators, where larger kernels amortise the launch cost.
See `default_chunk_size`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

from ._checks import check_floating, check_integer, check_positive, first_flagged

__all__ = ["default_chunk_size", "entropy_from_logits", "logprobs_from_logits"]

CPU_CHUNK_BYTES = 4 * 2**20
"""Float32 bytes per chunk on CPU: a chunk and its log-softmax stay in a typical L3 cache."""

ACCELERATOR_CHUNK_BYTES = 256 * 2**20
"""Float32 bytes per chunk on CUDA and other accelerators: big kernels, a few dozen launches."""


def default_chunk_size(vocab: int, device: torch.device | str = "cpu") -> int:
    """Rows per chunk used when `chunk_size` is None.

    About `CPU_CHUNK_BYTES` (4 MiB) of float32 per chunk on CPU, but at least one row per
    thread so that the row-parallel softmax kernels keep every core busy; about
    `ACCELERATOR_CHUNK_BYTES` (256 MiB) elsewhere. For V = 151,936 that is 6 rows (or the
    thread count) on CPU and 441 rows on a GPU; for V = 32,000, 32 and 2,097 rows.

    Args:
      vocab: the vocabulary size V, logits.shape[-1].
      device: where the logits live.

    Returns:
      A positive number of rows.
    """
    row_bytes = max(1, vocab) * 4
    if torch.device(device).type == "cpu":
        return max(CPU_CHUNK_BYTES // row_bytes, torch.get_num_threads(), 1)
    return max(ACCELERATOR_CHUNK_BYTES // row_bytes, 1)


# --------------------------------------------------------------------------- argument checks


def _check_logits(logits: torch.Tensor) -> int:
    check_floating("logits", logits)
    if logits.dim() < 1:
        raise ValueError("logits must have shape [..., vocab] (at least 1 dim), got a 0-d tensor")
    vocab = logits.shape[-1]
    if vocab < 1:
        raise ValueError(f"logits must have a vocab dimension of size >= 1, got shape {tuple(logits.shape)}")
    return vocab


def _check_options(logits: torch.Tensor, temperature: float, chunk_size: int | None) -> tuple[float, int]:
    temperature = check_positive("temperature", temperature)
    if math.isinf(temperature):
        raise ValueError(f"temperature must be finite, got {temperature}")
    if chunk_size is None:
        return temperature, default_chunk_size(logits.shape[-1], logits.device)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be a positive int (rows per chunk) or None, got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (rows per chunk), got {chunk_size}")
    return temperature, chunk_size


def _check_labels(labels: torch.Tensor, logits: torch.Tensor, vocab: int) -> None:
    check_integer("labels", labels)
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, got labels shape "
            f"{tuple(labels.shape)} for logits shape {tuple(logits.shape)}"
        )
    if labels.device != logits.device:
        raise ValueError(f"labels is on {labels.device} but logits is on {logits.device}")
    # One host sync per call, on a per-token (not per-vocab) tensor: an out-of-range label would
    # otherwise be an opaque index error on CPU and a device-side assert on CUDA.
    bad = (labels < 0) | (labels >= vocab)
    if bool(bad.any()):
        index, where = first_flagged(bad)
        raise ValueError(
            f"labels must be token ids in [0, {vocab}) (vocab size = logits.shape[-1] = {vocab}), "
            f"got {int(labels[index])} at index {where} ({int(bad.sum())} out of range)"
        )


# --------------------------------------------------------------------------- chunk helpers


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _row_blocks(x: torch.Tensor, chunk_size: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Yield (first flat row, `[rows, vocab]` view) over the rows of `x`, in row-major order.

    Never copies: when the leading dims cannot be merged into one view (e.g. the shifted
    ``logits[:, :-1]`` of a contiguous `[batch, seq, vocab]` tensor, which `reshape` would
    copy in full) the first dim is walked and the chunks stop at its boundaries.
    """
    vocab = x.shape[-1]
    try:
        flat = x.view(-1, vocab)
    except RuntimeError:
        flat = None
    if flat is not None:
        for start in range(0, flat.shape[0], chunk_size):
            yield start, flat[start : start + chunk_size]
        return
    rows_per_item = math.prod(x.shape[1:-1])
    for i in range(x.shape[0]):
        for start, block in _row_blocks(x[i], chunk_size):
            yield i * rows_per_item + start, block


class _Workspace:
    """Float buffers of `[chunk rows, vocab]`, allocated once per call and reused by every chunk.

    Allocating fresh chunk-size tensors in the loop costs more than the arithmetic on CPU: the
    allocator hands large blocks back to the OS on free, so every chunk page-faults its memory
    in again (measured up to 6x slower than reusing the same buffers, which stay in cache).
    """

    def __init__(self, count: int, logits: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> None:
        rows = min(chunk_size, logits.numel() // logits.shape[-1])
        self.buffers = [
            torch.empty(rows, logits.shape[-1], dtype=dtype, device=logits.device) for _ in range(count)
        ]

    def take(self, index: int, rows: int) -> torch.Tensor:
        return self.buffers[index][:rows]


def _scaled_into(buffer: torch.Tensor, block: torch.Tensor, temperature: float) -> torch.Tensor:
    """buffer ← block / temperature, in the buffer's dtype (the same rounding as the naive code)."""
    buffer.copy_(block)
    if temperature != 1.0:
        buffer.div_(temperature)
    return buffer


def _row_logsumexp(block: torch.Tensor, logp: torch.Tensor, temperature: float) -> torch.Tensor:
    """logsumexp(z) per row from the log-softmax already computed: max z − max log π.

    Reading the maximum (rather than the label's entry) keeps it finite when the label's logit is
    −inf, and max log π is in [−log V, 0], so the difference is accurate to float32 rounding.
    Max commutes with the upcast and with dividing by a positive temperature, so the maximum is
    taken on the narrow logits.
    """
    z_max = block.amax(-1).to(logp.dtype)
    if temperature != 1.0:
        z_max = z_max / temperature
    return z_max - logp.amax(-1)


def _gradient_rows(logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient (logits' dtype and shape, contiguous) and its `[rows, vocab]` view."""
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    return grad, grad.view(-1, logits.shape[-1])


# --------------------------------------------------------------------------- log-probs


def _logprobs_forward(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, chunk_size: int, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dtype = _compute_dtype(logits)
    rows = labels.numel()
    out = torch.empty(rows, dtype=dtype, device=logits.device)
    lse = torch.empty(rows, dtype=dtype, device=logits.device) if with_lse else None
    work = _Workspace(2, logits, chunk_size, dtype)
    for start, block in _row_blocks(logits, chunk_size):
        n = block.shape[0]
        z = _scaled_into(work.take(0, n), block, temperature)
        logp = torch.log_softmax(z, -1, out=work.take(1, n))
        out[start : start + n] = logp.gather(-1, labels[start : start + n, None]).squeeze(-1)
        if lse is not None:
            lse[start : start + n] = _row_logsumexp(block, logp, temperature)
    return out, lse


class _LogprobsFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature, chunk_size):
        out, lse = _logprobs_forward(logits, labels, temperature, chunk_size, with_lse=True)
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, labels, lse = ctx.saved_tensors
        temperature, dtype = ctx.temperature, lse.dtype
        # ∂ log π_a / ∂ logits_j = (1[j = a] − π_j) / temperature, times the upstream gradient.
        scale = grad_out.reshape(-1).to(dtype) / temperature
        grad, grad_rows = _gradient_rows(logits, dtype)
        # Float32 logits: the gradient's own rows serve as the chunk buffer.
        in_place = logits.dtype == dtype
        work = _Workspace(0 if in_place else 1, logits, ctx.chunk_size, dtype)
        for start, block in _row_blocks(logits, ctx.chunk_size):
            end = start + block.shape[0]
            g = grad_rows[start:end] if in_place else work.take(0, end - start)
            _scaled_into(g, block, temperature).sub_(lse[start:end, None]).exp_()
            g.mul_(scale[start:end, None].neg())
            g.scatter_add_(-1, labels[start:end, None], scale[start:end, None])
            if not in_place:
                grad_rows[start:end] = g
        return grad, None, None, None


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Log-probability of each label under softmax(logits / temperature), chunked over rows.

        log π(a_t | s_t) = z_{t, a_t} − logsumexp_j z_{t, j},   z = logits / temperature.

    Equal (to float32 rounding) to
    ``torch.log_softmax(logits.float() / temperature, -1).gather(-1, labels[..., None]).squeeze(-1)``
    but with O(chunk_size · vocab) extra memory instead of O(batch · seq · vocab), in the
    forward and the backward pass: for `[4, 4096, 151936]` bf16 logits (5 GB) the naive forward
    needs 19 GB more on CPU, this a few MB on CPU (~0.5 GB on a GPU with the default chunks).
    The backward recomputes each chunk's softmax from the saved per-row logsumexp,

        ∂ log π_a / ∂ logits_j = (1[j = a] − π_j) / temperature,

    and returns a gradient with the logits' dtype. When `logits` does not require grad (or
    grad mode is off) no autograd state is kept at all.

    Args:
      logits: `[..., vocab]` floating tensor, typically `[batch, seq, vocab]`, any float dtype
        (bf16 is upcast one chunk at a time). Any strides: a shifted view such as
        ``logits[:, :-1]`` is read in place, never copied.
      labels: `[...]` integer token ids in [0, vocab), the shape of `logits` without the last dim,
        on the same device. Checked for range (one host sync per call).
      temperature: > 0, the sampling temperature the logits are divided by.
      chunk_size: rows (flattened leading positions) per chunk, or None for
        `default_chunk_size(vocab, logits.device)`. Only memory and speed depend on it.

    Returns:
      `[...]` float32 log-probabilities (float64 for float64 logits), shaped like `labels`.
    """
    vocab = _check_logits(logits)
    _check_labels(labels, logits, vocab)
    temperature, chunk_size = _check_options(logits, temperature, chunk_size)
    flat_labels = labels.reshape(-1).long()
    if torch.is_grad_enabled() and logits.requires_grad:
        out = _LogprobsFromLogits.apply(logits, flat_labels, temperature, chunk_size)
    else:
        out, _ = _logprobs_forward(logits, flat_labels, temperature, chunk_size, with_lse=False)
    return out.view(labels.shape)


# --------------------------------------------------------------------------- entropy


def _entropy_forward(
    logits: torch.Tensor, temperature: float, chunk_size: int, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dtype = _compute_dtype(logits)
    rows = logits.numel() // logits.shape[-1]
    out = torch.empty(rows, dtype=dtype, device=logits.device)
    lse = torch.empty(rows, dtype=dtype, device=logits.device) if with_lse else None
    work = _Workspace(2, logits, chunk_size, dtype)
    finite_min = torch.finfo(dtype).min
    for start, block in _row_blocks(logits, chunk_size):
        n = block.shape[0]
        z = _scaled_into(work.take(0, n), block, temperature)
        logp = torch.log_softmax(z, -1, out=work.take(1, n))
        if lse is not None:
            lse[start : start + n] = _row_logsumexp(block, logp, temperature)
        p = torch.exp(logp, out=z)
        # Masked logits (−inf, e.g. a padded vocab) give π = 0 and log π = −inf, whose product is
        # NaN; clamping log π to the lowest finite float makes it 0 and changes nothing else.
        out[start : start + n] = p.mul_(logp.clamp_(min=finite_min)).sum(-1).neg_()
    return out, lse


class _EntropyFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, temperature, chunk_size):
        out, lse = _entropy_forward(logits, temperature, chunk_size, with_lse=True)
        ctx.save_for_backward(logits, lse, out)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        logits, lse, entropy = ctx.saved_tensors
        temperature, dtype = ctx.temperature, lse.dtype
        # ∂H/∂z_j = −π_j (z_j − Σ_k π_k z_k) = −π_j (log π_j + H), since log π_j = z_j − lse.
        scale = grad_out.reshape(-1).to(dtype).neg() / temperature
        grad, grad_rows = _gradient_rows(logits, dtype)
        in_place = logits.dtype == dtype
        work = _Workspace(1 if in_place else 2, logits, ctx.chunk_size, dtype)
        finite_min = torch.finfo(dtype).min
        for start, block in _row_blocks(logits, ctx.chunk_size):
            end = start + block.shape[0]
            g = grad_rows[start:end] if in_place else work.take(1, end - start)
            logp = _scaled_into(g, block, temperature).sub_(lse[start:end, None])
            p = torch.exp(logp, out=work.take(0, end - start))
            # As in the forward: π = 0 entries must give 0, not 0 · (−inf) = NaN.
            g.clamp_(min=finite_min).add_(entropy[start:end, None]).mul_(p).mul_(scale[start:end, None])
            if not in_place:
                grad_rows[start:end] = g
        return grad, None, None


def entropy_from_logits(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at each position, chunked over rows.

        H_t = logsumexp_j z_{t, j} − Σ_j π_{t, j} z_{t, j} = −Σ_j π_{t, j} log π_{t, j},
        z = logits / temperature,  π = softmax(z).

    Same memory profile as `logprobs_from_logits`: O(chunk_size · vocab) extra memory in the
    forward and the backward, which recomputes each chunk's softmax from the saved per-row
    logsumexp and entropy,

        ∂H / ∂logits_j = −π_j (z_j − Σ_k π_k z_k) / temperature = −π_j (log π_j + H) / temperature.

    Entries with logit −inf (masked tokens) contribute 0 to the entropy and get gradient 0.

    Args:
      logits: `[..., vocab]` floating tensor, typically `[batch, seq, vocab]`, any float dtype and
        any strides (never copied).
      temperature: > 0, the temperature the logits are divided by.
      chunk_size: rows per chunk, or None for `default_chunk_size(vocab, logits.device)`.

    Returns:
      `[...]` float32 entropies in nats (float64 for float64 logits), the shape of
      `logits.shape[:-1]`.
    """
    _check_logits(logits)
    temperature, chunk_size = _check_options(logits, temperature, chunk_size)
    if torch.is_grad_enabled() and logits.requires_grad:
        out = _EntropyFromLogits.apply(logits, temperature, chunk_size)
    else:
        out, _ = _entropy_forward(logits, temperature, chunk_size, with_lse=False)
    return out.view(logits.shape[:-1])
