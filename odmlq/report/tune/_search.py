"""Choosing a candidate per group from measured sensitivities (internal).

Every group's output noise at every candidate is known (`_sensitivity`), and
noise from several groups adds up to first order, so a configuration's
accuracy can be predicted without running it. The search is greedy on
marginal value, as a knapsack with one item per group is solved well:

- towards an accuracy floor, from the cheapest configuration, repeatedly take
  the upgrade (any group, any dearer candidate) that removes the most noise
  per unit of cost, until the prediction meets the floor with a margin;
- towards a size budget, from the least noisy configuration, repeatedly take
  the downgrade that saves the most bytes per unit of added noise, until the
  budget holds;
- then trim: take back any upgrade the floor does not need.

Cost is what a group moves per inference: its weights' storage bits plus its
output activations' bits (a memory-traffic proxy for latency that also ranks
float islands last).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from odmlq.report.tune._target import TuneTarget, accuracy_of

__all__ = ["Tables", "cheapest", "downgrade", "least_noisy", "trim", "upgrade"]


@dataclasses.dataclass(frozen=True)
class Tables:
    """Per candidate c and group g: `noise[c]` (groups, outputs, samples),
    `cost[c, g]`, `weight_bits[c, g]` and `param_bits[c, g]` (stored bits of
    the group's weights, of all its parameters), `legal[c, g]`; `signal`
    (outputs, samples); `weight_elements` (all weights' elements) and
    `fixed_bits` (parameters no group owns)."""

    noise: np.ndarray
    signal: np.ndarray
    cost: np.ndarray
    weight_bits: np.ndarray
    param_bits: np.ndarray
    legal: np.ndarray
    weight_elements: float
    fixed_bits: float

    @property
    def groups(self) -> int:
        return self.cost.shape[1]

    def errors(self, config: np.ndarray) -> np.ndarray:
        return self.noise[config, np.arange(self.groups)].sum(axis=0)

    def predicted(self, config: np.ndarray) -> tuple[float, float]:
        """(lowest output SQNR dB, mean cosine), predicted."""
        return accuracy_of(self.errors(config), self.signal)

    def badness(self, target: TuneTarget) -> np.ndarray:
        """(candidates, groups): each one's noise, weighted as the target reads it."""
        if target.min_cosine is not None:
            per_sample = 1 / (2 * np.maximum(self.signal.sum(axis=0), 1e-300))
            return np.einsum("cgon,n->cg", self.noise, per_sample) / self.signal.shape[1]
        per_output = 1 / np.maximum(self.signal.sum(axis=1), 1e-300)
        return np.einsum("cgon,o->cg", self.noise, per_output)

    def bits_per_weight(self, config: np.ndarray) -> float:
        return float(self.weight_bits[config, np.arange(self.groups)].sum()) / max(self.weight_elements, 1.0)

    def bytes(self, config: np.ndarray) -> float:
        return (float(self.param_bits[config, np.arange(self.groups)].sum()) + self.fixed_bits) / 8

    def fits(self, config: np.ndarray, target: TuneTarget) -> bool:
        """Whether `config` meets the target's size budgets."""
        if target.max_bits_per_weight is not None and self.bits_per_weight(config) > target.max_bits_per_weight:
            return False
        return target.max_bytes is None or self.bytes(config) <= target.max_bytes


def cheapest(tables: Tables) -> np.ndarray:
    """Each group's legal candidate of least cost (the earlier one on a tie)."""
    cost = np.where(tables.legal, tables.cost, np.inf)
    return np.argmin(cost, axis=0)


def least_noisy(tables: Tables, badness: np.ndarray) -> np.ndarray:
    """Each group's legal candidate of least noise (the cheaper one on a tie)."""
    order = np.lexsort((tables.cost, np.where(tables.legal, badness, np.inf)), axis=0)
    return order[0]


def _greedy(config: np.ndarray, done: Callable[[np.ndarray], bool],
            ratio_of: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """`config` with the move of best ratio (candidate c for group g, from
    `ratio_of(config)[c, g]`; -inf: not a move) taken until `done` or none is left."""
    config = config.copy()
    while not done(config):
        ratio = ratio_of(config)
        if not np.isfinite(ratio).any():
            break
        c, g = np.unravel_index(np.argmax(ratio), ratio.shape)
        config[g] = c
    return config


def upgrade(tables: Tables, badness: np.ndarray, config: np.ndarray,
            enough: Callable[[np.ndarray], bool]) -> np.ndarray:
    """`config` with the upgrades of most noise removed per cost added, until `enough`."""
    groups = np.arange(tables.groups)

    def ratio_of(config):
        gain = badness[config, groups][None, :] - badness
        extra = tables.cost - tables.cost[config, groups][None, :]
        useful = tables.legal & (gain > 0) & (extra >= 0)
        return np.where(useful, gain / np.maximum(extra, 1e-9), -np.inf)

    return _greedy(config, enough, ratio_of)


def downgrade(tables: Tables, badness: np.ndarray, config: np.ndarray,
              fits: Callable[[np.ndarray], bool]) -> np.ndarray:
    """`config` with the downgrades of most bits saved per noise added, until `fits`."""
    groups = np.arange(tables.groups)

    def ratio_of(config):
        saved = tables.param_bits[config, groups][None, :] - tables.param_bits
        added = badness - badness[config, groups][None, :]
        return np.where(tables.legal & (saved > 0), saved / np.maximum(added, 1e-30), -np.inf)

    return _greedy(config, fits, ratio_of)


def trim(tables: Tables, badness: np.ndarray, config: np.ndarray,
         enough: Callable[[np.ndarray], bool]) -> np.ndarray:
    """`config` with groups moved to cheaper candidates while `enough` still
    holds, the moves that save the most cost per noise added first."""
    config = config.copy()
    groups = np.arange(tables.groups)
    while True:
        saved = tables.cost[config, groups][None, :] - tables.cost
        added = badness - badness[config, groups][None, :]
        ratio = np.where(tables.legal & (saved > 0), saved / np.maximum(added, 1e-30), -np.inf)
        moved = False
        for flat in np.argsort(-ratio, axis=None):
            c, g = np.unravel_index(flat, ratio.shape)
            if not np.isfinite(ratio[c, g]):
                break
            trial = config.copy()
            trial[g] = c
            if enough(trial):
                config, moved = trial, True
                break
        if not moved:
            return config
