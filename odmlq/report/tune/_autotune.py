"""`autotune`: the rules that meet an accuracy floor or a size budget (internal)."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from odmlq.batches import model_inputs, sliced
from odmlq.errors import OdmlqError, RuleError
from odmlq.progress import Bar, shown
from odmlq.report.tune import _search
from odmlq.report.tune._candidates import Candidate, default_candidates, parse_candidates
from odmlq.report.tune._checks import check_rules
from odmlq.report.tune._model import BACKENDS, TunedModel, rules_for
from odmlq.report.tune._placement import Placement
from odmlq.report.tune._result import Trial, TuneResult
from odmlq.report.tune._sensitivity import energies, group_noise, output_errors
from odmlq.report.tune._target import Measured, TuneTarget, accuracy_of

__all__ = ["autotune"]

# Each failed trial raises the margin the prediction must clear by at least
# this much (dB), so the search never re-proposes a configuration.
_MIN_STEP_DB = 0.5


def autotune(model: Any, variables: Any = None, rep_dataset: Iterable | Callable | None = None, *,
             target: TuneTarget, eval_fn: Callable[[Callable], float] | None = None,
             eval_inputs: Iterable | None = None, candidates: Sequence[Candidate | str] | None = None,
             backend: str = "litert", example_inputs: Sequence[Any] | None = None, calibration=None,
             max_trials: int = 8, check: bool = True, progress: bool | None = None) -> TuneResult:
    """Finds rules that meet `target`, choosing a precision per group of ops.

    A group is the ops at one module path (what one rule addresses). For each
    candidate precision the model is planned once and every group's effect on
    the outputs measured alone (`simulate`, one jitted run per candidate);
    the search then predicts configurations from these (noise adds up) and
    measures each one it proposes for real, raising its margin when the
    prediction was optimistic. On LiteRT a group is only offered candidates
    whose every op LiteRT runs so (`odmlq.litert.check_plan`).

    Args:
      model, variables: the float model (Linen: its variables; NNX: None).
      rep_dataset: representative batches (as `odmlq.calibrate` takes).
      target: a `TuneTarget` (accuracy floor, size budget, or both).
      eval_fn: ``eval_fn(apply) -> float``, higher is better, where
        ``apply(*inputs)`` runs a configuration (simulated) or the float model;
        needed for `min_metric` / `max_metric_drop`.
      eval_inputs: batches the SQNR and cosine are measured on (default: the
        representative batches).
      candidates: names (``'float'``, ``'int16x8'``, ``'int8'``, ``'int4'``,
        ``'w8'``, ``'w4'``, ``'w2'``) or `odmlq.Candidate`s; default by backend
        and target (`default_candidates`).
      backend: ``'litert'`` (rules LiteRT can honour; plan constraints of
        LiteRT), ``'xla'``, or ``'both'`` (LiteRT's legality, both checks).
      example_inputs: inputs fixing the traced shapes (default: the first batch).
      calibration: statistics to start from (default: observed here).
      max_trials: configurations measured at most.
      check: run the chosen rules on the backend(s): export and verify the
        .tflite (LiteRT), quantize and run (XLA), each against float.
      progress: progress on stderr (default: when stderr is a terminal).

    Returns:
      A `TuneResult`: `rules`, `trials` (the measured trade-offs), `met`.

    Raises:
      RuleError: a bad target, candidate or backend, or a metric target without `eval_fn`.

    Example:
      >>> result = odmlq.autotune(model, variables, batches, target=odmlq.TuneTarget(min_cosine=0.995))
      >>> print(result)
      >>> result.save_rules('rules.yaml')
    """
    start = time.perf_counter()
    if not isinstance(target, TuneTarget):
        raise RuleError(f"target must be an odmlq.TuneTarget, got {target!r}.")
    if target.needs_metric and eval_fn is None:
        raise RuleError("TuneTarget min_metric / max_metric_drop read eval_fn's value; pass "
                        "eval_fn=lambda apply: accuracy(apply(x_held_out), y_held_out).")
    if backend not in BACKENDS:
        raise RuleError(f"backend={backend!r}; choose one of {sorted(BACKENDS)}.")
    if not isinstance(max_trials, int) or max_trials < 1:
        raise RuleError(f"max_trials={max_trials!r} must be a positive integer.")
    candidates = (default_candidates(backend, target.has_size) if candidates is None
                  else parse_candidates(candidates))
    show = shown(progress)
    say = (lambda text: print(f"autotune: {text}", file=sys.stderr, flush=True)) if show else (lambda text: None)
    batches = _batches(rep_dataset, "rep_dataset")
    eval_batches = batches if eval_inputs is None else _batches(eval_inputs, "eval_inputs")
    example = tuple(example_inputs) if example_inputs is not None else batches[0]
    say(f"tracing and planning {len(candidates)} candidates")
    tuned = TunedModel(model, variables, batches, eval_batches, candidates, backend, calibration, example)
    if not tuned.groups:
        raise OdmlqError("autotune: no candidate quantizes any op of this model; nothing to choose.")
    tables = _tables(tuned, progress)
    float_metric = eval_fn(tuned.float_apply) if eval_fn is not None else None
    search = _Search(tuned, tables, target, eval_fn, float_metric, say)
    config = search.run(max_trials)
    best = search.best(config)
    rules = rules_for(tuned, best)
    trial = search.trials[search.index_of(best)]
    checks = check_rules(tuned, rules, best, say) if check else {}
    sensitivity = {path: {c.name: _alone_db(tables, ci, g) for ci, c in enumerate(candidates)
                          if tuned.legal[ci, g] and not c.is_float}
                   for g, path in enumerate(tuned.groups)}
    return TuneResult(rules=rules, choices={p: candidates[c].name for p, c in zip(tuned.groups, best)},
                      trials=list(search.trials), measured=trial.measured, met=trial.met, misses=trial.misses,
                      target=target, float_metric=float_metric, sensitivity=sensitivity, checks=checks,
                      notes=list(tuned.notes), seconds=time.perf_counter() - start)


def _batches(data, what: str) -> list[tuple]:
    if data is None:
        raise RuleError(f"autotune needs {what}: batches of the model's inputs.")
    data = data() if callable(data) else data
    out = [sliced(model_inputs(b), 0, None) for b in data]
    if not out:
        raise RuleError(f"autotune: {what} holds no batches.")
    return out


def _tables(tuned: TunedModel, progress: bool | None) -> _search.Tables:
    groups, outputs = len(tuned.groups), len(tuned.reference[0])
    samples = sum(np.shape(r[0])[0] for r in tuned.reference)
    noise = np.zeros((len(tuned.candidates), groups, outputs, samples))
    for c, (candidate, plan) in enumerate(zip(tuned.candidates, tuned.plans)):
        if candidate.is_float:
            continue
        only = list(np.flatnonzero(tuned.legal[c]))
        scales = tuned.scales(plan)
        with Bar(f"autotune: sensitivity at {candidate.name}", total=len(only), progress=progress,
                 unit="group") as bar:
            noise[c] = group_noise(tuned.model, plan, scales, tuned.params, tuned.eval_batches,
                                   tuned.reference, tuned.op_group, groups, variables=tuned.variables, only=only,
                                   on_group=bar.tick)
    noise = np.where(np.isfinite(noise), noise, 1e30)  # a run that overflowed: the worst noise
    signal = np.concatenate([energies(ref) for ref in tuned.reference], axis=1)
    # The search's own copy: it withdraws candidates it finds it cannot get.
    return _search.Tables(noise=noise, signal=signal, legal=tuned.legal.copy(), **tuned.costs())


def _alone_db(tables: _search.Tables, c: int, g: int) -> float:
    noise = tables.noise[c, g].sum(axis=1)
    power = tables.signal.sum(axis=1)
    ratios = [10 * np.log10(p / n) if n > 0 else np.inf for p, n in zip(power, noise)]
    return float(min(ratios))


class _Search(Placement):
    """The search loop: predict, measure, adjust the margin (each
    configuration made legal first: `Placement`)."""

    def __init__(self, tuned: TunedModel, tables, target: TuneTarget, eval_fn, float_metric, say):
        super().__init__(tuned, tables, tables.badness(target), say, timed=target.has_latency)
        self.target, self.eval_fn, self.float_metric = target, eval_fn, float_metric
        self.trials: list[Trial] = []
        self.configs: list[np.ndarray] = []
        self.margin_db = 0.0

    def slack_db(self, config) -> float:
        """How far (dB of noise) the predicted accuracy clears the floors."""
        sqnr, cosine = self.tables.predicted(config)
        slack = np.inf
        if self.target.min_sqnr_db is not None:
            slack = min(slack, sqnr - self.target.min_sqnr_db)
        if self.target.min_cosine is not None:
            slack = min(slack, 10 * np.log10(max(1 - self.target.min_cosine, 1e-12) / max(1 - cosine, 1e-12)))
        return slack

    def enough(self, config) -> bool:
        return self.slack_db(config) >= self.margin_db

    def fits(self, config) -> bool:
        return self.tables.fits(config, self.target)

    def run(self, max_trials: int) -> np.ndarray:
        tables, badness = self.tables, self.badness
        if self.target.has_size:
            config = _search.downgrade(tables, badness, _search.least_noisy(tables, badness), self.fits)
            if self.target.has_accuracy and not self.target.needs_metric:
                config = _search.trim(tables, badness, config, lambda c: self.fits(c) and self.enough(c)) \
                    if self.enough(config) else config
            self.measure(config)
            return self.last
        base = _search.cheapest(tables)
        config = base
        if not self.target.needs_metric:
            config = _search.trim(tables, badness, _search.upgrade(tables, badness, config, self.enough),
                                  self.enough)
        for used in range(max_trials):
            requested = config
            trial = self.measure(config)
            config = self.last  # as made legal
            self._withdraw_overridden(base, requested, config)
            base = config
            if trial.met:
                return config
            if self._latency_only(trial):
                # Accuracy and size hold: upgrading further only slows it down.
                self.say("the latency budget is missed by the cheapest configuration found that keeps "
                         "the accuracy; trying its groups in float")
                return self._faster(config, trial, max_trials - used - 1)
            if self.target.needs_metric and self.target.min_sqnr_db is None and self.target.min_cosine is None:
                goal = badness[config, np.arange(tables.groups)].sum() / 2
                step = _search.upgrade(tables, badness, config,
                                       lambda c: badness[c, np.arange(tables.groups)].sum() <= goal)
            else:
                # The prediction was optimistic by its slack minus the measured
                # one (-shortfall): the next configuration must clear that.
                # (Making a configuration legal can add slack the search
                # did not ask for, so the shortfall alone is not enough.)
                optimism = self.slack_db(config) + self._shortfall_db(config, trial)
                self.margin_db = max(self.margin_db + _MIN_STEP_DB, optimism + _MIN_STEP_DB)
                step = _search.upgrade(tables, badness, config, self.enough)
            if np.array_equal(step, config):
                self.say("no upgrade left to try")
                return config
            config = step
        return self.last

    def _latency_only(self, trial: Trial) -> bool:
        return bool(trial.misses) and len(trial.misses) == len(trial.measured.latency_misses(self.target))

    def _faster(self, config, trial: Trial, trials_left: int) -> np.ndarray:
        """After a miss of the latency budget alone: a quantized op is not
        always faster than its float twin on the host (the digits CNN's first
        convolution, over one input channel, runs 3x slower in int8 on one
        Xeon and faster on an EPYC), and keeping a group in float only adds
        accuracy. So each quantized group is tried alone in float, in graph
        order, where the size budget allows it and as many as the trials
        left allow; the fastest is kept while it runs faster than the
        configuration it came from (by the ratio to float timed in the same
        rounds). Returns the first configuration that meets the target, else
        the fastest measured that holds the accuracy and size."""
        tuned, legal = self.tuned, self.tables.legal
        floats = [c for c, candidate in enumerate(tuned.candidates) if candidate.is_float]
        best, best_ratio = config, trial.measured.latency_ratio
        while trials_left > 0 and best_ratio is not None:
            steps = []
            for g in range(self.tables.groups):
                float_c = next((c for c in floats if legal[c, g]), None)
                if tuned.candidates[best[g]].is_float or float_c is None:
                    continue
                step = best.copy()
                step[g] = float_c
                if not self.target.has_size or self.fits(step):
                    steps.append((g, step))
            if not steps:
                self.say("no quantized group is left to try in float")
                return best
            tried = []
            for g, step in steps[:trials_left]:
                trials_left -= 1
                result = self.measure(step)
                if result.met:
                    self.say(f"{tuned.groups[g]} in float meets the target")
                    return self.last
                if self._latency_only(result):
                    tried.append((result.measured.latency_ratio, g, self.last))
            ratio, g, fastest = min(tried, key=lambda t: t[0], default=(None, None, None))
            if ratio is None or ratio >= best_ratio:
                self.say("no group tried in float made it faster")
                return best
            self.say(f"{tuned.groups[g]} in float: {ratio:.2f}x float (was {best_ratio:.2f}x)")
            best, best_ratio = fastest, ratio
        return best

    def _shortfall_db(self, config, trial: Trial) -> float:
        """How much the prediction was optimistic, in dB of noise."""
        t, m = self.target, trial.measured
        gaps = [0.0]
        if t.min_sqnr_db is not None:
            gaps.append(t.min_sqnr_db - m.sqnr_db)
        if t.min_cosine is not None:
            gaps.append(10 * np.log10(max(1 - m.cosine, 1e-12) / max(1 - t.min_cosine, 1e-12)))
        return float(max(gaps))

    def measure(self, config) -> Trial:
        tuned = self.tuned
        config, plan = self.legalize(config)
        if tuned.backend != "xla":
            config, plan = self.convertible(config, plan)
            if self.timer is not None:
                config, plan = self.delegated(config, plan)
        scales = tuned.scales(plan)
        simulator = tuned.simulator(plan, scales)
        errors, cosines = [], []
        for batch, ref in zip(tuned.eval_batches, tuned.reference):
            outputs = [np.asarray(o) for o in _leaves(simulator(*batch))]
            errors.append(output_errors(outputs, ref))
            cosines.append(_cosines(outputs, ref))
        errors = np.concatenate(errors, axis=1)
        sqnr, _ = accuracy_of(errors, self.tables.signal)
        metric = float(self.eval_fn(simulator)) if self.eval_fn is not None else None
        size, bits = tuned.size(plan)
        ms, float_ms = self.timer(config) if self.timer is not None else (None, None)
        measured = Measured(sqnr_db=sqnr, cosine=float(np.mean(np.concatenate(cosines))), metric=metric,
                            bytes=size, bits_per_weight=bits, latency_ms=ms, float_latency_ms=float_ms)
        predicted = self.tables.predicted(config)
        counts = Counter(tuned.candidates[c].name for c in config)
        trial = Trial(counts=dict(counts), predicted_sqnr_db=predicted[0], predicted_cosine=predicted[1],
                      measured=measured, misses=tuple(measured.misses(self.target, self.float_metric)))
        self.trials.append(trial)
        self.configs.append(config.copy())
        self.last = config
        self.say(f"trial {len(self.trials)}: {dict(counts)}: SQNR {sqnr:.2f} dB, cosine {measured.cosine:.5f}"
                 + (f", metric {metric:.4g}" if metric is not None else "")
                 + f", {bits:.2f} bits/weight"
                 + (f", {ms:.3f} ms ({ms / float_ms:.2f}x float)" if ms is not None else "")
                 + (" (met)" if trial.met else ""))
        return trial

    def index_of(self, config) -> int:
        return next(i for i, c in enumerate(self.configs) if np.array_equal(c, config))

    def best(self, last) -> np.ndarray:
        """The cheapest measured configuration that met the target, else the last one."""
        met = [i for i, t in enumerate(self.trials) if t.met]
        if not met:
            return last
        return min((self.configs[i] for i in met), key=self.tables.total_cost)


def _cosines(outputs, reference) -> np.ndarray:
    n = np.shape(reference[0])[0]
    a = np.concatenate([np.reshape(np.asarray(o, np.float64), (n, -1)) for o in outputs], axis=1)
    b = np.concatenate([np.reshape(np.asarray(r, np.float64), (n, -1)) for r in reference], axis=1)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.where(norms > 0, np.sum(a * b, axis=1) / np.maximum(norms, 1e-300), 1.0)


def _leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)
