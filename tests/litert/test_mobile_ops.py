"""Mobile CNN activations in integers on XNNPACK: hard-swish as its ADD, MUL by 1/6 and MUL
(`odmlq/graph/_walk.py`), where LiteRT's int8 HARD_SWISH runs outside the delegate."""

import flax.linen as nn
import jax
import pytest

import odmlq
from tests.litert.test_ops import _batches


class _HardSwishCNN(nn.Module):
    """Conv, hard-swish, depthwise Conv, hard-swish, Conv: MobileNetV3's activation."""

    @nn.compact
    def __call__(self, x):
        x = nn.hard_swish(nn.Conv(16, (3, 3), name="conv0")(x))
        x = nn.hard_swish(nn.Conv(16, (3, 3), feature_group_count=16, name="dw")(x))
        return nn.Conv(8, (1, 1), name="conv1")(x)


@pytest.mark.parametrize("act_qtype", ["int8", "int16"])
def test_a_hard_swish_cnn_runs_whole_on_xnnpack_in_int8_and_exports_int16x8(act_qtype):
    """hard_swish as its ADD, MUL by 1/6 and MUL: int8 in one XNNPACK partition with
    no op outside it (LiteRT's int8 HARD_SWISH ran on the reference kernels, a
    partition split at each), and int16x8 full integer (HARD_SWISH has no int16
    kernel); both verified op by op."""
    model = _HardSwishCNN()
    batches = _batches((8, 8, 3))
    variables = model.init(jax.random.key(0), batches[0][:1])
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype=act_qtype)]
    result = odmlq.export_tflite(model, rules, batches, variables=variables, benchmark=False)
    assert result.verification.passed, str(result.verification)
    assert result.summary.float_islands == (), [o.name for o in result.summary.float_islands]
    assert "HARD_SWISH" not in dict(result.summary.op_histogram)
    if act_qtype == "int8":
        assert result.delegation.partitions == 1 and not result.delegation.outside, str(result.delegation)
