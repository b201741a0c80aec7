"""Timing calls against each other in interleaved rounds.

A speed ratio measured on a shared machine holds only if both sides see the
same load: every call is timed in every round, rounds alternate between the
calls (in orders where each call runs right after every other one equally
often), and each call's median over rounds is kept. `odmlq.litert.
interleaved_latency` times .tflite files this way; autotune's latency budget,
the benchmarks and the samples time jitted functions with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["balanced_orders", "interleaved_ms", "interleaved_rounds"]


def interleaved_ms(calls: Mapping[str, Callable[[], Any]] | Sequence[Callable[[], Any]], *, rounds: int = 7,
                   repeats: int | None = None, round_ms: float = 20.0) -> Any:
    """Median milliseconds per call of each call, all timed in the same rounds.

    Each call is made once first (a jitted function compiles), then each
    round makes every call `repeats` times, waiting for each result
    (`jax.block_until_ready`: latency, not dispatch).

    Args:
      calls: ``name: call`` or a list of calls, each taking no arguments.
      rounds: rounds timed.
      repeats: calls per round; default: for each call, as many as take
        `round_ms` by its first timed run.
      round_ms: see `repeats`.

    Returns:
      ``name: ms`` for a mapping, a list of ms for a list.
    """
    names = list(calls) if isinstance(calls, Mapping) else list(range(len(calls)))
    times = interleaved_rounds([calls[n] for n in names], rounds=rounds, repeats=repeats, round_ms=round_ms)
    medians = [float(np.median(t)) for t in times]
    return dict(zip(names, medians)) if isinstance(calls, Mapping) else medians


def interleaved_rounds(calls: Sequence[Callable[[], Any]], *, rounds: int = 7, repeats: int | None = None,
                       round_ms: float = 20.0) -> list[list[float]]:
    """Milliseconds per call of each call in each round (`interleaved_ms`'s
    timings before the median): ``times[i][r]`` is call i in round r, so two
    calls' round-r times are a pair taken under the same load.

    `repeats` None: each call is repeated as often as takes it `round_ms`
    (from its first timed run), so a fast call is not timed on one cold run
    next to a slow one. The order of the calls changes each round so that
    each call follows every other call equally often over a cycle of rounds
    (a Williams design): a call that evicts the caches (a large model) does
    not always slow the same neighbour down."""
    import jax

    fns = list(calls)
    for fn in fns:
        jax.block_until_ready(fn())
    if repeats is None:
        counts = []
        for fn in fns:
            start = time.perf_counter()
            jax.block_until_ready(fn())
            counts.append(max(1, int(round_ms / max((time.perf_counter() - start) * 1e3, 1e-3))))
    else:
        counts = [repeats] * len(fns)
    orders = balanced_orders(len(fns))
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for i in orders[r % len(orders)]:
            start = time.perf_counter()
            for _ in range(counts[i]):
                jax.block_until_ready(fns[i]())
            times[i].append((time.perf_counter() - start) * 1e3 / counts[i])
    return times


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of `n` calls in which every call comes right after every other
    call equally often: n orders (2n for odd n), a Williams design."""
    if n <= 2:
        return [list(range(n))] if n < 2 else [[0, 1], [1, 0]]
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low if len(first) % 2 else high)
        low, high = (low + 1, high) if len(first) % 2 == 0 else (low, high - 1)
    orders = [[(i + r) % n for i in first] for r in range(n)]
    return orders + [order[::-1] for order in orders] if n % 2 else orders
