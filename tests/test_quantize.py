"""Quantized decoding (int8 and bf16 weights chosen at load): error bounds, no float copy of a quantized
matrix in the decode loop, greedy agreement on a trained model, and the engine's guarantees."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gpt import GPT, GPTConfig
from gpt.errors import ConfigError
from gpt.generate import generate
from gpt.inference import decoder as decoder_module
from gpt.inference.decoder import Decoder, decoding_weights
from gpt.inference.device_slots import compiled_decode
from gpt.inference.engine import Engine
from gpt.inference.request import Request
from gpt.inference.sampling import GREEDY, Sampling
from gpt.model.layouts import Bf16Matrix, Int8Matrix
from gpt.model.transformer import forward, lm_head

from conftest import some_quick

# Relative Frobenius error of one matrix, |Q(W) - W| / |W|, for Gaussian weights of GPT-2's width: int8
# with a scale per output row rounds to steps of max|row| / 127 (~3.3 sigma / 127 for 768 entries), an
# error of step / sqrt(12) ~ 0.75% of sigma; bfloat16 keeps 8 significant bits (~0.2%).
FROBENIUS_BOUND = {"int8": 0.01, "bf16": 0.003}


@pytest.mark.parametrize("layout, name", [(Int8Matrix, "int8"), (Bf16Matrix, "bf16")])
def test_quantization_error_per_matrix_is_bounded(layout, name):
    # Each check one jitted program, not one per operation.
    relative_error = jax.jit(lambda m: jnp.linalg.norm(layout.quantize(m).dequantize() - m) / jnp.linalg.norm(m))
    quantized_product = jax.jit(lambda m, rows: layout.quantize(m).matmul(rows))
    rng = np.random.default_rng(0)
    for shape in [(2304, 768), (768, 768), (3072, 768), (768, 3072), (50257, 768)]:
        matrix = jnp.asarray(rng.normal(0, 0.02, shape), jnp.float32)
        error = float(relative_error(matrix))
        assert error < FROBENIUS_BOUND[name], (shape, error)
    x = jnp.asarray(rng.normal(size=(3, 768)), jnp.float32)
    matrix = jnp.asarray(rng.normal(0, 0.02, (2304, 768)), jnp.float32)
    exact = x @ matrix.T
    for rows in (x, x[:1]):  # one row runs as two: the same answer
        got = quantized_product(matrix, rows)
        assert float(jnp.linalg.norm(got - exact[: len(rows)]) / jnp.linalg.norm(exact[: len(rows)])) < 2 * FROBENIUS_BOUND[name]


@functools.partial(jax.jit, static_argnames="config")
def tiny_logits(config, weights):
    tokens = jnp.asarray([list(range(1, 60))], jnp.int32)
    positions = jnp.arange(59)[None]
    return lm_head(weights, forward(config, weights, tokens, positions)[0])


@pytest.mark.parametrize("quantize, bound, tied_head", some_quick(
    [(q, bound, tied) for tied in (True, False) for q, bound in (("int8", 0.05), ("bf16", 0.02))],
    quick=[("int8", 0.05, True), ("bf16", 0.02, False)]))
def test_logits_stay_close_to_float32(quantize, bound, tied_head):
    # A random tiny model: the logits' max abs difference, relative to their spread (untied: the head's
    # own matrix is quantized, not the embedding's).
    model = GPT(GPTConfig.preset("tiny", n_embd=64, tied_head=tied_head), rngs=nnx.Rngs(0))
    reference = tiny_logits(model.config, model.weights())
    got = tiny_logits(model.config, decoding_weights(model, quantize))
    assert float(jnp.abs(got - reference).max()) < bound * float(reference.max() - reference.min())


@pytest.mark.slow
@pytest.mark.parametrize("quantize, stored", [("int8", "s8[144,48]"), ("int4", "u8[144,32]")])
def test_no_float_copy_of_a_quantized_matrix_in_the_decode_loop(quantize, stored):
    # Distinctive sizes: D = 48, qkv 144, MLP 192, vocabulary 300. A float32 array of any quantized
    # matrix's shape (either orientation) in the compiled decode program would be a dequantized copy (int4's
    # inputs padded to whole pairs of blocks, 64: [144, 64] as levels, two a byte).
    config = GPTConfig.preset("tiny", n_embd=48, n_head=4, vocab_size=300)
    model = GPT(config, rngs=nnx.Rngs(0))
    engine = Engine(model, slots=2, cache_length=32, quantize=quantize)
    shapes = [(144, 48), (192, 48), (48, 192), (300, 48), (144, 64), (192, 64), (48, 192)]
    device = engine.device
    text = compiled_decode.lower(config, device.weights, device.slots, np.int32(1), np.bool_(False),
                                 max_steps=1).compile().as_text()
    assert stored in text  # the quantized matrices are there...
    for k, d in shapes:
        for shape in (f"f32[{k},{d}]", f"f32[{d},{k}]", f"bf16[{k},{d}]", f"bf16[{d},{k}]"):
            assert not re.search(re.escape(shape) + r"[{ ]", text), shape  # ...and no float copy of them
    device = Engine(model, slots=2, cache_length=32).device
    text = compiled_decode.lower(config, device.weights, device.slots, np.int32(1), np.bool_(False),
                                 max_steps=1).compile().as_text()
    assert re.search(r"f32\[144,48\][{ ]", text)  # the check can see a float matrix when there is one


@pytest.fixture(scope="module")
def trained(trained_run):
    from gpt.train.checkpoint import load_model

    return load_model(trained_run)


# Greedy decoding follows the argmax; where the top two logits are close, any perturbation may swap them
# and the paths part. On the trained tiny model the first N tokens of every prompt below agree.
AGREE_STEPS = 24


@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["int8", "bf16"])
def test_greedy_tokens_agree_with_float32_on_a_trained_model(trained, quantize):
    from gpt.tokenizer import get_tokenizer

    prompts = get_tokenizer().encode_batch(["def main(", "import os\n", "class Reader:", "    return self."])
    want = generate(trained, prompts, AGREE_STEPS, sampling=GREEDY)
    got = generate(trained, prompts, AGREE_STEPS, sampling=GREEDY, quantize=quantize)
    assert got == want


@pytest.mark.slow
def test_engine_guarantees_hold_with_int8():
    model = GPT(GPTConfig.preset("tiny", block_size=128), rngs=nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, nnx.state(model, nnx.Param)))
    prompts = [[5, 17, 99], list(range(30, 43)), [200], [7, 7, 8, 9, 10, 250, 3]]  # in one bucket: fewer programs
    batched = generate(model, prompts, 12, sampling=GREEDY, quantize="int8")
    assert batched == [generate(model, [p], 12, sampling=GREEDY, quantize="int8")[0] for p in prompts]

    engine = Engine(model, slots=4, cache_length=64, quantize="int8")
    engine.warmup(log=lambda line: None)
    compiled = engine.compiled_shapes()
    request = Request([4, 5, 6], 20, Sampling(temperature=1.0, top_p=0.9), seed=3)
    alone = engine.submit(request)
    engine.run([alone])
    others = [engine.submit(Request(list(range(1, n)), 30, Sampling(temperature=0.7), seed=n)) for n in (9, 30)]
    engine.step()
    again = engine.submit(request)
    engine.run([again, *others])
    assert again.tokens == alone.tokens
    assert engine.compiled_shapes() == compiled


def test_an_unknown_quantization_is_refused():
    model = GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="quantize must be one of none, int8, int4, bf16; got 'int3'"):
        generate(model, [[1, 2]], 4, quantize="int3")


@pytest.mark.slow  # a further case of a check the quick tier makes
def test_a_decoder_is_laid_out_once_for_every_call(monkeypatch):
    model = GPT(GPTConfig.preset("tiny", block_size=128), rngs=nnx.Rngs(0))
    prompts = [[5, 17, 99], list(range(30, 51))]
    expected = generate(model, prompts, 10, sampling=GREEDY, quantize="int8")
    decoder = Decoder.of(model, "int8")
    calls = []
    monkeypatch.setattr(decoder_module, "decoding_weights", lambda *args: calls.append(args))
    assert generate(decoder, prompts, 10, sampling=GREEDY) == expected
    assert generate(decoder, prompts[:1], 10, sampling=GREEDY, quantize="int8") == expected[:1]
    Engine(decoder, slots=2, cache_length=32)
    assert calls == []  # neither generate nor the engine laid the weights out again
    with pytest.raises(ConfigError, match="quantize='bf16' differs from the Decoder's 'int8'"):
        generate(decoder, prompts, 10, quantize="bf16")
