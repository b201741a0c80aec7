"""Running a .tflite the way the tests compare it: one row per invoke; simulate against float."""

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


def simulate_sqnr_db(model, result, inputs: np.ndarray, variables) -> float:
    """Output SQNR (dB) of `simulate`, with an export's plan and calibration, against the float model."""
    simulated = np.asarray(odmlq.simulate(model, result.plan, result.calibration, inputs, variables=variables))
    reference = np.asarray(model.apply(variables, inputs), np.float64)
    return float(10 * np.log10(np.sum(reference ** 2) / np.sum((reference - simulated) ** 2)))
