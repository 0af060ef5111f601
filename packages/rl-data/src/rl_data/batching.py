"""Dynamic batching: balanced micro-batches of packed sequences under a token budget.

A rollout batch has sequences of very different lengths (a long tail up to the context
length). Fixed-size micro-batches of padded rows waste most of their compute on padding, and
splitting sequences evenly by count over data-parallel ranks leaves some ranks with far more
tokens than others: every rank then waits for the slowest one at each gradient all-reduce.

Here the sequences are packed (no padding) and partitioned twice by total token count:

1. over the data-parallel ranks, so every rank holds about the same number of tokens;
2. on each rank, into micro-batches of at most `max_tokens` tokens each, as evenly as possible.

Both are multiway number partitioning, solved with the largest differencing method of
Karmarkar and Karp ("The differencing method of set partitioning", 1982), in its k-way form
(Michiels, Aarts, Korst, van Leeuwen and Spieksma, "Computer-assisted proof of performance
ratios for the differencing method", 2012):

    start with one partial partition per item, k subsets each: (w, 0, ..., 0);
    repeat: take the two partial partitions A, B with the largest spread (max − min subset
            sum), join A's i-th largest subset with B's i-th smallest, until one is left.

Joining the largest subsets with the smallest ones cancels the differences early, so the final
spread is usually far below that of the greedy "largest item onto the lightest part" rule (LPT),
which `greedy_partition` implements for comparison.

Cost. A partial partition is stored with only its non-empty subsets, sorted, as
(−sum, first item, last item) triples; the items of a subset form a linked list (one `next`
array for all items), so joining two subsets is O(1) and the index lists are read once at the
end. A join whose partner has few subsets is done in place by binary insertion. With k parts
and n items the work is O(n log n) for small k, and the per-join cost follows the number of
non-empty subsets, not k, which keeps k in the hundreds (micro-batches per rank) cheap.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from .errors import check_integer

__all__ = [
    "ON_TOO_LONG",
    "PARTITION_METHODS",
    "MicroBatchPlan",
    "fixed_size_batches",
    "greedy_partition",
    "karmarkar_karp",
    "padded_fraction",
    "plan_micro_batches",
]

ON_TOO_LONG: tuple[str, ...] = ("error", "skip", "alone")
PARTITION_METHODS: tuple[str, ...] = ("karmarkar_karp", "greedy")

# Tries of the micro-batch count search that move up by at least 1 before the step doubles.
_LINEAR_STEPS = 4


# --------------------------------------------------------------------------- checks


def _as_weights(name: str, values: Sequence[float], *, integer: bool) -> list:
    """`values` as a list of Python numbers, after checking they are finite and non-negative."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of numbers, got shape {array.shape}")
    if array.size == 0:
        return []
    if array.dtype == np.bool_ or not (
        np.issubdtype(array.dtype, np.integer) or (not integer and np.issubdtype(array.dtype, np.floating))
    ):
        kind = "integers" if integer else "numbers"
        raise TypeError(f"{name} must hold {kind}, got dtype {array.dtype}")
    bad = ~np.isfinite(array) | (array < 0) if array.dtype.kind == "f" else array < 0
    if bad.any():
        where = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name} must be finite and >= 0, got {name}[{where}] = {array[where].item()!r}")
    return array.tolist()


def _descending_order(weights: list) -> list[int]:
    """Item indices by decreasing weight, ties by increasing index."""
    return np.argsort(-np.asarray(weights, dtype=np.float64), kind="stable").tolist()


# --------------------------------------------------------------------------- partitioning


def _join(a: list, b: list, k: int, following: list[int]) -> list:
    """Join two partial partitions (sorted non-empty subsets): the i-th largest subset of one
    with the i-th smallest of the other, counting the empty subsets each has up to k."""
    if len(a) < len(b):
        a, b = b, a
    size_a, size_b = len(a), len(b)
    overlap = size_a + size_b - k
    # Subset i of A (by decreasing sum) joins subset k−1−i of B: the `overlap` smallest
    # non-empty subsets of A meet the `overlap` smallest ones of B in reverse order; the rest
    # of both meet empty subsets and are kept as they are.
    if size_b * 4 <= size_a:  # few subsets in B: insert them into A in place
        insort = bisect.insort
        if overlap > 0:
            tail = a[size_a - overlap :]
            del a[size_a - overlap :]
            for t in range(overlap):
                sum_a, head_a, tail_a = tail[t]
                sum_b, head_b, tail_b = b[size_b - 1 - t]
                following[tail_a] = head_b
                insort(a, (sum_a + sum_b, head_a, tail_b))
            for entry in b[: size_b - overlap]:
                insort(a, entry)
        else:
            for entry in b:
                insort(a, entry)
        return a
    if overlap > 0:
        merged = a[: size_a - overlap] + b[: size_b - overlap]
        start = size_a - overlap
        for t in range(overlap):
            sum_a, head_a, tail_a = a[start + t]
            sum_b, head_b, tail_b = b[size_b - 1 - t]
            following[tail_a] = head_b
            merged.append((sum_a + sum_b, head_a, tail_b))
    else:
        merged = a + b
    merged.sort()
    return merged


def _karmarkar_karp(weights: list, num_parts: int, equal_size: bool) -> tuple[list[list[int]], list]:
    """Core of `karmarkar_karp` on checked input: (parts, their sums), by decreasing sum."""
    n, k = len(weights), num_parts
    if n == 0:
        return [[] for _ in range(k)], [0] * k
    if k == 1:
        return [list(range(n))], [sum(weights)]
    order = _descending_order(weights)
    # A partial partition: its non-empty subsets as (−sum, head, tail), sorted ascending (largest
    # sum first; ties by head, which is unique). Joined partitions wait in a heap keyed by
    # (−spread, creation rank). Single items (spread = weight) are read straight from `order`
    # instead: they already come by decreasing spread, and most joins take one of them.
    heap: list = []
    if equal_size:
        for rank, start in enumerate(range(0, n, k)):
            subsets = [(-weights[i], i, i) for i in order[start : start + k]]
            low = -subsets[-1][0] if len(subsets) == k else 0
            heap.append((-(-subsets[0][0] - low), rank, subsets))
        heapq.heapify(heap)
        created, singles = len(heap), []
    else:
        created, singles = n, order
    following = [-1] * n  # linked lists of the items of every subset
    negative = [-weight for weight in weights]
    pop, push, insort = heapq.heappop, heapq.heappush, bisect.insort
    next_single, num_singles = 0, len(singles)
    for _ in range(num_singles + len(heap) - 1):
        # The two partitions with the largest spread; on a tie the single item (whose rank, its
        # index, is below every joined partition's) goes first. A single item stays a bare
        # (−w, i, i) subset (`single_*`) instead of becoming a one-entry partition list.
        if next_single < num_singles and (not heap or negative[singles[next_single]] <= heap[0][0]):
            item = singles[next_single]
            next_single += 1
            single_a, a = (negative[item], item, item), None
        else:
            single_a, a = None, pop(heap)[2]
        if next_single < num_singles and (not heap or negative[singles[next_single]] <= heap[0][0]):
            item = singles[next_single]
            next_single += 1
            single_b, b = (negative[item], item, item), None
        else:
            single_b, b = None, pop(heap)[2]
        if a is None and b is None:
            merged = [single_a, single_b]  # already in order: a came first
        elif a is None or b is None:
            # The common case: one item joins a partition (of two or more subsets). It lands
            # on the smallest subset when all k are taken, else on an empty one.
            merged, entry = (a, single_b) if b is None else (b, single_a)
            if len(merged) == k:
                sum_a, head_a, tail_a = merged.pop()
                following[tail_a] = entry[1]
                insort(merged, (sum_a + entry[0], head_a, entry[2]))
            else:
                insort(merged, entry)
        else:
            merged = _join(a, b, k, following)
        spread = merged[-1][0] - merged[0][0] if len(merged) == k else -merged[0][0]
        push(heap, (-spread, created, merged))
        created += 1
    final = heap[0][2] if heap else [(-weights[singles[0]], singles[0], singles[0])]
    parts, sums = [], []
    for total, head, last in final:
        items = [head]
        item = head
        while item != last:
            item = following[item]
            items.append(item)
        items.sort()
        parts.append(items)
        sums.append(-total)
    parts.extend([] for _ in range(k - len(parts)))
    sums.extend(0 for _ in range(k - len(sums)))
    return parts, sums


def _greedy(weights: list, num_parts: int) -> tuple[list[list[int]], list]:
    """Core of `greedy_partition` on checked input: (parts, their sums), by decreasing sum."""
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    # (sum, items, part): among equally light parts the one with fewer items wins, so that
    # zero-weight items do not all pile onto one part while others stay empty.
    heap = [(0, 0, part) for part in range(num_parts)]
    replace = heapq.heapreplace
    for item in _descending_order(weights):
        total, count, part = heap[0]
        parts[part].append(item)
        replace(heap, (total + weights[item], count + 1, part))
    ranked = sorted(heap, key=lambda entry: (-entry[0], entry[2]))
    return [sorted(parts[part]) for _, _, part in ranked], [total for total, _, _ in ranked]


def karmarkar_karp(weights: Sequence[float], num_parts: int, *, equal_size: bool = False) -> list[list[int]]:
    """Split item indices into `num_parts` parts with nearly equal total weight (k-way LDM).

    The largest differencing method of Karmarkar and Karp, k-way: every item starts as a
    partial partition (w, 0, ..., 0); the two partial partitions with the largest spread
    (max − min subset sum) are joined, the i-th largest subset of one with the i-th smallest of
    the other, until one partition is left.

    With `equal_size`, items are sorted by weight and cut into consecutive groups of k, each
    group starting as a partial partition of k singletons; joins pair subsets one to one, so
    every part ends with ⌊n/k⌋ or ⌈n/k⌉ items.

    Deterministic: ties between equal weights are broken by index.

    Args:
      weights: n non-negative numbers (token counts).
      num_parts: k ≥ 1. Parts may be empty when k > n.
      equal_size: also balance the number of items per part.

    Returns:
      k lists of item indices (each sorted), by decreasing total weight; every index in
      0..n−1 appears in exactly one of them.
    """
    num_parts = check_integer("num_parts", num_parts, 1)
    values = _as_weights("weights", weights, integer=False)
    return _karmarkar_karp(values, num_parts, bool(equal_size))[0]


def greedy_partition(weights: Sequence[float], num_parts: int) -> list[list[int]]:
    """Largest-first greedy (LPT): items by decreasing weight, each onto the lightest part so far.

    The baseline `karmarkar_karp` is compared with. Ties go to the lower index (items) and to
    the part with fewer items, then the lower part number (parts). Returns k sorted index
    lists, by decreasing total weight.
    """
    num_parts = check_integer("num_parts", num_parts, 1)
    values = _as_weights("weights", weights, integer=False)
    return _greedy(values, num_parts)[0]


_PARTITIONERS: dict[str, Callable[[list, int], tuple[list[list[int]], list]]] = {
    "karmarkar_karp": lambda weights, parts: _karmarkar_karp(weights, parts, False),
    "greedy": _greedy,
}


# --------------------------------------------------------------------------- micro-batch plan


class MicroBatchPlan(msgspec.Struct, kw_only=True, frozen=True):
    """Which sequences go to which data-parallel rank and micro-batch, with balance statistics.

    Fields:
        ranks:              ranks[r][j] = sorted indices of the sequences of micro-batch j on rank
                            r. Every rank has the same number M of micro-batches, ordered by
                            decreasing token count, so micro-step j has similar sizes on every rank.
        skipped:            indices left out because they are longer than `max_tokens`.
        oversized:          indices longer than `max_tokens` that were kept, each alone in a
                            micro-batch of its own (`on_too_long="alone"`).
        max_tokens:         token budget of one micro-batch (exceeded only by a micro-batch that
                            holds one `oversized` sequence).
        micro_batch_tokens: micro_batch_tokens[r][j] = tokens of micro-batch j on rank r.
        tokens_per_rank:    total tokens of each rank.
        balance:            max / mean of `tokens_per_rank` (1.0 is perfect; 1.0 when all are 0).
        lockstep_waste:     1 − real tokens / Σ_j R·max_r micro_batch_tokens[r][j]: the share of
                            compute lost when every rank waits at micro-step j for the largest
                            micro-batch of that step (0.0 when there are no tokens).
        num_empty_micro_batches: micro-batches without sequences (only on ranks with fewer than M
                            sequences; the learner runs a dummy step for them).
    """

    ranks: list[list[list[int]]]
    skipped: list[int]
    max_tokens: int
    micro_batch_tokens: list[list[int]]
    tokens_per_rank: list[int]
    balance: float
    lockstep_waste: float
    num_empty_micro_batches: int
    oversized: list[int] = msgspec.field(default_factory=list)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_micro_batches(self) -> int:
        """M, the number of micro-batches of every rank."""
        return len(self.ranks[0]) if self.ranks else 0

    @property
    def num_tokens(self) -> int:
        """Tokens of all planned (not skipped) sequences."""
        return sum(self.tokens_per_rank)

    @classmethod
    def from_assignment(
        cls,
        ranks: list[list[list[int]]],
        lengths: Sequence[int],
        *,
        max_tokens: int,
        skipped: Sequence[int] = (),
        oversized: Sequence[int] = (),
    ) -> MicroBatchPlan:
        """A plan from a given assignment, with its statistics computed from `lengths`.

        Raises ValueError if ranks differ in their number of micro-batches. Budgets are not
        checked here (a baseline assignment may exceed them); `plan_micro_batches` respects them.
        """
        if not ranks:
            raise ValueError("ranks is empty; a plan needs at least one rank")
        counts = {len(batches) for batches in ranks}
        if len(counts) > 1:
            raise ValueError(f"ranks must all have the same number of micro-batches, got {sorted(counts)}")
        tokens = [[sum(lengths[i] for i in batch) for batch in batches] for batches in ranks]
        per_rank = [sum(row) for row in tokens]
        total = sum(per_rank)
        mean = total / len(ranks) if ranks else 0.0
        steps = len(ranks[0]) if ranks else 0
        lockstep = sum(len(ranks) * max(row[j] for row in tokens) for j in range(steps))
        return cls(
            ranks=ranks,
            skipped=sorted(int(i) for i in skipped),
            max_tokens=int(max_tokens),
            micro_batch_tokens=tokens,
            tokens_per_rank=per_rank,
            balance=max(per_rank) / mean if mean > 0 else 1.0,
            lockstep_waste=1.0 - total / lockstep if lockstep > 0 else 0.0,
            num_empty_micro_batches=sum(not batch for batches in ranks for batch in batches),
            oversized=sorted(int(i) for i in oversized),
        )


def _fits(sums: list, budget: int) -> bool:
    return max(sums) <= budget


def _lower_bound(lengths: list[int], budget: int, depth: int = 8) -> int:
    """A number of parts that no packing under `budget` can go below.

    ⌈Σ lengths / budget⌉, and for j = 1..`depth`: a part holds at most j sequences longer
    than budget / (j + 1), so at least ⌈#{l : (j+1)·l > budget} / j⌉ parts are needed.
    """
    bound = -(-sum(lengths) // budget)
    array = np.asarray(lengths, dtype=np.int64)
    for j in range(1, depth + 1):
        count = int(np.count_nonzero((j + 1) * array > budget))
        bound = max(bound, -(-count // j))
    return bound


def _split_rank(
    lengths: list[int], budget: int, minimum: int, partition: Callable[[list, int], tuple[list, list]]
) -> list[list[int]]:
    """Fewest balanced parts (at least `minimum`) of local indices with every part ≤ `budget`.

    Starts at a lower bound m₀ (`_lower_bound`) and moves up until a partition fits: from a
    failing m with largest part S, the next try is max(m + step, ⌈m·S / budget⌉) (parts are
    nearly equal, so S shrinks about like 1/m), where step is 1 for the first
    `_LINEAR_STEPS` tries and doubles after. It then tries one part less and, if that fits
    too, bisects between the last failure and the fit. m = len(lengths) always fits (every length is ≤ budget), so the search ends.
    Which m fit is not monotonic in general; the result is the smallest m found to fit.
    """
    count = len(lengths)
    if count == 0:
        return []
    lower = max(minimum, _lower_bound(lengths, budget))
    parts_count = min(lower, count)
    failed = parts_count - 1
    step = 1
    trials = 0
    while True:
        parts, sums = partition(lengths, parts_count)
        largest = max(sums)
        if parts_count >= count or largest <= budget:
            break
        failed = parts_count
        trials += 1
        if trials >= _LINEAR_STEPS:
            step *= 2
        parts_count = min(count, max(parts_count + step, -(-parts_count * largest // budget)))
    best = parts
    high = parts_count
    probe_below = True  # the jump usually lands on the first fit: try just below it first
    while high - failed > 1:
        middle = high - 1 if probe_below else (failed + high) // 2
        probe_below = False
        parts, sums = partition(lengths, middle)
        if _fits(sums, budget):
            best, high = parts, middle
        else:
            failed = middle
    if len(best) < minimum:  # only when count < minimum: pad with empty micro-batches
        best = best + [[] for _ in range(minimum - len(best))]
    return best


def _refine_to(
    lengths: list[int],
    parts: list[list[int]],
    target: int,
    budget: int,
    partition: Callable[[list, int], tuple[list, list]],
) -> list[list[int]]:
    """Exactly `target` ≥ len(parts) parts of local indices, each ≤ `budget`.

    First a fresh balanced partition into `target` parts; if one of its parts is over budget
    (partitions are not monotonic in the number of parts), the fitting `parts` are split
    instead: the heaviest part holding two or more sequences is cut in two, until `target`
    parts exist; when no part can be cut (fewer sequences than `target`), empty parts are added.
    """
    if len(parts) == target:
        return parts
    fresh, sums = partition(lengths, target)
    if _fits(sums, budget):
        return fresh
    work = [list(part) for part in parts]
    while len(work) < target:
        candidates = [part for part in work if len(part) > 1]
        if not candidates:
            work.append([])
            continue
        heaviest = max(candidates, key=lambda part: (sum(lengths[i] for i in part), -part[0]))
        work.remove(heaviest)
        # Two-way differencing always leaves both halves non-empty.
        halves, _ = _karmarkar_karp([lengths[i] for i in heaviest], 2, False)
        work.extend([heaviest[i] for i in half] for half in halves)
    return work


def _plan(
    lengths: list[int],
    kept: list[int],
    *,
    max_tokens: int,
    num_ranks: int,
    min_micro_batches: int,
    partition: Callable[[list, int], tuple[list, list]],
    equal_count_ranks: bool,
    alone: frozenset[int] = frozenset(),
) -> list[list[list[int]]]:
    """rank → micro-batch → global item indices, not yet ordered. The items of `alone` (longer
    than `max_tokens`) are balanced over the ranks with the others and get a micro-batch each."""
    kept_lengths = [lengths[i] for i in kept]
    if equal_count_ranks:
        rank_parts = _karmarkar_karp(kept_lengths, num_ranks, True)[0]
    else:
        rank_parts = partition(kept_lengths, num_ranks)[0]
    rank_items = [[kept[i] for i in part] for part in rank_parts]
    singles = [[[i] for i in items if i in alone] for items in rank_items]
    rest_items = [[i for i in items if i not in alone] for items in rank_items]
    rest_lengths = [[lengths[i] for i in items] for items in rest_items]
    local = [
        _split_rank(local_lengths, max_tokens, max(1, min_micro_batches - len(own)), partition)
        for local_lengths, own in zip(rest_lengths, singles)
    ]
    target = max(min_micro_batches, max(len(parts) + len(own) for parts, own in zip(local, singles)))
    local = [
        _refine_to(local_lengths, parts, target - len(own), max_tokens, partition)
        for local_lengths, parts, own in zip(rest_lengths, local, singles)
    ]
    return [
        own + [[items[i] for i in part] for part in parts]
        for items, parts, own in zip(rest_items, local, singles)
    ]


def _order(ranks: list[list[list[int]]], lengths: list[int]) -> list[list[list[int]]]:
    """Indices sorted within each micro-batch; micro-batches by decreasing tokens (ties: first index)."""
    ordered = []
    for batches in ranks:
        batches = [sorted(batch) for batch in batches]
        batches.sort(key=lambda batch: (-sum(lengths[i] for i in batch), batch[0] if batch else math.inf))
        ordered.append(batches)
    return ordered


def plan_micro_batches(
    lengths: Sequence[int],
    *,
    max_tokens: int,
    num_ranks: int = 1,
    on_too_long: str = "error",
    min_micro_batches: int = 1,
    partition: str = "karmarkar_karp",
    groups: Sequence[int] | None = None,
) -> MicroBatchPlan:
    """Assign sequences to data-parallel ranks and token-budgeted micro-batches, balanced by tokens.

    1. Sequences longer than `max_tokens` raise (`on_too_long="error"`), are left out and
       listed in `plan.skipped` (`"skip"`), or each get a micro-batch of their own, listed in
       `plan.oversized` (`"alone"`: a long rollout is still trained, in a micro-batch over the
       budget; it is placed on the ranks like any other sequence, so the ranks stay balanced).
    2. The rest are partitioned over `num_ranks` ranks, balancing total tokens.
    3. Each rank's sequences are partitioned into the fewest m balanced micro-batches whose
       token counts all fit `max_tokens` (m from ⌈tokens / max_tokens⌉ upwards).
    4. Every rank gets the same number M = max(m over ranks, `min_micro_batches`) of
       micro-batches (DeepSpeed needs the same number of forward/backward calls on every
       rank); ranks that needed fewer are re-split into M. A micro-batch is empty only on a
       rank with fewer than M sequences (the learner runs a dummy step for it). When the
       token-balanced rank split leaves such a rank but enough sequences exist, the plan is
       also made with a count-balanced rank split (`karmarkar_karp(..., equal_size=True)`)
       and the one with fewer empty micro-batches is kept.
    5. Each rank's micro-batches are ordered by decreasing token count, so micro-step j has
       similar sizes on every rank.

    With `groups`, steps 2-4 place groups instead of sequences: the sequences of one group id
    (GRPO's n samples of a prompt) stay in one micro-batch, so a learner that runs a shared
    prompt once (`rl_learner.models.shared_prefix`) runs it once per group, not once per piece.
    A group whose tokens exceed `max_tokens` is cut into consecutive pieces that fit. Placing
    whole groups balances the ranks more coarsely.

    Args:
      lengths: [n] token count of every sequence (prompt + response).
      max_tokens: token budget of one micro-batch, ≥ 1.
      num_ranks: data-parallel world size R ≥ 1 (may exceed n: those ranks get empty
        micro-batches only).
      on_too_long: one of "error", "skip", "alone".
      min_micro_batches: M is at least this (e.g. a fixed number of gradient-accumulation steps).
      partition: "karmarkar_karp" (default) or "greedy" (LPT, for comparison).
      groups: [n] group id of every sequence, or None (every sequence on its own).

    Returns:
      A `MicroBatchPlan`; every index 0..n−1 appears exactly once in `plan.ranks` or in
      `plan.skipped`. Every micro-batch holds at most `max_tokens` tokens, or exactly one
      sequence of `plan.oversized`. Deterministic for given arguments.
    """
    max_tokens = check_integer("max_tokens", max_tokens, 1)
    num_ranks = check_integer("num_ranks", num_ranks, 1)
    min_micro_batches = check_integer("min_micro_batches", min_micro_batches, 1)
    if on_too_long not in ON_TOO_LONG:
        raise ValueError(f"on_too_long must be one of {ON_TOO_LONG}, got {on_too_long!r}")
    if partition not in PARTITION_METHODS:
        raise ValueError(f"partition must be one of {PARTITION_METHODS}, got {partition!r}")
    values = _as_weights("lengths", lengths, integer=True)
    too_long = [index for index, length in enumerate(values) if length > max_tokens]
    if too_long and on_too_long == "error":
        index = too_long[0]
        raise ValueError(
            f"lengths[{index}] = {values[index]} tokens is longer than max_tokens = {max_tokens} "
            f"({len(too_long)} sequence(s) too long in all); raise max_tokens, truncate the sequence, "
            "or pass on_too_long='alone' (a micro-batch of its own) or 'skip' (left out)"
        )
    skipped = too_long if on_too_long == "skip" else []
    oversized = too_long if on_too_long == "alone" else []
    long_ones = set(too_long)
    kept = [index for index in range(len(values)) if index not in long_ones]
    options = {
        "max_tokens": max_tokens,
        "num_ranks": num_ranks,
        "min_micro_batches": min_micro_batches,
        "partition": _PARTITIONERS[partition],
    }
    units = _group_units(values, kept, groups, max_tokens) + [[index] for index in oversized]
    alone = frozenset(range(len(units) - len(oversized), len(units)))
    weights = [sum(values[i] for i in unit) for unit in units]

    def assign(equal_count_ranks: bool) -> list[list[list[int]]]:
        placed = _plan(
            weights, list(range(len(units))), equal_count_ranks=equal_count_ranks, alone=alone, **options
        )
        expanded = [[sorted(i for u in micro for i in units[u]) for micro in rank] for rank in placed]
        return _order(expanded, values)

    def finish(ranks: list[list[list[int]]]) -> MicroBatchPlan:
        return MicroBatchPlan.from_assignment(
            ranks, values, max_tokens=max_tokens, skipped=skipped, oversized=oversized
        )

    plan = finish(assign(False))
    if plan.num_empty_micro_batches and len(units) >= num_ranks * plan.num_micro_batches:
        other = finish(assign(True))
        if other.num_empty_micro_batches < plan.num_empty_micro_batches:
            plan = other
    return plan


def _group_units(
    values: Sequence[int], kept: Sequence[int], groups: Sequence[int] | None, max_tokens: int
) -> list[list[int]]:
    """The items `plan_micro_batches` places: each kept sequence alone, or with `groups` the kept
    sequences of each group id (in order of first appearance), cut into consecutive pieces of at
    most `max_tokens` tokens."""
    if groups is None:
        return [[index] for index in kept]
    if len(groups) != len(values):
        raise ValueError(
            f"groups has {len(groups)} entries but lengths has {len(values)}; one group id per sequence"
        )
    members: dict[int, list[int]] = {}
    for index in kept:
        members.setdefault(groups[index], []).append(index)
    units: list[list[int]] = []
    for indices in members.values():
        piece: list[int] = []
        tokens = 0
        for index in indices:
            if piece and tokens + values[index] > max_tokens:
                units.append(piece)
                piece, tokens = [], 0
            piece.append(index)
            tokens += values[index]
        units.append(piece)
    return units


# --------------------------------------------------------------------------- naive baseline


def fixed_size_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """The naive baseline: consecutive chunks of `batch_size` sequences (the last may be shorter)."""
    batch_size = check_integer("batch_size", batch_size, 1)
    count = len(lengths)
    return [list(range(start, min(start + batch_size, count))) for start in range(0, count, batch_size)]


def padded_fraction(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> float:
    """Share of padding when every batch is padded to its longest sequence.

    1 − Σ real tokens / Σ_batches len(batch)·max length in batch (0.0 when there are no tokens).
    """
    values = _as_weights("lengths", lengths, integer=True)
    real = padded = 0
    for batch in batches:
        if len(batch):
            batch_lengths = [values[i] for i in batch]
            real += sum(batch_lengths)
            padded += len(batch_lengths) * max(batch_lengths)
    return 1.0 - real / padded if padded else 0.0
