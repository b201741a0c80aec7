"""export_signatures: a decoder's prefill and decode in one file, weights stored once, each verified."""

import flax.linen as nn
import jax
import numpy as np
import pytest

import odmlq
from tests.litert import _decoder

DYNAMIC = [odmlq.Rule(".*", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]


@pytest.fixture(scope="module")
def decoder():
    return _decoder.decoder()


def test_prefill_and_decode_share_their_weights_in_one_verified_file(decoder, tmp_path):
    model, variables, prompts, steps = decoder
    result = odmlq.export_signatures(model, DYNAMIC, _decoder.signatures(model, prompts, steps), tmp_path / "decoder.tflite",
                                     variables=variables, progress=False)
    assert (tmp_path / "decoder.tflite").read_bytes() == result.tflite
    runner = odmlq.litert.interpreter(result.tflite)
    cache = ["keys_0", "keys_1", "values_0", "values_1"]  # the signature lists its names sorted
    assert runner.get_signature_list() == {
        "prefill": {"inputs": [*cache[:2], "tokens", *cache[2:]], "outputs": [*cache[:2], "logits", *cache[2:]]},
        "decode": {"inputs": [*cache[:2], "position", "token", *cache[2:]],
                   "outputs": [*cache[:2], "logits", *cache[2:]]}}
    # Each weight once: the file is the two signatures' files less one copy of the int8 weights.
    weights = sum(np.size(x) for x in jax.tree.leaves(variables))
    alone = sum(len(single.tflite) for single in result.signatures.values())
    assert len(result.tflite) <= alone - 0.9 * weights
    for single in result.signatures.values():
        assert single.verification.passed
    # The cache prefill writes is what decode reads: decode after prefill gives the float
    # model's next logits within the dynamic-range kernels' error.
    prefill, decode = runner.get_signature_runner("prefill"), runner.get_signature_runner("decode")
    tokens = prompts[0][0][:1]
    out = prefill(tokens=tokens, **dict(zip(model.cache_names(), model.empty_cache(1))))
    nxt = np.array([[7]], np.int32)
    out = decode(token=nxt, position=np.array([6], np.int32), **{n: out[n] for n in model.cache_names()})
    expected = np.asarray(model.apply(variables, np.concatenate([tokens, nxt], axis=1)))[:, -1]
    error = out["logits"][:, 0] - expected
    assert 10 * np.log10(np.sum(expected ** 2) / np.sum(error ** 2)) >= 25.0  # int8 weights and inputs


def test_signatures_that_cannot_share_a_file_are_refused(decoder):
    model, variables, prompts, steps = decoder
    with pytest.raises(odmlq.PlanError, match="needs at least one signature"):
        odmlq.export_signatures(model, DYNAMIC, {}, variables=variables)
    with pytest.raises(odmlq.PlanError, match="'two words' is not an identifier"):
        odmlq.export_signatures(model, DYNAMIC, {"two words": odmlq.Signature(rep_dataset=prompts)},
                                variables=variables)
    with pytest.raises(odmlq.PlanError, match="Signature 'decode' is a tuple; give an odmlq.Signature"):
        odmlq.export_signatures(model, DYNAMIC, {"decode": ("decode", steps)}, variables=variables)
    with pytest.raises(odmlq.TraceError, match="Signature 'decode': Tracing Decoder failed.*no attribute "
                                               '"nothing"'):
        odmlq.export_signatures(model, DYNAMIC, {"decode": odmlq.Signature(method="nothing", rep_dataset=steps)},
                                variables=variables, progress=False)


class _TwoHeads(nn.Module):
    def setup(self):
        self.static, self.dynamic = nn.Dense(4), nn.Dense(4)

    def __call__(self, x):
        return self.static(x) + self.dynamic(x)

    def first(self, x):
        return self.static(x)

    def second(self, x):
        return self.dynamic(x)


def test_signatures_of_two_schemas_are_refused():
    model, x = _TwoHeads(), np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    variables = model.init(jax.random.key(0), x)
    rules = [odmlq.Rule("static", weight_qtype="int8", act_qtype="int8"),
             odmlq.Rule("dynamic", weight_qtype="int8", act_qtype="int8", act_dynamic=True)]
    with pytest.warns(odmlq.UnmatchedRuleWarning), pytest.raises(
            odmlq.PlanError, match=r"different schemas \({'first': 'static', 'second': 'dynamic'}\)"):
        odmlq.export_signatures(model, rules, {"first": odmlq.Signature(method="first", rep_dataset=[x, x]),
                                               "second": odmlq.Signature(method="second", rep_dataset=[x, x])},
                                variables=variables, progress=False)


def test_a_combined_file_that_differs_from_the_verified_ones_is_refused(decoder):
    from odmlq.litert import signatures

    model, variables, prompts, steps = decoder
    result = odmlq.export_signatures(model, DYNAMIC, _decoder.signatures(model, prompts, steps), variables=variables,
                                     verify=False, progress=False)
    swapped = {"prefill": result.signatures["decode"], "decode": result.signatures["prefill"]}
    prepared = {name: signatures.prepare(model, DYNAMIC, data, variables=variables, method=name)
                for name, data in (("prefill", prompts), ("decode", steps))}
    with pytest.raises(odmlq.litert.ConversionError, match="Signature 'prefill' converted with the others has "
                                                          "other ops"):
        signatures._check_combined(result.tflite, swapped, prepared, 4)
