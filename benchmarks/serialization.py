"""Time `rl_data.serialization` against pickle on a batch of rollout records.

Both sides serialise the same list of `rl_data.records.Trajectory`: by default 10,000 records
of 1,000 tokens each (a 256-token prompt and a 744-token response as int64 token ids, float32
rollout log-probs and a bool action mask over the response, a reward, a group id and a small
`extra` dict), which is what a rollout worker hands to the learners each step. Ours is
`encode(records)` / `decode(data, list[Trajectory])` (msgpack through msgspec, tensors as raw
bytes in extension values, the records' checks run on decode); the baseline is
`pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL)` / `pickle.loads`.

    python benchmarks/serialization.py [--records 10000 --tokens 1000 --repeat 3]

Prints each format's message size and its encode and decode throughput in MB/s, where
MB = 10^6 bytes of that format's own message, taking the best of `--repeat` runs, and the
ratios ours / pickle. Before timing, both decoded results are checked to equal the originals
(tensors bit for bit), so a broken fast path cannot report a good number.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import time
from collections.abc import Callable
from typing import Any

import torch

from rl_data.records import Trajectory
from rl_data.serialization import decode, encode


def make_records(count: int, tokens: int, seed: int = 0) -> list[Trajectory]:
    """`count` trajectories of `tokens` tokens: about a quarter prompt, the rest response."""
    generator = torch.Generator().manual_seed(seed)
    prompt_length = max(1, tokens * 256 // 1000)
    response_length = tokens - prompt_length
    prompts = torch.randint(0, 151_936, (count, prompt_length), generator=generator)
    responses = torch.randint(0, 151_936, (count, response_length), generator=generator)
    logprobs = -torch.rand(count, response_length, generator=generator) * 5
    masks = torch.rand(count, response_length, generator=generator) > 0.05
    rewards = torch.rand(count, generator=generator).tolist()
    return [
        Trajectory(
            prompt_ids=prompts[i].clone(),
            response_ids=responses[i].clone(),
            rollout_logprobs=logprobs[i].clone(),
            action_mask=masks[i].clone(),
            reward=rewards[i],
            group_id=i // 8,
            policy_version=3,
            finish_reason="stop" if i % 5 else "length",
            label="42",
            extra={"turns": 1, "source": "gsm8k", "tool_calls": [], "row": i},
        )
        for i in range(count)
    ]


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        )
    return type(a) is type(b) and a == b


def same_records(decoded: list[Trajectory], original: list[Trajectory]) -> bool:
    if len(decoded) != len(original):
        return False
    fields = Trajectory.__struct_fields__
    return all(
        type(d) is Trajectory and all(same_value(getattr(d, f), getattr(o, f)) for f in fields)
        for d, o in zip(decoded, original)
    )


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000, help="number of trajectories")
    parser.add_argument("--tokens", type=int, default=1_000, help="prompt + response tokens per trajectory")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the best is kept")
    args = parser.parse_args()
    if args.records < 1 or args.tokens < 2 or args.repeat < 1:
        parser.error("--records and --repeat must be >= 1 and --tokens >= 2")

    records = make_records(args.records, args.tokens)
    formats: dict[str, tuple[Callable[[], bytes], Callable[[bytes], list[Trajectory]]]] = {
        "rl_data": (lambda: encode(records), lambda data: decode(data, list[Trajectory])),
        "pickle": (lambda: pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL), pickle.loads),
    }

    results = {}
    for name, (encode_fn, decode_fn) in formats.items():
        message = encode_fn()
        if not same_records(decode_fn(message), records):
            raise SystemExit(f"{name}: decoded records differ from the originals")
        encode_s = best_seconds(encode_fn, args.repeat)
        decode_s = best_seconds(lambda decode_fn=decode_fn, message=message: decode_fn(message), args.repeat)
        results[name] = (len(message), encode_s, decode_s)
        del message

    print(
        f"{args.records} trajectories x {args.tokens} tokens, best of {args.repeat}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; decoded records verified equal"
    )
    header = f"{'format':<10} {'message MB':>11} {'encode s':>9} {'encode MB/s':>12} {'decode s':>9} {'decode MB/s':>12}"
    print(header)
    print("-" * len(header))
    for name, (size, encode_s, decode_s) in results.items():
        print(
            f"{name:<10} {size / 1e6:>11.1f} {encode_s:>9.3f} {size / 1e6 / encode_s:>12.0f} "
            f"{decode_s:>9.3f} {size / 1e6 / decode_s:>12.0f}"
        )
    ours, theirs = results["rl_data"], results["pickle"]
    print(
        f"{'ours/pickle':<10} {ours[0] / theirs[0]:>10.3f}x {ours[1] / theirs[1]:>8.3f}x "
        f"{(ours[0] / ours[1]) / (theirs[0] / theirs[1]):>11.2f}x {ours[2] / theirs[2]:>8.3f}x "
        f"{(ours[0] / ours[2]) / (theirs[0] / theirs[2]):>11.2f}x"
    )


if __name__ == "__main__":
    main()
