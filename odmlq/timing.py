"""Timing calls against each other in interleaved rounds.

A speed ratio measured on a shared machine holds only if both sides see the
same load: every call is timed in every round, rounds alternate between the
calls (in an order rotated each round, so none always runs right after
another), and each call's median over rounds is kept. `odmlq.litert.
interleaved_latency` times .tflite files this way; autotune's latency budget,
the benchmarks and the samples time jitted functions with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["interleaved_ms", "interleaved_rounds"]


def interleaved_ms(calls: Mapping[str, Callable[[], Any]] | Sequence[Callable[[], Any]], *, rounds: int = 7,
                   repeats: int | None = None, round_ms: float = 20.0) -> Any:
    """Median milliseconds per call of each call, all timed in the same rounds.

    Each call is made once first (a jitted function compiles), then each
    round makes every call `repeats` times, waiting for each result
    (`jax.block_until_ready`: latency, not dispatch).

    Args:
      calls: ``name: call`` or a list of calls, each taking no arguments.
      rounds: rounds timed.
      repeats: calls per round; default: as many as take `round_ms` for the
        slowest call's first timed run.
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
    calls' round-r times are a pair taken under the same load."""
    import jax

    fns = list(calls)
    for fn in fns:
        jax.block_until_ready(fn())
    if repeats is None:
        slowest = 0.0
        for fn in fns:
            start = time.perf_counter()
            jax.block_until_ready(fn())
            slowest = max(slowest, (time.perf_counter() - start) * 1e3)
        repeats = max(1, int(round_ms / max(slowest, 1e-3)))
    times: list[list[float]] = [[] for _ in fns]
    for r in range(rounds):
        for i in [(r + k) % len(fns) for k in range(len(fns))]:
            start = time.perf_counter()
            for _ in range(repeats):
                jax.block_until_ready(fns[i]())
            times[i].append((time.perf_counter() - start) * 1e3 / repeats)
    return times
