"""Sealing a checkpoint (fsync + checksums of its files), the old sequential way vs rl_learner's.

After DeepSpeed has written a checkpoint's files, `rl_learner.save_checkpoint` fsyncs them and
writes each one's checksum into the manifest; `load_checkpoint` checks the checksums again.
Compared here, on freshly written files (dirty in the page cache, as after a save):

- `sequential`: per file, fsync then SHA-256 of the whole file (rl_learner before format 2);
- `parallel`: `rl_learner.checkpoint._seal`: one thread fsyncs while a pool hashes the files
  above 64 MiB block by block (`ManifestFile.block_bytes`).

and verification (files in the page cache, as on a resume soon after the save): whole-file
SHA-256 in turn vs the block digests on the pool.

The default sizes are a ZeRO-2 checkpoint of Qwen2-0.5B in bf16 scaled down 4x (model states
1 GB -> 256 MiB, optimizer states 5.9 GB -> 1,510 MiB) to fit a small disk:

    python benchmarks/checkpoint_seal.py --sizes-mib 256 1510 --repeats 3
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

from rl_learner import checkpoint


def write_files(folder: Path, sizes_mib: list[int]) -> list[str]:
    """Files of the given sizes (random bytes, one 64 MiB pattern repeated), not yet fsynced."""
    pattern = os.urandom(64 << 20)
    names = []
    for index, size in enumerate(sizes_mib):
        name = f"file_{index}.pt"
        with open(folder / name, "wb") as handle:
            left = size << 20
            while left > 0:
                handle.write(pattern[: min(left, len(pattern))])
                left -= len(pattern)
        names.append(name)
    return names


def seal_sequential(folder: Path, names: list[str]) -> list[str]:
    digests = []
    for name in names:
        checkpoint._fsync_file(folder / name)
        digests.append(checkpoint._sha256(folder / name))
    return digests


def seal_parallel(folder: Path, names: list[str]) -> list[str]:
    return [entry.sha256 for entry in checkpoint._seal(folder, names)]


def verify_sequential(folder: Path, names: list[str]) -> list[str]:
    return [checkpoint._sha256(folder / name) for name in names]


def verify_parallel(folder: Path, names: list[str]) -> list[str]:
    paths = [folder / name for name in names]
    blocks = [checkpoint._block_bytes(path.stat().st_size) for path in paths]
    with checkpoint._hash_pool() as pool:
        return [digest() for digest in checkpoint._digests(pool, paths, blocks)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 1510])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    print(
        f"files {args.sizes_mib} MiB, {os.cpu_count()} CPUs, hash pool of "
        f"{checkpoint._hash_pool()._max_workers} threads, load average {os.getloadavg()[0]:.2f}"
    )
    times: dict[str, list[float]] = {
        "seal sequential": [],
        "seal parallel": [],
        "verify sequential": [],
        "verify parallel": [],
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as temporary:
        folder = Path(temporary)
        for repeat in range(args.repeats):
            # alternate which variant goes first; each seals files written just before it
            order = [("sequential", seal_sequential), ("parallel", seal_parallel)]
            for name, seal in order if repeat % 2 == 0 else order[::-1]:
                names = write_files(folder, args.sizes_mib)
                began = time.perf_counter()
                seal(folder, names)
                times[f"seal {name}"].append(time.perf_counter() - began)
            order = [("sequential", verify_sequential), ("parallel", verify_parallel)]
            for name, verify in order if repeat % 2 == 0 else order[::-1]:
                began = time.perf_counter()
                verify(folder, names)
                times[f"verify {name}"].append(time.perf_counter() - began)
        # the block digests are what the definition says (ManifestFile)
        for name in names:
            data = (folder / name).read_bytes()
            block = checkpoint._BLOCK_BYTES
            expected = (
                hashlib.sha256(
                    b"".join(hashlib.sha256(data[s : s + block]).digest() for s in range(0, len(data), block))
                ).hexdigest()
                if len(data) > block
                else hashlib.sha256(data).hexdigest()
            )
            assert verify_parallel(folder, [name]) == [expected], name
    total = sum(args.sizes_mib) / 1024
    print(f"{'':22}{'median s':>10}{'GB/s':>8}  runs")
    for key, values in times.items():
        median = statistics.median(values)
        print(f"{key:22}{median:10.2f}{total / median:8.2f}  {' '.join(f'{v:.2f}' for v in values)}")
    for what in ("seal", "verify"):
        ratio = statistics.median(times[f"{what} sequential"]) / statistics.median(times[f"{what} parallel"])
        print(f"{what}: parallel {ratio:.2f}x faster than sequential")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
