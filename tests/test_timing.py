"""odmlq.timing.interleaved_ms: the helper every latency ratio is measured with."""

import time

import jax
import jax.numpy as jnp

from odmlq.timing import interleaved_ms


def test_each_call_gets_its_own_median_in_the_order_given():
    calls = {"sleeps 3 ms": lambda: time.sleep(0.003), "returns": lambda: None}
    ms = interleaved_ms(calls, rounds=3, repeats=2)
    assert list(ms) == list(calls)
    assert ms["sleeps 3 ms"] >= 3.0  # time.sleep waits at least that long
    assert ms["returns"] < ms["sleeps 3 ms"]
    assert interleaved_ms([calls["returns"], calls["sleeps 3 ms"]], rounds=1, repeats=1)[1] >= 3.0


def test_a_jitted_call_is_compiled_before_timing_and_waited_for():
    """The first call (compilation, seconds) is made before the rounds, so no
    round includes it; each result is waited for (block_until_ready)."""
    seen = []

    @jax.jit
    def f(x):
        return jnp.sin(x) @ x.T

    x = jnp.ones((64, 64))
    ms = interleaved_ms([lambda: seen.append(1) or f(x)], rounds=2, repeats=3)
    assert len(seen) == 1 + 2 * 3  # the warm-up, then 2 rounds of 3
    assert ms[0] > 0
    seen.clear()
    interleaved_ms([lambda: seen.append(1) or f(x)], rounds=2, round_ms=0.0)
    assert len(seen) == 1 + 1 + 2 * 1  # warm-up, one call that sizes a round (0 ms: 1 call), 2 rounds


def test_rounds_are_kept_per_call_and_pair_up():
    """interleaved_rounds gives each call's time in every round (the medians
    of interleaved_ms are taken over them): the 3 ms sleep is the slower in
    every one of its pairs."""
    from odmlq.timing import interleaved_rounds

    slow, fast = interleaved_rounds([lambda: time.sleep(0.003), lambda: None], rounds=5, repeats=2)
    assert len(slow) == len(fast) == 5
    assert all(s >= 3.0 and f < s for s, f in zip(slow, fast))


def test_every_call_follows_every_other_equally_often():
    """A call that empties the caches (a large model) slows whichever call
    runs next: over a cycle of rounds each call runs right after each other
    one equally often, for even and odd counts (rotating one order does not:
    with 4 calls, call 1 would follow call 0 in every round but one)."""
    from collections import Counter

    from odmlq.timing import balanced_orders

    for n in range(1, 9):
        orders = balanced_orders(n)
        assert len(orders) == (n if n % 2 == 0 or n == 1 else 2 * n)
        assert all(sorted(order) == list(range(n)) for order in orders)
        follows = Counter((order[i], order[i + 1]) for order in orders for i in range(n - 1))
        assert len(follows) == n * (n - 1) and len(set(follows.values())) <= 1, (n, follows)
