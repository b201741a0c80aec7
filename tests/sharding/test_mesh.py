"""Sharded quantization on a simulated mesh of 8 CPU devices.

JAX fixes its device count when it starts, so the checks run in a fresh
process (`_mesh_checks.py`); each asserts there and this test fails with its
output.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mesh_run():
    def run(*checks: str) -> str:
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
        done = subprocess.run([sys.executable, "-m", "tests.sharding._mesh_checks", *checks], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr[-4000:]
        return done.stdout
    return run


def test_sharded_params_quantize_bit_for_bit_and_keep_their_mesh_axes(mesh_run):
    out = mesh_run("quantize_params", "ptq", "saved", "refusals")
    assert "bit for bit" in out and "params stay sharded" in out and "loaded back onto the mesh" in out
    assert "refusals" in out


def test_data_parallel_calibration_gives_single_device_statistics(mesh_run):
    assert "statistics as on one device" in mesh_run("calibrate")


def test_decoder_streams_from_a_sharded_checkpoint_onto_the_mesh(mesh_run):
    assert "decode step sharded" in mesh_run("checkpoint")
