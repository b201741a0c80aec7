"""Where autotune's configurations may run on LiteRT (internal): the search's
base class.

A configuration the search proposes is made legal before it is measured:
groups whose precisions the converter cannot convert between are resolved
(`legalize`), a group litert-converter refuses is moved off that candidate
(`convertible`), and with a latency target, a group XNNPACK would leave to
LiteRT's reference kernels is too (`delegated`, `gate_placement`). Each move
withdraws the candidate from the group, with a note, so the search does not
propose it again.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from odmlq import litert
from odmlq.errors import OdmlqError, PlanError
from odmlq.report.tune._converts import Converts, refused_group
from odmlq.report.tune._latency import Timer
from odmlq.report.tune._model import TunedModel, rules_for
from odmlq.rules import UnmatchedRuleWarning

__all__ = ["Placement"]


class Placement:
    """Makes configurations legal on the tuned model's backend.

    Attributes: `tuned`, `tables` (whose `legal` shrinks as candidates are
    withdrawn), `badness` (noise per candidate and group, for the least
    noisy move), `say` (progress), `converts` (the conversion checks),
    `timer` (None without a latency target)."""

    def __init__(self, tuned: TunedModel, tables, badness: np.ndarray, say, timed: bool):
        self.tuned, self.tables, self.badness, self.say = tuned, tables, badness, say
        self._checks: dict[bytes, tuple] = {}
        self.converts = Converts(tuned)
        self.timer = Timer(tuned, self.converts) if timed else None
        if self.timer is not None and tuned.backend != "xla":
            self.gate_placement()

    def gate_placement(self) -> None:
        """Latency-gated placement, before the search: a group is not offered a
        quantized candidate at which XNNPACK leaves one of its ops to LiteRT's
        reference kernels (slower than float there, and a split of the graph)."""
        self.say("exporting each candidate to see which groups XNNPACK runs")
        off = self.timer.off_delegate_by_candidate() & self.tables.legal
        for c, g in zip(*np.nonzero(off)):
            if self.tables.legal[:, g].sum() >= 2:
                self._withdraw(c, g, _off_delegate(self.tuned.candidates[c].name))

    def _withdraw_overridden(self, base, requested, legalized) -> None:
        """Withdraws each move of the last step (group g from `base[g]` to
        `requested[g]`) that making the configuration legal overrode: the
        search predicted and costed the move, LiteRT got another candidate,
        and offering the move again would spend the next trials on it."""
        for g in np.flatnonzero((requested != base) & (legalized != requested)):
            c = requested[g]
            if not self.tables.legal[c, g] or self.tables.legal[:, g].sum() < 2:
                continue
            name, got = self.tuned.candidates[c].name, self.tuned.candidates[legalized[g]].name
            self._withdraw(c, g, f"chosen at {name!r}, LiteRT runs it only at {got!r} next to its "
                                 "neighbours' precisions; not offered again")
            self.say(f"{self.tuned.groups[g]}: {name} withdrawn (made {got} to agree with its neighbours)")

    def _withdraw(self, c: int, g: int, why: str, everywhere: bool = False) -> None:
        """Candidate c is not offered to group g again, with a note saying
        `why`. `everywhere`: the backend cannot run it at all (the reported
        sensitivities drop it too), not only this search."""
        self.tables.legal[c, g] = False
        if everywhere:
            self.tuned.legal[c, g] = False
        self.tuned.notes.append(f"{self.tuned.groups[g]}: {why}")

    def legalize(self, config) -> tuple[np.ndarray, Any]:
        """`config` made legal on LiteRT, and its plan.

        Where LiteRT cannot convert between two groups (`litert.check_plan`:
        a CONCATENATION reading an input of another qtype, a float layout op
        between two qtypes, ...), the two groups are resolved one of three
        ways: the producer's or the reader's group in float (a float op is
        the converter's one legal separator), or both on one candidate legal
        for both. Each way is checked; the ones that raise a conflict of their
        own groups at once are taken last, then the ones that store more
        bits of parameters (floating a group with weights quadruples them:
        the search chose their precision for its size). Then the ways that
        add no predicted noise, then the cheapest.

        Groups joined on one candidate form clusters that only grow and stay
        together, and a cluster put in float is never in a conflict again, so
        this ends."""
        tuned = self.tuned
        config = config.copy()
        cluster = list(range(len(tuned.groups)))

        def root(g):
            while cluster[g] != g:
                g = cluster[g]
            return g

        plan, error = self._checked(config)
        for _ in range(2 * len(tuned.groups) + 1):
            if error is None:
                return config, plan
            involved = sorted({root(tuned.op_group[o]) for o in error.ops if o in tuned.op_group})
            if len(involved) < 2:
                raise error
            clusters = [[g for g in range(len(tuned.groups)) if root(g) == r] for r in involved]
            best = None
            for label, members, candidate in self._resolutions(config, involved, clusters):
                trial = config.copy()
                trial[members] = candidate
                trial_plan, trial_error = self._checked(trial)
                cascades = trial_error is not None and any(
                    tuned.op_group.get(o) in members for o in trial_error.ops)
                held = _summed(self.badness, config)
                added = _summed(self.badness, trial) - held
                noisier = added > 1e-9 * max(held, 1e-300)
                grows = _summed(self.tables.param_bits, trial) > _summed(self.tables.param_bits, config)
                extra = self.tables.total_cost(trial) - self.tables.total_cost(config)
                key = (cascades, grows, noisier, added if noisier else 0.0, extra)
                if best is None or key < best[0]:
                    best = (key, label, members, trial, trial_plan, trial_error)
            if best is None:
                raise error
            _, label, members, config, plan, error = best
            if label.startswith("joined"):
                for r in involved[1:]:
                    cluster[r] = involved[0]
            self.say(f"{label} {len(members)} groups ({', '.join(tuned.groups[g] for g in members[:3])}"
                     f"{', ...' if len(members) > 3 else ''}) on {tuned.candidates[config[members[0]]].name}: "
                     "LiteRT converts between them only through a float op")
        raise PlanError("autotune: could not make the chosen precisions agree on LiteRT; "
                        "tune with fewer candidates (candidates=['int8', 'float']).")

    def _resolutions(self, config, involved: list[int], clusters: list[list[int]]):
        """(label, groups, candidate) for each way to resolve a conflict
        between the clusters of `involved`: each cluster in float, or all on
        one candidate legal for every member."""
        legal, candidates = self.tables.legal, self.tuned.candidates
        floats = [c for c, candidate in enumerate(candidates) if candidate.is_float]
        for members in clusters:
            if floats and config[members[0]] not in floats:
                yield "floated", members, floats[0]
        everyone = sorted(g for members in clusters for g in members)
        for c in range(len(candidates)):
            if legal[c, everyone].all():
                yield "joined", everyone, c

    def _checked(self, config) -> tuple[Any, PlanError | None]:
        """The plan of `config`, and LiteRT's objection to it (None: it holds)."""
        key = config.tobytes()
        if key not in self._checks:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UnmatchedRuleWarning)
                plan = self.tuned.base.replan(rules_for(self.tuned, config))
            error = None
            if self.tuned.backend != "xla":
                try:
                    litert.check_plan(plan, allow_float_ops=True)
                except PlanError as e:
                    error = e
            self._checks[key] = (plan, error)
        return self._checks[key]

    def convertible(self, config, plan) -> tuple[np.ndarray, Any]:
        """`config` and its plan, with each group whose candidate litert-converter
        refuses (`_converts.refused_group`) moved to its least noisy other
        candidate; that candidate is not offered to the group again."""
        tuned = self.tuned
        floats = next((c for c, candidate in enumerate(tuned.candidates) if candidate.is_float), None)
        for _ in range(self.tables.legal.size):
            if self.converts(config):
                return config, plan
            if floats is None:
                raise OdmlqError("autotune: litert-converter refuses the chosen rules (odmlq.litert.check_plan "
                                 "passes them), and without the 'float' candidate the group it refuses "
                                 "cannot be found; add 'float' to candidates.")
            g = refused_group(config, floats, self._plan_of, self.converts)
            name = tuned.candidates[config[g]].name
            self._withdraw(config[g], g, f"litert-converter refuses it at {name!r} (the model converts with it "
                           "and the groups after it in float, not with it quantized too); not offered",
                           everywhere=True)
            self.say(f"litert-converter refuses {tuned.groups[g]} at {name}; not offered")
            config = config.copy()
            config[g] = min(np.flatnonzero(self.tables.legal[:, g]), key=lambda c: self.badness[c, g])
            config, plan = self.legalize(config)
        raise OdmlqError("autotune: litert-converter kept refusing the chosen rules; tune with fewer "
                         "candidates (candidates=['int8', 'float']).")

    def delegated(self, config, plan) -> tuple[np.ndarray, Any]:
        """Latency-gated placement on LiteRT: `config` and its plan with each
        group that has a quantized op XNNPACK does not run (`Timer.off_delegate`:
        it would run on LiteRT's reference kernels and split the graph) moved
        to its least noisy other candidate; that candidate is not offered to
        the group again. A group with no other candidate stays."""
        tuned, legal, stays = self.tuned, self.tables.legal, set()
        for _ in range(legal.size):
            outside = [g for g in self.timer.off_delegate(config) if g not in stays]
            if not outside:
                return config, plan
            config = config.copy()
            for g in outside:
                name = tuned.candidates[config[g]].name
                if legal[:, g].sum() < 2:
                    stays.add(g)
                    tuned.notes.append(f"{tuned.groups[g]}: XNNPACK does not run it at {name!r}, and no other "
                                       "candidate is offered to it; it stays (latency target)")
                    continue
                self._withdraw(config[g], g, _off_delegate(name))
                config[g] = min(np.flatnonzero(legal[:, g]), key=lambda c: self.badness[c, g])
                self.say(f"{tuned.groups[g]}: {name} is off XNNPACK; now {tuned.candidates[config[g]].name}")
            config, plan = self.legalize(config)
            config, plan = self.convertible(config, plan)
        raise OdmlqError("autotune: could not place every quantized group on XNNPACK; tune with fewer "
                         "candidates (candidates=['int8', 'float']).")

    def _plan_of(self, config):
        plan, error = self._checked(config)
        if error is not None:
            raise error
        return plan


def _off_delegate(name: str) -> str:
    """The note for a candidate withdrawn because XNNPACK leaves an op of it to LiteRT."""
    return (f"XNNPACK does not run it at {name!r}; not offered (latency target: it would run on LiteRT's "
            "reference kernels)")


def _summed(table: np.ndarray, config: np.ndarray) -> float:
    """Sum over groups of `table[candidate, group]` at each group's candidate."""
    return float(table[config, np.arange(len(config))].sum())
