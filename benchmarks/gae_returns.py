"""Time the blocked GAE / discounted returns of `rl_algos.returns` against a reverse Python loop.

The baseline is the loop most RL frameworks write: one iteration per time step, vectorised
over the batch only, with the lines that carry the next value and the running advantage over
mask-0 positions (multi-turn observation tokens, padding). Both sides get the same inputs: a
batch of rows with a random response length each (right padding), and a quarter of the rows
with a few observation holes inside the response.

    python benchmarks/gae_returns.py [--batch 64 --lengths 1024 8192 32768]

Prints, for each sequence length, the median time of each implementation, the speed-up and
the largest absolute difference between their outputs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from rl_algos.returns import compute_discounted_returns, compute_gae


def loop_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    mask = mask.to(rewards.dtype)
    next_value = torch.zeros_like(rewards[:, 0])
    running = torch.zeros_like(rewards[:, 0])
    columns = []
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        # Mask-0 positions leave both carries untouched.
        running = m * candidate + (1 - m) * running
        next_value = m * values[:, t] + (1 - m) * next_value
        columns.append(running)
    advantages = torch.stack(columns[::-1], dim=1) * mask
    return advantages, (advantages + values) * mask


def loop_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    mask = mask.to(rewards.dtype)
    running = torch.zeros_like(rewards[:, 0])
    columns = []
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        running = m * (rewards[:, t] + gamma * running) + (1 - m) * running
        columns.append(running)
    return torch.stack(columns[::-1], dim=1) * mask


def realistic_batch(
    batch: int, length: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewards, values and a bool action mask: random response lengths, some rows with holes."""
    lengths = torch.randint(max(1, length // 4), length + 1, (batch,), generator=generator)
    positions = torch.arange(length)
    mask = positions[None, :] < lengths[:, None]
    for row in range(0, batch, 4):
        for _ in range(3):
            width = int(torch.randint(1, max(2, length // 50), (), generator=generator))
            start = int(torch.randint(0, max(1, int(lengths[row]) - width), (), generator=generator))
            mask[row, start : start + width] = False
    # A per-token KL-like penalty everywhere plus a sequence reward on each row's last token.
    rewards = 0.01 * torch.randn(batch, length, generator=generator)
    rewards[torch.arange(batch), lengths - 1] += torch.randn(batch, generator=generator)
    values = torch.randn(batch, length, generator=generator)
    return rewards, values, mask


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def max_diff(a: torch.Tensor | tuple[torch.Tensor, ...], b: torch.Tensor | tuple[torch.Tensor, ...]) -> float:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument("--gamma", type=float, default=0.999)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=15, help="repeats of the fast implementation")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(args.seed)
    print(
        f"batch {args.batch}, gamma {args.gamma}, lam {args.lam}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, float32 on CPU"
    )
    header = f"{'kind':<8} {'T':>6} {'loop ms':>10} {'ours ms':>9} {'speed-up':>9} {'max |diff|':>11}"
    print(header)
    print("-" * len(header))
    for length in args.lengths:
        rewards, values, mask = realistic_batch(args.batch, length, generator)
        # The loop costs ~T kernel launches per call; a couple of repeats suffice at long T.
        loop_repeats = 5 if length <= 2048 else 3 if length <= 8192 else 1
        cases = [
            (
                "gae",
                lambda r=rewards, v=values, m=mask: loop_gae(r, v, m, args.gamma, args.lam),
                lambda r=rewards, v=values, m=mask: compute_gae(r, v, m, gamma=args.gamma, lam=args.lam),
            ),
            (
                "returns",
                lambda r=rewards, m=mask: loop_returns(r, m, args.gamma),
                lambda r=rewards, m=mask: compute_discounted_returns(r, m, gamma=args.gamma),
            ),
        ]
        for kind, loop_fn, fast_fn in cases:
            diff = max_diff(loop_fn(), fast_fn())
            fast_fn()  # warm-up
            loop_ms = median_ms(loop_fn, loop_repeats)
            fast_ms = median_ms(fast_fn, args.repeats)
            print(
                f"{kind:<8} {length:>6} {loop_ms:>10.1f} {fast_ms:>9.2f} "
                f"{loop_ms / fast_ms:>8.0f}x {diff:>11.2e}"
            )


if __name__ == "__main__":
    main()
