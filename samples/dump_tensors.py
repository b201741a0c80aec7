"""Device side of `odmlq diff`: run a .tflite once and dump every tensor it computes.

Run it where the model runs (a phone with Python, a board, an emulator):

    python dump_tensors.py model.tflite inputs.npz dump.npz

`inputs.npz` holds one array per model input (in input order); `dump.npz` gets
one array per computed tensor, keyed by the tensor's name in the .tflite, with
its raw stored values. It needs only numpy and ai-edge-litert (or
tflite-runtime, whose Interpreter has the same API). Then, on the host:

    odmlq diff model.tflite --inputs inputs.npz --device-tensors dump.npz
"""

import argparse

import numpy as np

try:
    from ai_edge_litert.interpreter import Interpreter
except ImportError:  # tflite-runtime on small devices
    from tflite_runtime.interpreter import Interpreter


def main(model_path: str, inputs_path: str, dump_path: str) -> None:
    interpreter = Interpreter(model_path=model_path, experimental_preserve_all_tensors=True)
    interpreter.allocate_tensors()
    with np.load(inputs_path, allow_pickle=False) as f:
        arrays = [f[k] for k in f.files]
    for detail, x in zip(interpreter.get_input_details(), arrays):
        interpreter.set_tensor(detail["index"], x.astype(detail["dtype"]))
    interpreter.invoke()
    names = {d["index"]: d["name"] for d in interpreter.get_tensor_details()}
    produced = [int(t) for op in interpreter._get_ops_details() for t in op["outputs"]]
    np.savez(dump_path, **{names[i]: interpreter.get_tensor(i) for i in dict.fromkeys(produced)})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the .tflite to run")
    parser.add_argument("inputs", help=".npz with one array per model input, in input order")
    parser.add_argument("dump", help=".npz to write: every computed tensor by its name in the .tflite")
    args = parser.parse_args()
    main(args.model, args.inputs, args.dump)
