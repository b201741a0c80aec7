"""What autotune must reach: an accuracy floor, a size or latency budget (internal)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from odmlq.errors import RuleError

__all__ = ["TuneTarget", "Measured"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuneTarget:
    """The floor and budgets a tuned model must meet; unset fields are not checked.

    Accuracy is measured against the float model on the data autotune is
    given (`eval_inputs`, or the representative batches):

    Args:
      min_sqnr_db: every output's SQNR (dB) at least this.
      min_cosine: the mean over samples of the cosine similarity between each
        sample's outputs and float's, at least this.
      min_metric: `eval_fn`'s value at least this (higher is better).
      max_metric_drop: `eval_fn`'s value at most this far under float's.
      max_bits_per_weight: the weights' average storage bits (values and
        scales, over every weight the model's matmuls, convolutions and other
        ops read) at most this.
      max_bytes: every parameter's storage (weights, scales, biases) at most
        this many bytes.
      max_latency_ratio: the tuned model's latency at most this many times
        the float model's, both timed on the backend in the same interleaved
        rounds (LiteRT: the exported .tflite at batch 1, one thread, XNNPACK;
        XLA: the jitted quantized model on the first evaluation batch). On
        LiteRT a latency budget also gates placement: a group stays
        quantized only where XNNPACK runs every one of its ops. When the
        latency alone misses, quantized groups are tried in float, one at
        a time (an int8 kernel can lose to its float twin on the host).
      max_latency_ms: the tuned model's latency (as above) at most this many
        milliseconds on this machine.

    Example:
      >>> odmlq.TuneTarget(min_cosine=0.995)
      >>> odmlq.TuneTarget(max_bits_per_weight=3, max_metric_drop=0.01)
      >>> odmlq.TuneTarget(min_cosine=0.99, max_latency_ratio=0.8)
    """

    min_sqnr_db: float | None = None
    min_cosine: float | None = None
    min_metric: float | None = None
    max_metric_drop: float | None = None
    max_bits_per_weight: float | None = None
    max_bytes: int | None = None
    max_latency_ratio: float | None = None
    max_latency_ms: float | None = None

    def __post_init__(self):
        values = dataclasses.asdict(self)
        if all(v is None for v in values.values()):
            raise RuleError("TuneTarget needs a floor or a budget: min_sqnr_db, min_cosine, min_metric, "
                            "max_metric_drop, max_bits_per_weight, max_bytes, max_latency_ratio or "
                            "max_latency_ms.")
        for name, value in values.items():
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise RuleError(f"TuneTarget {name}={value!r} must be a finite number.")
        if self.min_cosine is not None and not -1 <= self.min_cosine <= 1:
            raise RuleError(f"TuneTarget min_cosine={self.min_cosine} must lie in [-1, 1].")
        for name in ("max_bits_per_weight", "max_bytes", "max_metric_drop"):
            if values[name] is not None and values[name] < 0:
                raise RuleError(f"TuneTarget {name}={values[name]} must not be negative.")
        for name in ("max_latency_ratio", "max_latency_ms"):
            if values[name] is not None and values[name] <= 0:
                raise RuleError(f"TuneTarget {name}={values[name]} must be positive.")

    @property
    def needs_metric(self) -> bool:
        return self.min_metric is not None or self.max_metric_drop is not None

    @property
    def has_accuracy(self) -> bool:
        return self.needs_metric or self.min_sqnr_db is not None or self.min_cosine is not None

    @property
    def has_size(self) -> bool:
        return self.max_bits_per_weight is not None or self.max_bytes is not None

    @property
    def has_latency(self) -> bool:
        return self.max_latency_ratio is not None or self.max_latency_ms is not None

    def describe(self) -> str:
        parts = []
        for name, text in (("min_sqnr_db", "SQNR >= {} dB"), ("min_cosine", "mean cosine >= {}"),
                           ("min_metric", "metric >= {}"), ("max_metric_drop", "metric drop <= {}"),
                           ("max_bits_per_weight", "<= {} bits per weight"), ("max_bytes", "<= {} bytes"),
                           ("max_latency_ratio", "latency <= {}x float"), ("max_latency_ms", "latency <= {} ms")):
            value = getattr(self, name)
            if value is not None:
                parts.append(text.format(f"{value:g}"))
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measured:
    """One configuration's accuracy and size (and latency, when the target
    has a latency budget), measured (not predicted)."""

    sqnr_db: float
    cosine: float
    metric: float | None
    bytes: int
    bits_per_weight: float
    latency_ms: float | None = None
    float_latency_ms: float | None = None

    @property
    def latency_ratio(self) -> float | None:
        if self.latency_ms is None or not self.float_latency_ms:
            return None
        return self.latency_ms / self.float_latency_ms

    def misses(self, target: TuneTarget, float_metric: float | None) -> list[str]:
        """What `target` asks that this does not reach (empty: met)."""
        out = []
        if target.min_sqnr_db is not None and not self.sqnr_db >= target.min_sqnr_db:
            out.append(f"SQNR {self.sqnr_db:.2f} dB < {target.min_sqnr_db:g}")
        if target.min_cosine is not None and not self.cosine >= target.min_cosine:
            out.append(f"mean cosine {self.cosine:.5f} < {target.min_cosine:g}")
        if target.min_metric is not None and not (self.metric is not None and self.metric >= target.min_metric):
            out.append(f"metric {self.metric} < {target.min_metric:g}")
        if target.max_metric_drop is not None and not (
                self.metric is not None and float_metric - self.metric <= target.max_metric_drop):
            out.append(f"metric drop {float_metric - self.metric:.4g} > {target.max_metric_drop:g}")
        if target.max_bits_per_weight is not None and self.bits_per_weight > target.max_bits_per_weight:
            out.append(f"{self.bits_per_weight:.2f} bits per weight > {target.max_bits_per_weight:g}")
        if target.max_bytes is not None and self.bytes > target.max_bytes:
            out.append(f"{self.bytes} bytes > {target.max_bytes}")
        return out + self.latency_misses(target)

    def latency_misses(self, target: TuneTarget) -> list[str]:
        """The latency budgets of `target` this does not meet."""
        out = []
        ratio, ms = self.latency_ratio, self.latency_ms
        if target.max_latency_ratio is not None and not (ratio is not None and ratio <= target.max_latency_ratio):
            out.append(f"latency {'unmeasured' if ratio is None else f'{ratio:.2f}x'} float "
                       f"> {target.max_latency_ratio:g}x")
        if target.max_latency_ms is not None and not (ms is not None and ms <= target.max_latency_ms):
            out.append(f"latency {'unmeasured' if ms is None else f'{ms:.3f}'} ms > {target.max_latency_ms:g} ms")
        return out


def accuracy_of(errors: np.ndarray, signal: np.ndarray) -> tuple[float, float]:
    """(lowest output SQNR in dB, mean per-sample cosine estimate) from error
    and signal energies of shape (outputs, samples)."""
    noise = errors.sum(axis=1)
    power = signal.sum(axis=1)
    with np.errstate(divide="ignore"):
        sqnr = np.where(noise > 0, 10 * np.log10(np.maximum(power, 1e-300) / np.maximum(noise, 1e-300)), np.inf)
    return float(sqnr.min()), float(np.mean(1 - errors.sum(axis=0) / (2 * np.maximum(signal.sum(axis=0), 1e-300))))
