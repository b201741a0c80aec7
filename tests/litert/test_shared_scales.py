"""A CONCATENATION reads every input at its output's scale. litert-converter
0.5.0 carries that scale back through ops that only move integers (TRANSPOSE,
REVERSE_V2, GATHER, RESHAPE) to the op that computes them, which then
requantizes straight to it. The plan does the same (`scales._edges._free_chain`):
before, a flipped or transposed input of a concatenation came out of the
converter at another scale than the plan's, and verification refused the file.

Where that op's output is read elsewhere too, the chain keeps its own scale,
and the LiteRT lowering writes the requantization out after a same-scale
MAXIMUM (`litert.spec.read_at_shared_scale`). Left to the converter, it was
folded into the REVERSE_V2, RESHAPE or RELU before the concatenation, which
wrote its input's codes under the new scale (Flax's nn.Bidirectional RNN:
26 LSB off)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import odmlq

INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
_ORDER = np.array([4, 2, 0, 1, 3])

MOVES = {
    "flip": lambda a: jnp.flip(a, 1),
    "transpose": lambda a: jnp.swapaxes(jnp.swapaxes(a, 1, 2), 1, 2),
    "gather": lambda a: jnp.take(a, _ORDER, axis=1),
    "flip_of_transpose": lambda a: jnp.flip(jnp.transpose(jnp.transpose(a, (0, 2, 1)), (0, 2, 1)), 1),
}


class _IntoConcatenation(nn.Module):
    move: str
    pinned: bool = False  # the moved Dense output is read elsewhere too (PINNED below)
    features: int = 4

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(self.features, name="a")(x)
        b = nn.Dense(self.features, name="b")(x) * 3.0  # a wider range: the concatenation's scale is b's
        joined = jnp.concatenate([(PINNED if self.pinned else MOVES)[self.move](h), b], -1)
        if not self.pinned:
            return joined
        # h is read here too, so its Dense keeps its own scale.
        return nn.Dense(4, name="c")(joined) + nn.Dense(4, name="d")(h).mean(1, keepdims=True)


def _exported_full_integer(model, shape, n):
    rng = np.random.default_rng(0)
    batches = [rng.normal(size=shape).astype(np.float32) for _ in range(n)]
    variables = model.init(jax.random.key(0), batches[0][:1])
    result = odmlq.export_tflite(model, INT8, batches, variables=variables, benchmark=False)
    report = result.verification
    assert report.passed, str(report)
    # 1 LSB per op: an integer kernel may round a half step the other way.
    assert all(check.max_lsb <= 1.0 + 1e-3 for check in report.checks), str(report)
    assert result.summary.float_islands == ()
    return result


@pytest.mark.parametrize("move", sorted(MOVES))
def test_a_moved_input_of_a_concatenation_takes_its_scale_back_to_the_op_computing_it(move):
    result = _exported_full_integer(_IntoConcatenation(move), (8, 5, 6), 3)
    concatenation = next(op for op in result.plan.graph.ops if op.kind == "concatenate")
    shared = result.scales.edges[concatenation.outputs[0]]
    # The Dense computing `a` writes at the concatenation's scale, and so does every move after it.
    for edge in ("a/dot_general", *concatenation.inputs):
        np.testing.assert_array_equal(np.ravel(result.scales.edges[edge].scale), np.ravel(shared.scale), edge)


PINNED = {
    "flip": lambda h: jnp.flip(h, 1),
    "relu": nn.relu,
    "relu6": nn.relu6,
    "reshape": lambda h: h.reshape(h.shape[0], h.shape[1], 2, -1).reshape(h.shape),
    "stack": lambda h: jnp.stack([h[:, i] for i in range(h.shape[1])], 1),
}



@pytest.mark.parametrize("move", sorted(PINNED))
def test_an_input_of_a_concatenation_on_another_grid_is_requantized_after_a_separator(move):
    """Before: verification refused every case ('scale/zero point ... not the
    plan's'; the flip was 135 LSB off)."""
    result = _exported_full_integer(_IntoConcatenation(move, pinned=True, features=16), (8, 6, 8), 4)
    # The Dense keeps its own scale; the concatenation reads its moved output at b's.
    assert not np.allclose(result.scales.edges["a/dot_general"].scale,
                           result.scales.edges["b/mul"].scale)


@pytest.mark.parametrize("act_qtype", ["int8", "int16"])
def test_a_bidirectional_rnn_exports_full_integer(act_qtype):
    """Flax's nn.Bidirectional: the backward RNN flips its input and its output,
    and the two directions are concatenated."""

    class Tagger(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Bidirectional(nn.RNN(nn.GRUCell(8)), nn.RNN(nn.GRUCell(8)))(x)
            return nn.Dense(5)(y)

    model = Tagger()
    rng = np.random.default_rng(1)
    batches = [rng.normal(size=(8, 6, 8)).astype(np.float32) for _ in range(4)]
    variables = model.init(jax.random.key(0), batches[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype=act_qtype)]
    result = odmlq.export_tflite(model, rules, batches, variables=variables, benchmark=False)
    assert result.verification.passed, str(result.verification)
    assert result.summary.float_islands == ()


class _ReadByConcatenations(nn.Module):
    """One Dense output read by `readers` concatenations, each beside a Dense of
    another range (so each reads it at a scale of its own); ``sliced``: each
    reads the same slice of it, written out again (as BigBird's block-sparse
    attention reads its first key block in two concatenations)."""

    readers: int
    sliced: bool = False

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(16, name="y")(x).reshape(x.shape[0], 4, 4)
        out = 0.0
        for i in range(self.readers):
            read = y[:, 0] if self.sliced else y.reshape(x.shape[0], 16)
            other = nn.Dense(4, name=f"other_{i}")(x) * (3.0 + i)  # wider than y: the scale is its
            out = out + nn.Dense(4, name=f"out_{i}")(jnp.concatenate([read, other], axis=-1))
        return out


@pytest.mark.parametrize("readers,sliced", [(2, False), (2, True), (3, True), (12, False)])
def test_an_edge_read_by_several_concatenations_at_their_own_scales_exports_full_integer(readers, sliced):
    """Before: the second reader's requantization was a float DEQUANTIZE and
    QUANTIZE, and the export refused itself (float islands). litert-converter
    merged the two equal separators on one tensor (for the same slice, the
    slices first), and one MAXIMUM read by two QUANTIZEs of other scales keeps
    only the first in integers. Twelve readers of a rank-2 tensor use more
    separator forms than there are (six), so chains of them too."""
    result = _exported_full_integer(_ReadByConcatenations(readers, sliced), (8, 8), 4)
    concatenations = [op for op in result.plan.graph.ops if op.kind == "concatenate"]
    grids = {float(np.ravel(result.scales.edges[op.outputs[0]].scale)[0]) for op in concatenations}
    assert len(grids) == readers  # each reads at its own scale: a requantization each
