"""LoRA and QLoRA: adapters where the rules say, a base stored quantized, training, merge and export."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import odmlq
from tests._runs import litert_rows


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, name="up")(x))
        x = nn.DenseGeneral((2, 32), name="heads")(x).reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(64, name="mix")(x))
        return nn.Dense(4, name="head")(x)


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 64, rngs=rngs)
        self.mix = nnx.Linear(64, 64, rngs=rngs)
        self.head = nnx.Linear(64, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.mix(self.drop(nnx.relu(self.up(x))))))


NF4 = [odmlq.Rule("head", skip=True), odmlq.Rule(".*", weight_qtype="nf4", weight_granularity=odmlq.PerBlock(16))]


def _task(seed=0, n=384):
    """Four classes decided by a random projection of the inputs: a task the random model fails."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(16, 4)), axis=-1)
    return x, y


def _linen():
    x, y = _task()
    model = Net()
    return model, model.init(jax.random.key(0), x[:1]), x, y


def _train(adapted, x, y, steps=150, lr=1e-2):
    optimizer = optax.adam(lr)

    @jax.jit
    def step(adapters, state, frozen, xb, yb):
        def loss(a):
            return optax.softmax_cross_entropy_with_integer_labels(adapted.apply(a, xb, frozen=frozen), yb).mean()
        value, grads = jax.value_and_grad(loss)(adapters)
        updates, state = optimizer.update(grads, state, adapters)
        return optax.apply_updates(adapters, updates), state, value

    adapters, state, losses = adapted.adapters, optimizer.init(adapted.adapters), []
    for _ in range(steps):
        adapters, state, value = step(adapters, state, adapted.frozen, x[:256], y[:256])
        losses.append(float(value))
    return adapters, losses


def _accuracy(logits, y) -> float:
    return float(np.mean(np.argmax(np.asarray(logits), -1) == y))


def _learned(adapted, x, y) -> tuple[dict, np.ndarray]:
    """Trains the adapters on 256 rows; asserts that the loss falls and that the held-out
    rows, where the random model is near chance (0.25), are learned. Returns the trained
    adapters and the held-out logits."""
    frozen_accuracy = _accuracy(adapted.apply(adapted.adapters, x[256:]), y[256:])
    adapters, losses = _train(adapted, x, y)
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    trained = np.asarray(adapted.apply(adapters, x[256:]))
    assert _accuracy(trained, y[256:]) >= frozen_accuracy + 0.3
    return adapters, trained


def test_adapt_chooses_the_adapted_matmuls_over_a_base_the_rules_quantize():
    model, variables, x, _ = _linen()
    adapted = odmlq.lora(model, NF4, (x[:1],), variables=variables, adapt="heads|mix")
    assert sorted(adapted.placements) == ["heads/kernel", "mix/kernel"]
    assert isinstance(adapted.frozen["params"]["up"]["kernel"], odmlq.QArray)  # stored nf4, no adapter


def test_adapters_sit_on_matched_matmuls_and_start_at_the_base():
    model, variables, x, _ = _linen()
    adapted = odmlq.lora(model, NF4, (x[:1],), variables=variables, rank=4, alpha=8)
    # The head is skipped: no adapter, and its weight stays float in the base.
    assert sorted(adapted.placements) == ["heads/kernel", "mix/kernel", "up/kernel"]
    heads = adapted.placements["heads/kernel"]
    assert (heads.contracted, heads.outputs) == ((0,), (1, 2))
    assert adapted.adapters["heads/kernel"]["a"].shape == (64, 4)
    assert adapted.adapters["heads/kernel"]["b"].shape == (4, 64)
    assert adapted.scaling == 2.0
    frozen = adapted.frozen["params"]
    assert isinstance(frozen["up"]["kernel"], odmlq.QArray) and frozen["up"]["kernel"].qtype.name == "nf4"
    assert not isinstance(frozen["head"]["kernel"], odmlq.QArray)
    # b starts at zero: the model computes the base's grid values, exactly.
    dequantized = jax.tree.map(lambda q: q.dequantize() if isinstance(q, odmlq.QArray) else q,
                               adapted.frozen, is_leaf=lambda q: isinstance(q, odmlq.QArray))
    np.testing.assert_array_equal(np.asarray(adapted.apply(adapted.adapters, x)),
                                  np.asarray(model.apply(dequantized, x)))


def test_qlora_base_is_stored_at_under_a_third_of_float():
    model, variables, x, _ = _linen()
    adapted = odmlq.lora(model, [odmlq.Rule(".*", weight_qtype="nf4", weight_granularity=odmlq.PerBlock(16))],
                         (x[:1],), variables=variables)
    # nf4 is half a byte a weight, a float32 scale per 16 a quarter byte more; the float
    # biases and nothing else stay float32.
    assert adapted.base_bytes <= 0.3 * adapted.float_bytes, (adapted.base_bytes, adapted.float_bytes)
    stored = adapted.frozen["params"]["up"]["kernel"]
    assert stored.qvalue.dtype == jnp.uint8 and stored.qvalue.size == 16 * 64 // 2  # packed, two a byte
    assert "0.2" in repr(adapted) or "0.1" in repr(adapted)


def test_the_delta_is_laid_out_in_the_weights_own_axes():
    model, variables, x, _ = _linen()
    adapted = odmlq.lora(model, NF4, (x[:1],), variables=variables, rank=3, alpha=6)
    rng = np.random.default_rng(1)
    adapters = jax.tree.map(lambda t: jnp.asarray(rng.normal(size=t.shape), jnp.float32), adapted.adapters)
    merged = adapted.merge(adapters)
    base = adapted.frozen["params"]["heads"]["kernel"].dequantize()
    a, b = adapters["heads/kernel"]["a"], adapters["heads/kernel"]["b"]
    # (64, 2, 32): the two output axes flattened in C order, as a reshape of x @ W does.
    expected = np.asarray(base) + 2.0 * np.asarray(a @ b).reshape(64, 2, 32)
    np.testing.assert_allclose(merged["params"]["heads"]["kernel"], expected, rtol=1e-6, atol=1e-6)


def test_adapters_train_and_the_merged_model_exports_what_they_learned(tmp_path):
    model, variables, x, y = _linen()
    adapted = odmlq.lora(model, NF4, (x[:1],), variables=variables, rank=8, alpha=16)
    adapters, trained = _learned(adapted, x, y)
    merged = adapted.merge(adapters)
    # Merged float weights compute what the adapters did (float32 sums in another order).
    np.testing.assert_allclose(np.asarray(model.apply(merged, x[256:])), trained, rtol=1e-4, atol=1e-4)
    rules = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")]
    exported = odmlq.export_tflite(model, rules, [x[:64], x[64:128]], tmp_path / "lora.tflite",
                                   variables=merged, progress=False)
    assert (tmp_path / "lora.tflite").exists()
    assert _accuracy(litert_rows(exported.tflite, x[256:]), y[256:]) >= _accuracy(trained, y[256:]) - 0.05
    qmodel = odmlq.ptq(model, [odmlq.Rule(".*", weight_qtype="int8")], merged, example_inputs=(x[:1],))
    assert _accuracy(qmodel(x[256:]), y[256:]) >= _accuracy(trained, y[256:]) - 0.05


def test_nnx_modules_train_adapters_over_their_state():
    x, y = _task()
    model = NnxNet(nnx.Rngs(0))
    model.eval()
    adapted = odmlq.lora(model, [odmlq.Rule(".*", weight_qtype="int4", weight_granularity=odmlq.PerBlock(16))],
                         (x[:1],), rank=4, alpha=8)
    assert isinstance(adapted.frozen, nnx.State)
    assert adapted.base_bytes <= 0.3 * adapted.float_bytes
    adapters, trained = _learned(adapted, x, y)
    merged = adapted.merge(adapters)
    assert isinstance(merged, nnx.State)
    nnx.update(model, merged)
    np.testing.assert_allclose(np.asarray(model(x[256:])), trained, rtol=1e-4, atol=1e-4)
    exported = odmlq.export_tflite(model, [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8")],
                                   [x[:64]], progress=False)
    assert _accuracy(litert_rows(exported.tflite, x[256:]), y[256:]) >= _accuracy(trained, y[256:]) - 0.05


def test_a_float_base_is_plain_lora_and_loops_and_convolutions_get_adapters():
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return nn.relu(nn.Dense(8)(x)), None

    class Looped(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
            x, _ = layers(name="layers")(x, None)
            x = nn.Conv(4, (3, 3), name="conv")(x.reshape(x.shape[0], 2, 4, 1))
            return x.reshape(x.shape[0], -1)

    model, x = Looped(), np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    adapted = odmlq.lora(model, [], (x[:1],), variables=variables, rank=2, adapt=".*")
    assert adapted.base_bytes == adapted.float_bytes  # no weight qtype: nothing stored quantized
    loop, conv = adapted.placements["layers/Dense_0/kernel"], adapted.placements["conv/kernel"]
    assert (loop.stacked, loop.contracted, loop.outputs) == ((0,), (1,), (2,))
    assert adapted.adapters["layers/Dense_0/kernel"]["a"].shape == (3, 8, 2)  # one adapter per layer
    assert (conv.contracted, conv.outputs) == ((0, 1, 2), (3,))  # the window is contracted too
    adapters = jax.tree.map(lambda t: jnp.full_like(t, 0.1), adapted.adapters)
    np.testing.assert_allclose(np.asarray(adapted.apply(adapters, x)),
                               np.asarray(model.apply(adapted.merge(adapters), x)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(adapted.merge(adapters)["params"]["layers"]["Dense_0"]["kernel"][1],
                               np.asarray(variables["params"]["layers"]["Dense_0"]["kernel"][1])
                               + 0.1 * 0.1 * 2, rtol=1e-6)  # rank 2, each slice its own


def test_bad_requests_are_refused_with_the_fix():
    model, variables, x, _ = _linen()
    with pytest.raises(odmlq.RuleError, match="rank=0; give a positive integer"):
        odmlq.lora(model, NF4, (x[:1],), variables=variables, rank=0)
    with pytest.warns(odmlq.UnmatchedRuleWarning), \
            pytest.raises(odmlq.PlanError, match="no rule of 1 matches a matmul reading a weight"):
        odmlq.lora(model, [odmlq.Rule("nothing_here", weight_qtype="int8")], (x[:1],), variables=variables)
    with pytest.raises(odmlq.PlanError, match="adapt='nothing_here' matches the module path of no matmul"):
        odmlq.lora(model, [], (x[:1],), variables=variables, adapt="nothing_here")
    with pytest.raises(odmlq.RuleError, match=r"adapt='\(' is not a regular expression"):
        odmlq.lora(model, [], (x[:1],), variables=variables, adapt="(")
    with pytest.raises(odmlq.RuleError, match="needs calibration data; use weight_algorithm=odmlq.Nearest"):
        odmlq.lora(model, [odmlq.Rule(".*", weight_qtype="int4", weight_algorithm=odmlq.GPTQ())], (x[:1],),
                   variables=variables)
    adapted = odmlq.lora(model, NF4, (x[:1],), variables=variables)
    with pytest.raises(odmlq.PlanError, match=r"Adapters for \['head/kernel'\] have no place"):
        adapted.apply({**adapted.adapters, "head/kernel": adapted.adapters["up/kernel"]}, x)
    with pytest.raises(odmlq.PlanError, match="needs its variables: pass variables="):
        odmlq.lora(model, NF4, (x[:1],))
