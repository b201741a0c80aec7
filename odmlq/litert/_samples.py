"""Which rows an export is verified on (internal; `verify` and the exports):
held-back rows of the representative dataset, then perturbed copies of the
first of them that lie outside the calibrated ranges."""

from __future__ import annotations

import jax
import numpy as np

from odmlq.batches import leaves, model_inputs, row_count, sliced

__all__ = ["held_back_count", "verification_samples"]


def verification_samples(held_back: list, samples: int) -> list:
    """Up to `samples` held-back rows, then perturbed copies of the first ones
    (see `_unseen`): what an export is verified on."""
    rows = _limit(held_back, samples)
    return rows + _unseen(rows)


def held_back_count(held_back: list, samples: int) -> int:
    """How many of `verification_samples` are held-back data, before the perturbed copies."""
    return len(_limit(held_back, samples))


def _limit(batches: list, samples: int) -> list:
    out, count = [], 0
    for batch in batches:
        inputs = model_inputs(batch)
        take = max(0, min(samples - count, row_count(inputs)))
        if take:
            out.append(sliced(inputs, 0, take))
            count += take
    return out


# Rows of the held-back batch verified again perturbed (calibration saw none
# of them): scaled beyond the calibrated ranges (clipping), and with noise.
_UNSEEN_ROWS, _UNSEEN_SCALE, _UNSEEN_NOISE = 4, 1.5, 0.3


def _unseen(samples: list) -> list:
    """Perturbed copies of the first held-back rows' float inputs (integer
    inputs, token ids and masks, are kept): end to end and op by op, the
    export must also agree with simulate on inputs that set no range."""
    if not samples:
        return []
    first = sliced(samples[0], 0, _UNSEEN_ROWS)
    if not any(np.issubdtype(x.dtype, np.floating) for x in leaves(first)):
        return []
    rng = np.random.default_rng(0)

    def scaled(x):
        return (_UNSEEN_SCALE * x).astype(x.dtype) if np.issubdtype(x.dtype, np.floating) else x

    def noisy(x):
        if not np.issubdtype(x.dtype, np.floating):
            return x
        spread = float(np.std(x)) or 1.0
        return (x + _UNSEEN_NOISE * spread * rng.standard_normal(x.shape)).astype(x.dtype)

    return [tuple(jax.tree_util.tree_map(scaled, first)), tuple(jax.tree_util.tree_map(noisy, first))]
