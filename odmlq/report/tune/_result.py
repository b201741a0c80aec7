"""What autotune returns: the rules, every configuration it measured, and the checks (internal)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import yaml

from odmlq.files import atomic_output
from odmlq.rules import Rule, rules_to_dicts
from odmlq.report.tune._target import Measured, TuneTarget

__all__ = ["Trial", "TuneResult"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trial:
    """One configuration autotune measured: how many groups took each
    candidate, what it predicted and what it measured."""

    counts: dict[str, int]
    predicted_sqnr_db: float
    predicted_cosine: float
    measured: Measured
    misses: tuple[str, ...]

    @property
    def met(self) -> bool:
        return not self.misses


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuneResult:
    """The rules autotune chose, and the evidence.

    Attributes:
      rules: ordinary rules (one per group that differs from the last,
        catch-all rule); pass them to `odmlq.export_tflite` or `odmlq.ptq`.
      choices: module path -> the candidate its ops take.
      trials: every configuration measured, in order (the trade-off table).
      measured: the chosen configuration's accuracy and size.
      met: whether it meets the target; `misses` says what it does not.
      float_metric: `eval_fn` on the float model (None without one).
      sensitivity: module path -> candidate -> predicted output SQNR (dB) with
        only that group quantized so.
      checks: backend name -> what the backend's own run of the rules gave
        (LiteRT: exported, verified op by op, output SQNR; XLA: output SQNR).
      notes: candidates not offered and why, and other remarks.
    """

    rules: list[Rule]
    choices: dict[str, str]
    trials: list[Trial]
    measured: Measured
    met: bool
    misses: tuple[str, ...]
    target: TuneTarget
    float_metric: float | None
    sensitivity: dict[str, dict[str, float]]
    checks: dict[str, Any]
    notes: list[str]
    seconds: float

    def save_rules(self, path: str | os.PathLike) -> str:
        """Writes the rules as YAML (atomically), readable by `odmlq.load_rules`."""
        text = yaml.safe_dump({"rules": rules_to_dicts(self.rules)}, sort_keys=False)
        with atomic_output(path) as temporary:
            with open(temporary, "w", encoding="utf-8") as f:
                f.write(text)
        return os.fspath(path)

    def rules_yaml(self) -> str:
        return yaml.safe_dump({"rules": rules_to_dicts(self.rules)}, sort_keys=False)

    def __str__(self) -> str:
        lines = [f"autotune: {'met' if self.met else 'NOT met'}: {self.target.describe()} "
                 f"({self.seconds:.1f} s)"]
        if self.misses:
            lines.append("  misses: " + "; ".join(self.misses))
        if self.float_metric is not None:
            lines.append(f"  float model's metric: {self.float_metric:.4g}")
        lines.append("")
        timed = any(t.measured.latency_ms is not None for t in self.trials)
        lines.append("trial  choices                                  predicted     measured SQNR  cosine    "
                     "metric    bits/w   bytes" + ("      ms  vs float" if timed else ""))
        for i, t in enumerate(self.trials):
            counts = ", ".join(f"{n} {k}" for k, n in sorted(t.counts.items(), key=lambda kv: -kv[1]))
            m = t.measured
            metric = "-" if m.metric is None else f"{m.metric:.4g}"
            latency = ""
            if timed:
                latency = "        -        -" if m.latency_ms is None else \
                    f"  {m.latency_ms:7.3f}  {m.latency_ratio:6.2f}x"
            lines.append(f"{i:>5}  {counts[:40]:<40} {t.predicted_sqnr_db:7.2f} dB  {m.sqnr_db:8.2f} dB  "
                         f"{m.cosine:.5f}  {metric:>8}  {m.bits_per_weight:6.2f}  {m.bytes:>7}" + latency
                         + ("  met" if t.met else ""))
        for name, check in self.checks.items():
            lines.append(f"{name}: {check}")
        lines += [f"note: {n}" for n in self.notes]
        lines += ["", self.rules_yaml().rstrip()]
        return "\n".join(lines)
