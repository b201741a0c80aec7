"""Running a .tflite the way the tests compare it: one row per invoke."""

import numpy as np

import odmlq


def litert_rows(tflite: bytes, rows) -> np.ndarray:
    """The model's first output for each row of `rows` (its first input), one invoke per row."""
    runner = odmlq.litert.interpreter(tflite, num_threads=1)
    inp, out = runner.get_input_details()[0], runner.get_output_details()[0]
    outputs = []
    for row in rows:
        runner.set_tensor(inp["index"], np.asarray(row)[None])
        runner.invoke()
        outputs.append(runner.get_tensor(out["index"])[0])
    return np.stack(outputs)
