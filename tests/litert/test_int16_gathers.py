"""An int16 gather of an activation's whole rows is a one-hot int16 matmul
(`odmlq.litert._forms.gathered_as_one_hot`): litert-converter 0.5.0 makes no
int16 GATHER_ND, so CLIP's pooled text output, a graph network's
``nodes[senders]``, BigBird's blocks and a nearest resize by 3/2 were refused
in int16x8. The one-hot matrix holds 1 as code 2^14, so each picked value is
its row's code times 1, rescaled by 2^-14: 0 LSB from simulate, asserted."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq

INT16 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int16")]


class _Pooled(nn.Module):
    """CLIP's text pooling: each row's hidden state at the position of its largest id."""

    @nn.compact
    def __call__(self, x, ids):
        h = nn.Dense(16, name="fc")(x)
        return nn.Dense(4, name="out")(h[jnp.arange(h.shape[0]), ids.argmax(-1)])


class _Messages(nn.Module):
    """A graph network's messages: node states read per edge, out-of-range senders
    in mode 'fill' (zeros) and 'clip' (the last node)."""

    @nn.compact
    def __call__(self, nodes, senders):
        h = nn.Dense(16, name="fc")(nodes)
        filled = jnp.take(h, senders, axis=0, mode="fill", fill_value=0.0)
        clipped = jnp.take(h, senders, axis=0, mode="clip")
        return nn.Dense(4, name="out")(filled + clipped)


_BLOCKS = np.array([[[2], [0]], [[1], [3]], [[0], [2]]], np.int32)  # (3 picks, 2, 1) per head


class _Blocks(nn.Module):
    """BigBird's random blocks: per head (a vmapped gather, batching axes), constant block ids."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, name="fc")(x).reshape(x.shape[0], 2, 4, 3, 4)  # (b, heads, blocks, len, d)
        picked = jax.vmap(jax.vmap(lambda blocks, ids: blocks[ids[..., 0]], in_axes=(0, None)),
                          in_axes=(0, None))(h, jnp.asarray(_BLOCKS))
        return nn.Dense(4, name="out")(picked.reshape(x.shape[0], -1))


def _cases():
    rng = np.random.default_rng(0)
    pooled = [(rng.normal(size=(4, 6, 8)).astype(np.float32), rng.integers(0, 50, size=(4, 6)).astype(np.int32))
              for _ in range(6)]
    messages = [(rng.normal(size=(10, 8)).astype(np.float32), rng.integers(-2, 13, size=(24,)).astype(np.int32))
                for _ in range(4)]
    blocks = [rng.normal(size=(4, 12, 8)).astype(np.float32) for _ in range(6)]
    return {"pooled": (_Pooled(), pooled), "messages": (_Messages(), messages), "blocks": (_Blocks(), blocks)}


@pytest.mark.parametrize("name", ["pooled", "messages", "blocks"])
def test_an_int16_gather_of_whole_rows_is_a_one_hot_matmul_exact_to_simulate(name):
    model, batches = _cases()[name]
    first = batches[0] if isinstance(batches[0], tuple) else (batches[0],)
    variables = model.init(jax.random.key(0), *first)
    # A graph's batch is one example (its arrays share no leading size).
    example = {"example_inputs": first} if name == "messages" else {}
    result = odmlq.export_tflite(model, INT16, batches, variables=variables, benchmark=False, **example)
    report = result.verification
    assert report.passed, str(report)
    assert result.summary.float_islands == ()
    assert "GATHER_ND" not in result.summary.op_histogram, result.summary.op_histogram
    gathers = [c for c in report.checks if "gather" in c.edge or "take" in c.edge]
    assert gathers and all(c.max_lsb == 0.0 for c in gathers), [(c.edge, c.max_lsb) for c in gathers]
    assert abs(report.litert_float_sqnr_db - report.simulate_float_sqnr_db) < 0.1


def test_a_nearest_resize_by_three_halves_is_a_one_hot_matmul_in_int16():
    model = nn.Sequential([nn.Dense(4), lambda x: jax.image.resize(x, (x.shape[0], 9, 5, 4), "nearest")])
    rng = np.random.default_rng(1)
    batches = [rng.normal(size=(8, 6, 5, 3)).astype(np.float32) for _ in range(3)]
    variables = model.init(jax.random.key(0), batches[0][:1])
    result = odmlq.export_tflite(model, INT16, batches, variables=variables, benchmark=False)
    assert result.verification.passed and result.summary.float_islands == (), str(result.verification)
    assert "BATCH_MATMUL" in result.summary.op_histogram and "GATHER_ND" not in result.summary.op_histogram


def test_a_one_hot_of_over_four_million_entries_is_refused_by_name_before_work():
    """2,048 picks of 4,096 positions: 8.4 M entries, computed and multiplied at
    every invocation (`spec.MAX_ONE_HOT_ENTRIES`)."""
    picks = np.random.default_rng(5).permutation(4096)[:2048]

    class Picks(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="fc")(x)[:, picks]

    x = np.random.default_rng(0).normal(size=(2, 4096, 3)).astype(np.float32)
    model = Picks()
    plan = odmlq.plan(model, INT16, x, variables=model.init(jax.random.key(0), x[:1]))
    with pytest.raises(odmlq.litert.FloatOpsError, match=r"op 'fc/gather' .* no int16 GATHER_ND of an activation as "
                                                         r"a one-hot int16 matmul of 8,388,608 entries .*skip=True"):
        odmlq.litert.check_plan(plan)
