"""How long the hybrid engine's learner offload takes: DeepSpeed `offload_states` into pinned
host memory (DeepSpeed's default), into pageable host memory, and pinned after `gc.freeze()`
(what `rl_learner.DeepSpeedLearner.offload_states` does: DeepSpeed's ZeRO-1/2 offload runs
`gc.collect()` three times, and their cost grows with every object the process holds).

In a hybrid run (`rl-launch ppo --ray.colocate all` on a GPU) every step offloads each trained
learner's states after the weight sync and reloads them before the forwards (`time/offload`,
part of `time/sleep`). This times one cycle, side by side in one process, for a stack of Linear
layers under ZeRO-2 with a torch AdamW client optimizer (after one training step, so the Adam
moments exist):

    offload    engine.offload_states(pin_memory=...) + synchronize + empty_cache (what the learner does)
    reload     engine.reload_states() + synchronize

and prints the medians of `--repeats` cycles after one warm-up cycle, the GPU memory the
offload freed, and the ratios to pinned. The process imports transformers first, as a learner
does (its objects are what the collections walk). Needs one CUDA GPU.

    python benchmarks/offload_states.py [--params 1e6 1e8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch


def build(params: float, pin: bool):
    import deepspeed

    width = 1024
    layers = max(1, round(params / (width * width)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    x = torch.randn(4, width, device=engine.device, dtype=torch.bfloat16)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return engine, sum(p.numel() for p in model.parameters())


def cycle(engine, pin: bool, frozen: bool = False) -> tuple[float, float, int]:
    if frozen:
        gc.collect()
        gc.freeze()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    engine.offload_states(pin_memory=pin)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    offload = time.perf_counter() - start
    freed = before - torch.cuda.memory_allocated()
    start = time.perf_counter()
    engine.reload_states()
    torch.cuda.synchronize()
    if frozen:
        gc.unfreeze()
    return offload, time.perf_counter() - start, freed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", type=float, nargs="+", default=[1e6, 1e8])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    import deepspeed
    import transformers  # noqa: F401 (a learner's process holds its objects)

    deepspeed.init_distributed()
    print(f"{'params':>12} {'states':>8} | offload: {'pinned':>7} {'pageable':>8} {'frozen':>7} | "
          f"reload: {'pinned':>7} {'pageable':>8} {'frozen':>7} | freed MB")  # fmt: skip
    for params in args.params:
        engine, count = build(params, True)
        rows = {}
        for variant in ("pinned", "pageable", "frozen"):
            pin, frozen = variant != "pageable", variant == "frozen"
            cycle(engine, pin, frozen)  # warm-up
            runs = [cycle(engine, pin, frozen) for _ in range(args.repeats)]
            rows[variant] = [statistics.median(column) for column in zip(*runs)]
        off = {variant: row[0] for variant, row in rows.items()}
        back = {variant: row[1] for variant, row in rows.items()}
        print(
            f"{count:>12,} {count * 14 / 2**20:>6.0f}MB | offload: "
            + " ".join(f"{off[v]:>7.3f}s" for v in rows)
            + " | reload: "
            + " ".join(f"{back[v]:>7.3f}s" for v in rows)
            + f" | {rows['pinned'][2] / 2**20:.0f}"
        )
        print(
            f"{'':>22}   pageable / pinned {off['pageable'] / off['pinned']:.2f}x, "
            f"pinned / frozen {off['pinned'] / off['frozen']:.1f}x (offload)"
        )
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
