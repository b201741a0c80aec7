"""The interpreter probe's child process (see `_probe`): loads a .tflite,
allocates its tensors and invokes it once on zeros.

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
    interpreter.allocate_tensors()
    for detail in interpreter.get_input_details():
        interpreter.set_tensor(detail["index"], np.zeros(detail["shape"], detail["dtype"]))
    interpreter.invoke()


if __name__ == "__main__":
    main(sys.argv[1])
