"""Discounted returns and generalised advantage estimation over token sequences, without a time loop.

Every recursion here runs backwards in time along the last dimension of a `[batch, seq]`
tensor: position t is the token at index t, and "the next step" t' is the next position the
recursion visits. The textbook implementation walks t from T − 1 down to 0 in Python, which
costs one handful of kernel launches per token: with 8k–32k-token responses that loop
dominates the time of an otherwise batched update. Here the recursion is evaluated as a
blocked linear scan (see `discounted_reverse_cumsum`) whose Python-level work grows with the
number of levels (log_K T), not with T.

Masked positions. In multi-turn rollouts a row interleaves the policy's tokens (mask 1) with
environment/observation tokens and padding (mask 0), on either side or in holes. Positions
with mask 0 are skipped: the recursion carries over them unchanged, so t' is the next
position *with mask 1* after t, and the rewards and values found at mask-0 positions are
ignored (they may even be NaN). Equivalently, each row's mask-1 positions are compressed
into one contiguous sequence, the ordinary recursion runs on it, and the results are put
back; outputs are 0 at mask-0 positions. This is the convention of verl's multi-turn GAE.

All functions read detached inputs and produce tensors that carry no gradient: returns and
advantages are regression and policy-gradient targets, never differentiated through.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import (
    bool_mask,
    check_floating,
    check_ndim,
    check_probability,
    check_same_shape,
    check_tensor,
    compute_dtype,
)

__all__ = ["compute_discounted_returns", "compute_gae", "discounted_reverse_cumsum"]

BLOCK_SIZE = 64
"""Block length K of the blocked scan.

The in-block matmul costs 2K flops per element, the rest of each level a few memory passes, so
small blocks win until the number of levels (log_K T) starts to show. Measured on 2 CPU cores
at batch 64: K = 32 and 64 are within 10% of each other at T = 1k, 8k and 32k, K = 128 is
about 20% slower and K = 256 about 50% slower. 64 keeps the matmul large enough to be
efficient on accelerators.
"""


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    # On CUDA the float32 matmul may silently run in TF32 (a 10-bit mantissa) when the user has
    # enabled it globally, and those flags cannot be read reliably across torch versions. The
    # scan is a small fraction of an update, so on CUDA it always runs in float64.
    if any(t.device.type == "cuda" for t in tensors):
        return torch.float64
    return compute_dtype(*tensors)


def _powers(gamma: float, exponents: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Powers are formed in float64 on the CPU and rounded once, so γ^k near 1 keeps full
    # precision in float32. Exponents are always >= 0: γ^(-k) would overflow for small γ.
    # torch.pow gives 0^0 = 1, which is what γ = 0 needs on the diagonal.
    base = torch.tensor(gamma, dtype=torch.float64)
    return torch.pow(base, exponents.to(torch.float64)).to(device=device, dtype=dtype)


def _discount_matrix(gamma: float, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Upper-triangular D[t, s] = γ^(s − t) for s ≥ t, else 0, so that (D @ x)_t = Σ_{s≥t} γ^(s−t) x_s."""
    index = torch.arange(size)
    lag = index[None, :] - index[:, None]
    powers = _powers(gamma, lag.clamp(min=0), dtype, device)
    return torch.where((lag >= 0).to(device), powers, torch.zeros((), dtype=dtype, device=device))


def _blocked_scan(x: torch.Tensor, gamma: float, block: int) -> torch.Tensor:
    """y_t = x_t + γ·y_{t+1} along dim 1 of a 2-D `x` with at least one column."""
    rows, length = x.shape
    if length <= block:
        return x @ _discount_matrix(gamma, length, x.dtype, x.device).T

    n_blocks = -(-length // block)
    # Zero padding at the end is exact: y after the end of the sequence is 0 anyway.
    blocks = F.pad(x, (0, n_blocks * block - length)).view(rows, n_blocks, block)
    # Within each block, the scan as if the block were the end of the sequence.
    local = blocks @ _discount_matrix(gamma, block, x.dtype, x.device).T
    # The true value at the start of block n obeys the same recursion one level up, with one
    # step per block and factor γ^K: Y_n = local_n[0] + γ^K·Y_{n+1}.
    starts = _blocked_scan(local[:, :, 0].contiguous(), gamma**block, block)
    following = F.pad(starts[:, 1:], (0, 1))
    # Position t of a block is K − t steps before the next block's start (exponents 1..K).
    decay = _powers(gamma, block - torch.arange(block), x.dtype, x.device)
    out = local.addcmul_(following[:, :, None], decay)
    return out.reshape(rows, n_blocks * block)[:, :length]


def discounted_reverse_cumsum(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted reverse cumulative sum along the last dimension.

    y_t = x_t + γ·y_{t+1}  for t = T − 1, ..., 0,  with y_T = 0,

    i.e. y_t = Σ_{s ≥ t} γ^(s − t)·x_s. Every position counts (no mask); see `compute_gae`
    and `compute_discounted_returns` for the masked recursions built on it.

    The scan is blocked rather than looped: the sequence is cut into blocks of K =
    `BLOCK_SIZE` positions, every block is scanned at once by one matmul with the K×K
    upper-triangular matrix D[t, s] = γ^(s − t), and the values at the block starts are
    fixed up by the same scan one level up (one step per block, factor γ^K), recursively.
    Only non-negative powers of γ are formed, so any γ in [0, 1] is safe, γ = 0 and γ = 1
    included, for sequences of any length.

    Args:
      x: `[..., seq]` floating tensor (usually `[batch, seq]`).
      gamma: discount factor in [0, 1].

    Returns:
      A tensor like `x` (same shape and dtype), computed in float32 (float64 if `x` is
      float64, or if `x` is on a CUDA device, where float32 matmuls may run in TF32). No
      gradient flows through it.
    """
    check_tensor("x", x)
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dimension [..., seq], got shape {tuple(x.shape)}")
    check_floating("x", x)
    gamma = check_probability("gamma", gamma)
    if x.numel() == 0:
        return torch.zeros_like(x)
    with torch.no_grad():
        flat = x.detach().reshape(-1, x.shape[-1]).to(_compute_dtype(x))
        return _blocked_scan(flat, gamma, BLOCK_SIZE).reshape(x.shape).to(x.dtype)


class _Compressor:
    """Moves each row's mask-1 positions to the front (in order) and back again.

    dest[b, t] is where position t of row b goes: mask-1 positions fill 0..n_b − 1 in order,
    mask-0 positions fill n_b..T − 1. Built from cumulative sums, so it costs O(T) per row
    and needs no sort and no device sync.
    """

    def __init__(self, mask: torch.Tensor) -> None:
        kept_so_far = mask.cumsum(-1)  # mask-1 positions at or before t
        n_kept = kept_so_far[:, -1:]
        # Among positions 0..t, t + 1 − kept_so_far have mask 0; the mask-0 position t is the
        # last of them.
        position = torch.arange(mask.shape[-1], device=mask.device)
        self.dest = torch.where(mask, kept_so_far - 1, n_kept + position - kept_so_far)
        self.mask = mask

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        # Mask-0 entries are zeroed first (not multiplied by 0), so a NaN there stays harmless.
        x = torch.where(self.mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
        return torch.zeros_like(x).scatter_(-1, self.dest, x)

    def expand(self, y: torch.Tensor) -> torch.Tensor:
        y = y.gather(-1, self.dest)
        return torch.where(self.mask, y, torch.zeros((), dtype=y.dtype, device=y.device))


def _check_sequences(**tensors: torch.Tensor) -> None:
    (first_name, first), *rest = tensors.items()
    check_ndim(first_name, first, 2, "[batch, seq]")
    check_floating(first_name, first)
    for name, value in rest:
        check_ndim(name, value, 2, "[batch, seq]")
        check_same_shape(name, value, first_name, first)
        check_floating(name, value)


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the action tokens of each row.

    δ_t = r_t + γ·V_{t'} − V_t,
    A_t = δ_t + γλ·A_{t'},
    R_t = A_t + V_t,

    where t' is the next position after t whose `action_mask` is 1, and V_{t'} = A_{t'} = 0
    when t is the row's last action token. Positions with mask 0 (observation tokens between
    turns, left or right padding) are skipped: the recursion carries over them, and their
    rewards and values are ignored. γ = λ = 1 (the defaults, as in OpenRLHF) gives
    A_t = (Σ_{s ≥ t} r_s) − V_t over the action tokens; λ = 0 gives the one-step TD error.

    Reference: Schulman et al., "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", ICLR 2016.

    Computed with `discounted_reverse_cumsum` (factor γλ) on each row's compressed action
    tokens, so there is no Python loop over time steps. Inputs are detached and no gradient
    flows to them (the computation runs under `torch.no_grad`).

    Args:
      token_rewards: `[batch, seq]` float, r_t: the reward received at token t (usually the
        sequence reward on the last action token plus any per-token KL penalty).
      values: `[batch, seq]` float, V_t: the critic's value estimate at token t.
      action_mask: `[batch, seq]` bool, integer or float of 0/1; 1 on the tokens the policy
        generated.
      gamma: discount γ in [0, 1].
      lam: GAE mixing parameter λ in [0, 1].

    Returns:
      (advantages, returns), both `[batch, seq]` in the promoted dtype of `token_rewards` and
      `values`, 0 where `action_mask` is 0. Computed in float32 (float64 if an input is
      float64 or the tensors are on CUDA).
    """
    _check_sequences(token_rewards=token_rewards, values=values)
    mask = bool_mask("action_mask", action_mask, token_rewards, "token_rewards")
    gamma = check_probability("gamma", gamma)
    lam = check_probability("lam", lam)
    out_dtype = torch.promote_types(token_rewards.dtype, values.dtype)
    if token_rewards.numel() == 0:
        empty = torch.zeros(token_rewards.shape, dtype=out_dtype, device=token_rewards.device)
        return empty, empty.clone()

    with torch.no_grad():
        dtype = _compute_dtype(token_rewards, values)
        rows = _Compressor(mask)
        rewards = rows.compress(token_rewards.detach().to(dtype))
        value = rows.compress(values.detach().to(dtype))
        # After compression the action tokens are contiguous and everything past them is 0,
        # so V_{t'} is simply the next column, and 0 after the last action token.
        next_value = F.pad(value[:, 1:], (0, 1))
        deltas = rewards + gamma * next_value - value
        advantages = _blocked_scan(deltas, gamma * lam, BLOCK_SIZE)
        returns = advantages + value
        return rows.expand(advantages).to(out_dtype), rows.expand(returns).to(out_dtype)


def compute_discounted_returns(
    token_rewards: torch.Tensor, action_mask: torch.Tensor, *, gamma: float = 1.0
) -> torch.Tensor:
    """Discounted return-to-go over the action tokens of each row (REINFORCE++'s return).

    G_t = r_t + γ·G_{t'},

    where t' is the next position after t whose `action_mask` is 1, and G_{t'} = 0 when t is
    the row's last action token. Positions with mask 0 are skipped (the recursion carries over
    them) and their rewards are ignored, as in `compute_gae`.

    Computed with `discounted_reverse_cumsum` on each row's compressed action tokens, so
    there is no Python loop over time steps. Inputs are detached and no gradient flows to them.

    Args:
      token_rewards: `[batch, seq]` float, r_t: the reward received at token t.
      action_mask: `[batch, seq]` bool, integer or float of 0/1; 1 on the tokens the policy
        generated.
      gamma: discount γ in [0, 1].

    Returns:
      `[batch, seq]` returns in the dtype of `token_rewards`, 0 where `action_mask` is 0.
      Computed in float32 (float64 if the input is float64 or on CUDA).
    """
    _check_sequences(token_rewards=token_rewards)
    mask = bool_mask("action_mask", action_mask, token_rewards, "token_rewards")
    gamma = check_probability("gamma", gamma)
    if token_rewards.numel() == 0:
        return torch.zeros_like(token_rewards)

    with torch.no_grad():
        rows = _Compressor(mask)
        rewards = rows.compress(token_rewards.detach().to(_compute_dtype(token_rewards)))
        return rows.expand(_blocked_scan(rewards, gamma, BLOCK_SIZE)).to(token_rewards.dtype)
