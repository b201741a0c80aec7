"""Keras 3 models (JAX backend) as odmlq models: a Sequential CNN trained on the
digits and a keras-hub BERT backbone, exported full-integer int8 and verified,
quantized for XLA, with rules on Keras layer names."""

import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is first imported

import keras  # noqa: E402

import odmlq  # noqa: E402
from odmlq.errors import TraceError  # noqa: E402
from samples.digits import batches, load_digits_splits  # noqa: E402

INT8 = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]


@pytest.fixture(scope="module")
def digits():
    return load_digits_splits()


@pytest.fixture(scope="module")
def trained_cnn(digits):
    """A Sequential CNN with a BatchNormalization, trained by Keras' own fit."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", name="conv1"),
        keras.layers.BatchNormalization(name="bn1"),
        keras.layers.ReLU(name="relu1"),
        keras.layers.MaxPooling2D(name="pool"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv2"),
        keras.layers.Flatten(name="flatten"),
        keras.layers.Dense(10, name="head"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(digits.x_train, digits.y_train, batch_size=64, epochs=4, verbose=0)
    return model


def _accuracy(logits, labels) -> float:
    return float(np.mean(np.argmax(np.asarray(logits), axis=-1) == labels))


def test_a_trained_keras_cnn_exports_full_integer_within_a_point_of_float(trained_cnn, digits, tmp_path):
    from samples.digits_cnn import tflite_accuracy

    result = odmlq.export_tflite(trained_cnn, INT8, batches(digits.x_calibration, 32), tmp_path / "cnn.tflite",
                                 progress=False)
    assert result.verification.passed and result.summary.float_islands == ()
    assert result.summary.schema == "static"
    # The BatchNormalization is folded into conv1, as a Flax one is.
    assert not any(op.module_path == "bn1" for op in result.plan.graph.ops), result.plan
    float_accuracy = _accuracy(trained_cnn.predict(digits.x_test, verbose=0), digits.y_test)
    assert float_accuracy > 0.9
    # One point: 5 of the 540 test images (measured: the same accuracy, 0.928).
    assert tflite_accuracy(result.tflite, digits.x_test, digits.y_test) >= float_accuracy - 0.01


def test_rules_match_keras_layer_names_and_ptq_runs_on_xla(trained_cnn, digits):
    rules = [odmlq.Rule("head", skip=True)] + INT8
    plan = odmlq.plan(trained_cnn, rules, digits.x_test[:1])
    assert {op.module_path for op in plan.graph.ops} >= {"conv1", "conv2", "pool", "head"}
    head = [op for op in plan.graph.ops if op.module_path == "head"]
    assert head and all(plan.ops[op.id].rule == 0 for op in head)
    assert "sequential/conv1/kernel" in plan.weight_specs()
    calibration = odmlq.calibrate(trained_cnn, plan, batches(digits.x_calibration, 32))
    qmodel = odmlq.ptq(trained_cnn, plan, None, calibration)
    scales = odmlq.compute_scales(plan, calibration, odmlq.graph.keras_state(trained_cnn))
    simulated = np.asarray(odmlq.simulate(trained_cnn, plan, scales, digits.x_test[:64]))
    # XLA's integer kernels compute what simulate does: the float head's input
    # is dequantized, so its outputs agree to float32 rounding of a few steps.
    np.testing.assert_allclose(np.asarray(qmodel(digits.x_test[:64])), simulated, atol=1e-3)


def test_a_keras_hub_bert_backbone_exports_full_integer_and_verifies(tmp_path):
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(vocabulary_size=100, num_layers=2, num_heads=2, hidden_dim=32,
                                             intermediate_dim=64, max_sequence_length=16)
    names = odmlq.graph.keras_input_names(backbone)
    assert sorted(names) == ["padding_mask", "segment_ids", "token_ids"]
    rng = np.random.default_rng(0)

    def batch(n):
        ids = rng.integers(1, 100, (n, 16)).astype("int32")
        mask = (np.arange(16)[None] < rng.integers(6, 17, n)[:, None]).astype("int32")
        by_name = {"token_ids": ids * mask, "segment_ids": np.zeros((n, 16), "int32"), "padding_mask": mask}
        return tuple(by_name[k] for k in names)

    result = odmlq.export_tflite(backbone, INT8, [batch(8) for _ in range(5)], tmp_path / "bert.tflite",
                                 progress=False)
    assert result.verification.passed and result.summary.float_islands == ()
    assert set(result.summary.signatures["serving_default"]["inputs"]) == set(names)
    # Keras' LayerNormalization (x * i + (beta - mean * i)) is recognised as a norm.
    assert any(op.kind == "rsqrt" and "layer_norm" in op.module_path for op in result.plan.graph.ops)
    # Both outputs (a dict: pooled and sequence) checked end to end; the zoo's
    # transformer floor is 25 dB (measured 34.6 dB here).
    assert result.verification.litert_float_sqnr_db >= 25, result.verification


def test_a_keras_hub_gpt2_backbone_exports_full_integer_and_verifies(tmp_path):
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=100, num_layers=2, num_heads=2, hidden_dim=32,
                                             intermediate_dim=64, max_sequence_length=16)
    names = odmlq.graph.keras_input_names(backbone)
    rng = np.random.default_rng(0)

    def batch(n):
        ids = rng.integers(1, 100, (n, 16)).astype("int32")
        mask = (np.arange(16)[None] < rng.integers(6, 17, n)[:, None]).astype("int32")
        return tuple({"token_ids": ids * mask, "padding_mask": mask}[k] for k in names)

    result = odmlq.export_tflite(backbone, INT8, [batch(8) for _ in range(5)], tmp_path / "gpt2.tflite",
                                 progress=False)
    assert result.verification.passed and result.summary.float_islands == ()
    # A causal decoder: the zoo's transformer floor (measured 31.4 dB).
    assert result.verification.litert_float_sqnr_db >= 25, result.verification


def test_a_keras_model_with_named_inputs_takes_one_array_per_name():
    inputs = {"a": keras.Input((4,), name="a"), "b": keras.Input((4,), name="b")}
    model = keras.Model(inputs, keras.layers.Dense(2, name="d")(inputs["a"] + inputs["b"]))
    with pytest.raises(TraceError, match=r"takes 2 inputs, in this order: \['a', 'b'\]; got 1"):
        odmlq.plan(model, INT8, np.ones((1, 4), np.float32))


def test_an_unbuilt_keras_model_is_refused_by_name():
    model = keras.Sequential([keras.layers.Dense(2, name="d")], name="unbuilt")
    with pytest.raises(TraceError, match="'unbuilt' has no variables yet: build it"):
        odmlq.plan(model, INT8, np.ones((1, 4), np.float32))


def _int8_mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, name="d1", activation="relu"),
                              keras.layers.Dense(4, name="d2")])
    model.quantize("int8")
    return model


def test_a_model_quantized_by_keras_is_refused_by_layer_and_pointed_to_keras_quantized():
    # Before: "LiteRT has no int8 kernel for 'round'", about Keras' own activation rounding.
    with pytest.raises(TraceError, match=r"quantized by model.quantize\(\): d1 \(int8\), d2 \(int8\)\. "
                                         r"Read it with odmlq.keras_quantized\(model\)"):
        odmlq.export_tflite(_int8_mlp(), INT8, [np.ones((4, 16), np.float32)], progress=False)


def test_keras_int8_layers_are_read_back_with_their_own_integers():
    model = _int8_mlp()
    twin, rules = odmlq.keras_quantized(model)
    assert [r.module_path for r in rules] == ["d1", "d2"]
    x = np.random.default_rng(1).normal(size=(64, 16)).astype(np.float32)
    qmodel = odmlq.ptq(twin, rules, example_inputs=(x[:1],))
    # The stored int8 kernels come back exactly: each channel's largest is +-127.
    for layer in ("d1", "d2"):
        stored = np.asarray(model.get_layer(layer).kernel.value)
        mine = qmodel.params[twin.get_layer(layer).kernel.path]
        np.testing.assert_array_equal(np.asarray(mine.qvalue).reshape(stored.shape), stored)
    # Keras' int8 forward pass: activations per row (127 / max|x|, half to even),
    # int32 matmuls, one rescale. The same integers leave only float32 rounding of
    # the rescale (a few ulps of outputs up to ~3; measured 2.4e-7).
    np.testing.assert_allclose(np.asarray(qmodel(x)), np.asarray(model(x)), rtol=0, atol=2e-6)


def test_keras_quantized_refuses_a_float_model():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])
    with pytest.raises(TraceError, match="has no layer quantized by model.quantize"):
        odmlq.keras_quantized(model)


def test_keras_int8_layers_export_to_litert_with_their_own_integers(tmp_path):
    """The dynamic-range .tflite of the twin holds Keras' int8 kernels, and
    LiteRT's built-in hybrid kernels (per-row symmetric inputs, as Keras)
    compute Keras' int8 forward pass: the same integers, float32 rounding of
    the rescale only. XNNPACK's dynamic path quantizes inputs asymmetrically
    (measured 0.021 off on outputs up to 2.7), so the built-in kernels are used here."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    model = _int8_mlp()
    twin, rules = odmlq.keras_quantized(model)
    x = np.random.default_rng(1).normal(size=(64, 16)).astype(np.float32)
    # Keras' inputs are symmetric per row: verified op by op on the built-in kernels, which
    # quantize them so, and the export says that XNNPACK does not.
    with pytest.warns(UserWarning, match=r"built-in kernels: the plan quantizes the dynamic inputs of d1, d2 "
                                         r"symmetrically.*XNNPACK .* quantizes them asymmetrically"):
        result = odmlq.export_tflite(twin, rules, [x[:32], x[32:]], tmp_path / "int8.tflite", progress=False)
    assert result.summary.schema == "dynamic" and result.verification.passed
    assert result.verification.builtin_kernels_for == ("d1", "d2") and "built-in kernels" in str(result.verification)
    stored = {name: np.asarray(model.get_layer(name).kernel.value) for name in ("d1", "d2")}
    weights = [t for t in result.summary.tensors if t.is_constant and t.dtype == "int8"]
    runner = Interpreter(model_content=result.tflite,
                         experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    runner.allocate_tensors()
    kernels = sorted((runner.get_tensor(t.index) for t in weights), key=lambda k: k.size)
    np.testing.assert_array_equal(kernels[0], stored["d2"].T)
    np.testing.assert_array_equal(kernels[1], stored["d1"].T)
    inp, out = runner.get_input_details()[0], runner.get_output_details()[0]
    outputs = []
    for row in x:
        runner.set_tensor(inp["index"], row[None])
        runner.invoke()
        outputs.append(runner.get_tensor(out["index"])[0])
    np.testing.assert_allclose(np.stack(outputs), np.asarray(model(x)), rtol=0, atol=2e-6)
