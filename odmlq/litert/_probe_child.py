"""The interpreter probe's child process (see `_probe`): loads a .tflite,
allocates its tensors (exit 3 when LiteRT refuses) and invokes it once on
zeros (an exception there is no finding: zeros are no real input), and every
other signature's entry point the same way.

Run as a script with the model's path; it imports only ai_edge_litert and
numpy. LiteRT aborts the process on some models (a tensor whose scale
overflows its kernel's arithmetic, seen in allocate_tensors): the parent sees
a signal instead of losing its own process.
"""

from __future__ import annotations

import sys
import warnings


def main(path: str) -> None:
    import numpy as np
    from ai_edge_litert.interpreter import Interpreter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        interpreter = Interpreter(model_path=path, experimental_preserve_all_tensors=True)
    try:
        interpreter.allocate_tensors()
    except Exception as error:  # noqa: BLE001 - reported to the parent as it is
        sys.stderr.write(f"allocate_tensors: {error}\n")
        sys.exit(3)
    for detail in interpreter.get_input_details():
        interpreter.set_tensor(detail["index"], np.zeros(detail["shape"], detail["dtype"]))
    try:
        interpreter.invoke()
    except Exception:  # noqa: BLE001 - zeros are no real input (a DIV by a zero mask sum)
        pass
    signatures = interpreter.get_signature_list()
    for name in signatures if len(signatures) > 1 else ():  # every entry point of a multi-signature file
        runner = interpreter.get_signature_runner(name)
        try:
            runner(**{key: np.zeros(d["shape"], d["dtype"]) for key, d in runner.get_input_details().items()})
        except Exception:  # noqa: BLE001 - as above
            pass


if __name__ == "__main__":
    main(sys.argv[1])
