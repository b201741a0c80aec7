import pytest


@pytest.mark.slow
def test_digits_cnn_main_job_meets_its_targets(tmp_path):
    """The README's main job: int8 within 1 point of float, under 30% of its size."""
    from samples import digits_cnn

    results = digits_cnn.main(str(tmp_path), seconds=5.0)
    assert results["int8_tflite"] >= results["float_tflite"] - 0.01
    assert results["float_tflite"] >= 0.95
    assert results["int8_bytes"] < 0.30 * results["float_bytes"]
    assert (tmp_path / "digits_cnn_int8.tflite").exists()
