"""The Calibration mapping: merges, files (atomic, no pickle), JSON."""

import json
import os
import re

import numpy as np
import pytest

from odmlq.calibration import (
    AbsMax, Calibration, MinMax, MovingAverageMinMax,
    Percentile, compute_range,
)
from odmlq.errors import CalibrationError
from tests.calibration._common import (
    assert_statistics_equal,
)


# --------------------------------------------------------------- Calibration


def small_calibration(rng) -> Calibration:
    calibration = Calibration()
    for i in range(3):
        calibration.observe("encoder/dense/out", MinMax(), rng.normal(size=(8, 4)), batch_index=i)
        calibration.observe("encoder/conv/out", Percentile(99.9), rng.normal(size=(8, 4)))
        calibration.observe("head/kernel", AbsMax(0.9), rng.normal(size=(8, 4)), keep_axes=(-1,))
        calibration.observe("head/out", MovingAverageMinMax(), rng.normal(size=(8, 4)))
    return calibration


def assert_calibrations_equal(a: Calibration, b: Calibration) -> None:
    assert a.edges == b.edges
    for edge in a:
        assert a[edge][0] == b[edge][0]
        assert_statistics_equal(a[edge][1], b[edge][1])


def test_calibration_mapping(rng):
    calibration = small_calibration(rng)
    assert len(calibration) == 4 and "head/out" in calibration and "nope" not in calibration
    assert calibration.edges == ("encoder/dense/out", "encoder/conv/out", "head/kernel", "head/out")
    method, stats = calibration["head/kernel"]
    assert method == AbsMax(0.9) and stats.keep_axes == (-1,)
    lo, hi = calibration.range("head/kernel", "int8", symmetric=True)
    assert lo.shape == (4,)
    np.testing.assert_array_equal(hi, compute_range(method, stats, "int8", symmetric=True)[1])
    assert "Calibration(4 edges" in repr(calibration)


def test_calibration_errors(rng):
    calibration = small_calibration(rng)
    with pytest.raises(CalibrationError, match=r"edge 'encoder/dense/out', batch 7: The batch has 1 non-finite"):
        calibration.observe("encoder/dense/out", MinMax(), np.array([np.nan, 1.0]), batch_index=7)
    with pytest.raises(CalibrationError, match=r"edge 'head/out': observed with MovingAverageMinMax.* before, now MinMax"):
        calibration.observe("head/out", MinMax(), np.ones(3))
    with pytest.raises(CalibrationError, match=r"No calibration for edge 'missing'"):
        calibration.range("missing", "int8", symmetric=True)
    with pytest.raises(KeyError, match=r"No calibration for edge 'missing'"):
        calibration["missing"]
    other = Calibration()
    other.observe("encoder/dense/out", MinMax(), np.ones(3))
    with pytest.raises(CalibrationError, match=r"different edges: edge 'encoder/conv/out' is in only one"):
        calibration.merge(other)
    changed = Calibration({e: (m, s) for e, (m, s) in calibration.items()})
    changed._entries["head/out"] = (MinMax(), changed["head/out"][1])
    with pytest.raises(CalibrationError, match=r"Cannot merge edge 'head/out': calibrated with MovingAverageMinMax"):
        calibration.merge(changed)


def test_calibration_merge_equals_one_stream(rng):
    batches = [rng.normal(scale=s, size=(8, 4)) for s in (1.0, 10.0, 0.1, 3.0)]
    whole, first, second = Calibration(), Calibration(), Calibration()
    for i, batch in enumerate(batches):
        whole.observe("x", Percentile(), batch)
        (first if i < 2 else second).observe("x", Percentile(), batch)
    merged = first.merge(second)
    np.testing.assert_array_equal(merged["x"][1].histogram, whole["x"][1].histogram)
    np.testing.assert_array_equal(merged.range("x", "int8", symmetric=True), whole.range("x", "int8", symmetric=True))


def test_save_load_round_trip_then_merge(rng, tmp_path):
    calibration = small_calibration(rng)
    path = tmp_path / "calibration.npz"
    calibration.save(path)
    loaded = Calibration.load(path)
    assert_calibrations_equal(loaded, calibration)
    assert sorted(os.listdir(tmp_path)) == ["calibration.npz"]  # no temp file left
    merged = loaded.merge(small_calibration(rng))
    assert int(merged["encoder/dense/out"][1].count) == 2 * int(calibration["encoder/dense/out"][1].count)
    with np.load(path, allow_pickle=False) as data:  # readable without pickle
        assert "metadata" in data.files


def test_json_round_trip(rng):
    calibration = small_calibration(rng)
    text = calibration.to_json()
    assert json.loads(text)["format"] == "odmlq.calibration"
    assert_calibrations_equal(Calibration.from_json(text), calibration)


def test_save_is_atomic(rng, tmp_path, monkeypatch):
    path = tmp_path / "calibration.npz"
    small_calibration(rng).save(path)
    before = path.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", fail)
    monkeypatch.setattr(np, "savez_compressed", fail)
    with pytest.raises(OSError, match="disk full"):
        small_calibration(np.random.default_rng(1)).save(path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["calibration.npz"]


def test_load_rejects_foreign_and_corrupt_files(rng, tmp_path):
    text = tmp_path / "notes.npz"
    text.write_text("not a zip")
    with pytest.raises(CalibrationError, match=re.escape(repr(str(text)))):
        Calibration.load(text)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, weights=np.ones(3))
    with pytest.raises(CalibrationError, match=r"foreign.npz.* has no calibration metadata"):
        Calibration.load(foreign)
    single = tmp_path / "single.npy"
    np.save(single, np.ones(3))
    with pytest.raises(CalibrationError, match=r"single.npy.* is a single .npy array"):
        Calibration.load(single)
    newer = tmp_path / "newer.npz"
    metadata = json.dumps({"format": "odmlq.calibration", "version": 99, "edges": []}).encode()
    np.savez(newer, metadata=np.frombuffer(metadata, np.uint8))
    with pytest.raises(CalibrationError, match=r"newer.npz.* version 99; this odmlq reads version 1"):
        Calibration.load(newer)
    truncated = tmp_path / "truncated.npz"
    small_calibration(rng).save(truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    with pytest.raises(CalibrationError, match=r"truncated.npz.* is not a readable odmlq calibration file"):
        Calibration.load(truncated)
    with pytest.raises(FileNotFoundError):
        Calibration.load(tmp_path / "missing.npz")


def test_from_json_rejects_bad_statistics(rng):
    data = json.loads(small_calibration(rng).to_json())
    data["edges"][0]["statistics"]["min"] = [1.0, 2.0]
    with pytest.raises(CalibrationError, match=r"edge 'encoder/dense/out': statistics arrays have inconsistent shapes"):
        Calibration.from_json(json.dumps(data))
    del data["edges"][1]["statistics"]["count"]
    data["edges"][0]["statistics"]["min"] = 1.0
    with pytest.raises(CalibrationError, match=r"edge 'encoder/conv/out': statistics field 'count' is missing"):
        Calibration.from_json(json.dumps(data))
    with pytest.raises(CalibrationError, match=r"does not parse"):
        Calibration.from_json("{")
    data = json.loads(small_calibration(rng).to_json())
    data["edges"][1]["statistics"]["histogram_limit"] = 3.0
    with pytest.raises(CalibrationError, match=r"edge 'encoder/conv/out': the histogram is inconsistent"):
        Calibration.from_json(json.dumps(data))
