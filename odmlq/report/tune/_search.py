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
float islands last), plus, on LiteRT, the conversions where it meets a
neighbour of another activation qtype (`Boundaries`: a QUANTIZE or DEQUANTIZE writes
the edge again, and is one more op and tensor in the file; so does the
separator before an integer edge's conversion to another integer qtype). That last term
is pairwise: a move's cost depends on the neighbours' candidates, so every
move is costed against the configuration it is taken from.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from odmlq.report.tune._target import TuneTarget, accuracy_of

__all__ = ["Boundaries", "Tables", "cheapest", "downgrade", "least_noisy", "trim", "upgrade"]

# What a conversion stores beside moving its edge: one op and one tensor in a
# .tflite (MiniLM: 2,576 bytes for 17 more conversion ops and 20 tensors).
CONVERSION_OVERHEAD_BITS = 8 * 150.0


@dataclasses.dataclass(frozen=True)
class Boundaries:
    """Where groups meet: the edges that one group writes and another reads
    (or an op no candidate quantizes, or the model's caller: float).

    Each edge is read in each reader's activation qtype; an edge read in a
    qtype other than its producer's needs one conversion per qtype read (one
    QUANTIZE shared by every reader of that qtype, as `Plan.conversions`
    makes them; a DEQUANTIZE for a float reader), which writes the edge
    again: `elements x converted bits` (counted as a group's cost counts its
    output activations, by what is written) plus `CONVERSION_OVERHEAD_BITS`.

    Attributes:
      domain: (candidates,) the index into `domain_bits` of the qtype a
        candidate's output edges hold (0: float, also for weight-only and
        dynamic candidates, whose edges stay float).
      domain_bits: (domains,) bits per element of each (32 for float).
      edges: (elements per sample, producer group or -1, reader groups
        (-1 for a float reader)) per edge where groups meet.
      separated: (edge index, candidate) where the edge's producer, on that
        candidate, writes it at a scale of its own: converted to another
        integer qtype, it is read after a separator (a same-scale MAXIMUM,
        `odmlq.litert.spec.requantized_from_producer`), which writes the edge
        once more at the producer's bits, one more op beside the QUANTIZE.
    """

    domain: np.ndarray
    domain_bits: np.ndarray
    edges: tuple[tuple[float, int, tuple[int, ...]], ...]
    separated: frozenset[tuple[int, int]] = frozenset()

    @functools.cached_property
    def _by_group(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for i, (_, producer, readers) in enumerate(self.edges):
            for g in {producer, *readers} - {-1}:
                out.setdefault(g, []).append(i)
        return out

    def _converted(self, i: int, config: np.ndarray) -> set[int]:
        """The domains edge i is converted to under `config` (those its readers read it in, but its producer's)."""
        _, producer, readers = self.edges[i]
        source = 0 if producer < 0 else self.domain[config[producer]]
        return {0 if g < 0 else self.domain[config[g]] for g in readers} - {source}

    def _separators(self, i: int, config: np.ndarray, converted: set[int]) -> int:
        """How many separators edge i needs under `config`, given the domains it is
        `converted` to: one per integer domain, where its producer sets its own
        scale (`separated` holds integer candidates only)."""
        producer = self.edges[i][1]
        if producer < 0 or (i, int(config[producer])) not in self.separated:
            return 0
        return sum(d != 0 for d in converted)

    def edge_cost(self, i: int, config: np.ndarray) -> float:
        """The conversions' cost at edge i under `config`, their separators' included."""
        elements = self.edges[i][0]
        converted = self._converted(i, config)
        cost = sum(elements * self.domain_bits[d] + CONVERSION_OVERHEAD_BITS for d in converted)
        separators = self._separators(i, config, converted)
        if separators:
            produced_bits = self.domain_bits[self.domain[config[self.edges[i][1]]]]
            cost += separators * (elements * produced_bits + CONVERSION_OVERHEAD_BITS)
        return cost

    def conversions(self, config: np.ndarray) -> int:
        """How many conversion ops (QUANTIZE, DEQUANTIZE) `config` needs."""
        return sum(len(self._converted(i, config)) for i in range(len(self.edges)))

    def separators(self, config: np.ndarray) -> int:
        """How many separator ops (MAXIMUM) `config` needs."""
        return sum(self._separators(i, config, self._converted(i, config)) for i in range(len(self.edges)))

    def cost(self, config: np.ndarray) -> float:
        """Bits the conversions of `config` move and store."""
        return float(sum(self.edge_cost(i, config) for i in range(len(self.edges))))

    def moves(self, config: np.ndarray) -> np.ndarray:
        """(candidates, groups): how much the conversions' cost changes when
        group g alone takes candidate c."""
        delta = np.zeros((len(self.domain), len(config)))
        for g, edges in self._by_group.items():
            held = sum(self.edge_cost(i, config) for i in edges)
            trial = config.copy()
            for c in range(len(self.domain)):
                if self.domain[c] == self.domain[config[g]]:
                    continue
                trial[g] = c
                delta[c, g] = sum(self.edge_cost(i, trial) for i in edges) - held
        return delta


@dataclasses.dataclass(frozen=True)
class Tables:
    """Per candidate c and group g: `noise[c]` (groups, outputs, samples),
    `cost[c, g]` (what the group moves), `weight_bits[c, g]` and `param_bits[c, g]`
    (stored bits of the group's weights, of all its parameters),
    `legal[c, g]`; `signal` (outputs, samples); `weight_elements` (all
    weights' elements), `fixed_bits` (parameters no group owns) and
    `boundaries` (the conversions between groups)."""

    noise: np.ndarray
    signal: np.ndarray
    cost: np.ndarray
    weight_bits: np.ndarray
    param_bits: np.ndarray
    legal: np.ndarray
    weight_elements: float
    fixed_bits: float
    boundaries: Boundaries | None = None

    @property
    def groups(self) -> int:
        return self.cost.shape[1]

    def total_cost(self, config: np.ndarray) -> float:
        """What `config` moves per inference: every group's cost, and the conversions between groups."""
        own = float(self.cost[config, np.arange(self.groups)].sum())
        return own + (self.boundaries.cost(config) if self.boundaries is not None else 0.0)

    def moves(self, config: np.ndarray) -> np.ndarray:
        """(candidates, groups): the change of `total_cost` when group g alone takes candidate c."""
        own = self.cost - self.cost[config, np.arange(self.groups)][None, :]
        return own + (self.boundaries.moves(config) if self.boundaries is not None else 0.0)

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
    """Each group's legal candidate of least cost (the earlier one on a tie),
    then any move that makes the whole cheaper (fewer conversions)."""
    cost = np.where(tables.legal, tables.cost, np.inf)
    return trim(tables, np.zeros_like(tables.cost), np.argmin(cost, axis=0), lambda config: True)


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
        extra = tables.moves(config)  # a move that also saves cost comes first
        return np.where(tables.legal & (gain > 0), gain / np.maximum(extra, 1e-9), -np.inf)

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
        saved = -tables.moves(config)
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
