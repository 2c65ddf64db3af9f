"""int4 weights (`gpt.model.int4`, `Int4Matrix`, `kernels/few_rows_int4.cc`): the packing the kernel reads, an
error no larger than llama.cpp's own Q4_0 on the same weights, the kernel equal to XLA's product to float32's
rounding at every row count and instruction set, and decoding with it: logits near float32's, the same
tokens with the kernels off, and what it cannot draft (tests/test_quantize.py: no float copy in the decode loop)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gpt import GPT, GPTConfig
from gpt.errors import ConfigError
from gpt.generate import generate
from gpt.inference.decoder import decoding_weights
from gpt.inference.engine import Engine
from gpt.inference.sampling import GREEDY
from gpt.model import cpu_kernels, int4
from gpt.model.few_rows import MAX_KERNEL_ROWS, kernel_int4_product, quantize_rows, xla_int4_product
from gpt.model.layouts import Int4Matrix
from gpt.model.transformer import forward, lm_head

from conftest import some_quick


def test_packing_is_the_byte_order_the_kernel_reads():
    # Byte i of a pair of blocks (64 inputs, 32 bytes): input i in the low nibble, input 32 + i in the high one,
    # each as level + 8.
    levels = jnp.asarray(np.random.default_rng(0).integers(-8, 8, (3, 128)), jnp.int8)
    packed = np.asarray(int4.pack(levels))
    assert packed.shape == (3, 64) and packed.dtype == np.uint8
    pair = np.asarray(levels, np.int32)[1, 64:128] + 8
    np.testing.assert_array_equal(packed[1, 32:64], pair[:32] | (pair[32:] << 4))
    np.testing.assert_array_equal(np.asarray(int4.unpack(int4.pack(levels))), np.asarray(levels))


def _q4_0_error(matrix: np.ndarray) -> float:
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    restored = dequantize(quantize(matrix, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0)
    return float(np.linalg.norm(restored - matrix) / np.linalg.norm(matrix))


@pytest.mark.parametrize("weights", some_quick(["normal", "heavy-tailed"], quick=["normal"]))
def test_the_error_is_at_most_llama_cpps_q4_0_on_the_same_weights(weights):
    # Q4_0 (llama.cpp's gguf-py: blocks of 32, the extreme at level -8, an fp16 scale) is the bound; each block's
    # scale here is the best of a few near it (after rounding to its int8 multiple), so the error is no larger. Heavy tails: Student's t with 3 degrees
    # of freedom, outliers as trained weights have them.
    rng = np.random.default_rng(0)
    shape = (512, 768)
    matrix = (rng.normal(0, 0.02, shape) if weights == "normal" else 0.02 * rng.standard_t(3, shape)).astype(np.float32)
    quantized = jax.jit(Int4Matrix.quantize)(jnp.asarray(matrix))
    ours = float(np.linalg.norm(np.asarray(quantized.dequantize()) - matrix) / np.linalg.norm(matrix))
    theirs = _q4_0_error(matrix)
    assert ours <= theirs, (ours, theirs)
    if weights == "normal":
        assert ours < 0.1  # a step of ~2.2 sigma / 7.5 for 32 Gaussian entries: ~8.5% of sigma


def _float32_rounding_bound(x: np.ndarray, matrix: Int4Matrix) -> np.ndarray:
    """The worst-case error of XLA's float32 sum of the products (the kernel's is exact): D additions x 2^-24 x the
    sum of their magnitudes, and the two scalings' roundings. [M, K]."""
    x_int8, x_scale = (np.asarray(a, np.float64) for a in quantize_rows(jnp.asarray(x)))
    weights = np.abs(np.asarray(int4.integer_weights(matrix.packed_KH, matrix.block_scale_KB), np.float64))
    magnitudes = np.abs(x_int8) @ weights.T * np.asarray(matrix.output_scale_K)[None, :] * x_scale[:, None]
    return (x.shape[1] + 4) * 2.0**-24 * magnitudes


SHAPES = [(37, 100), (130, 64), (64, 33), (2304, 768), (768, 3072), (256, 20000)]
QUICK_SHAPES = [(37, 100)]  # the quick tier's: inputs padded to a pair of blocks, outputs no tile divides
QUICK_ROWS = (1, 6, 7, 16)  # its row counts: each of the kernel's tiles (1 row; 4 and 2; 4 and 3; four of 4)


@pytest.mark.parametrize("K, D", some_quick(SHAPES, quick=QUICK_SHAPES))
def test_the_kernel_is_xlas_product_to_float32_rounding(kernel_isa, K, D):
    # 20,000 inputs: block scales kept under 127 so that a row's integer sum fits in int32.
    rng = np.random.default_rng(K + D)
    matrix = Int4Matrix.quantize(jnp.asarray(rng.normal(0, 0.02, (K, D)), jnp.float32))
    padded = 2 * matrix.packed_KH.shape[1]
    x = np.zeros((MAX_KERNEL_ROWS, padded), np.float32)
    x[:, :D] = rng.standard_normal((MAX_KERNEL_ROWS, D))
    x[3] = 0  # a row of zeros: its scale is 1, its products 0
    x[5, :D] *= 1e4  # a large row: its scale, not its values, grows
    kernel, xla = jax.jit(kernel_int4_product), jax.jit(xla_int4_product)
    operands = (matrix.packed_KH, matrix.block_scale_KB, matrix.output_scale_K)
    for M in QUICK_ROWS if (K, D) in QUICK_SHAPES else range(1, MAX_KERNEL_ROWS + 1):  # every count in the full tier
        got = np.asarray(kernel(x[:M], *operands, matrix.sums_K))
        want = np.asarray(xla(x[:M], *operands))
        assert got.dtype == np.float32
        difference = np.abs(got.astype(np.float64) - want)
        assert (difference <= _float32_rounding_bound(x[:M], matrix)).all(), (kernel_isa, M, difference.max())


@pytest.mark.slow  # a further case of the kernel's check, at a real matrix's size
def test_products_stay_within_the_quantization_bound_of_the_float64_product(kernel_isa):
    # int4 weights (~8.5% of sigma a weight) and int8 rows (~1%): the product's relative error near 9%.
    rng = np.random.default_rng(1)
    matrix = rng.normal(0, 0.02, (2304, 768))
    quantized = Int4Matrix.quantize(jnp.asarray(matrix, jnp.float32))
    for M in (1, 5, 16, 40):  # 40 rows: XLA's product (a prefill's), the rest the kernel's
        x = rng.normal(size=(M, 768))
        exact = x @ matrix.T
        got = np.asarray(jax.jit(quantized.matmul)(jnp.asarray(x, jnp.float32)), np.float64)
        assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 0.1, (kernel_isa, M)


def _tiny(**changes) -> GPT:
    return GPT(GPTConfig.preset("tiny", **{"n_embd": 64, "block_size": 128, **changes}), rngs=nnx.Rngs(0))


@functools.partial(jax.jit, static_argnames="config")
def _logits(config, weights):
    tokens = jnp.asarray([list(range(1, 60))], jnp.int32)
    return lm_head(weights, forward(config, weights, tokens, jnp.arange(59)[None])[0])


@pytest.mark.parametrize("tied_head", some_quick([True, False], quick=[True]))
def test_logits_stay_close_to_float32(tied_head):
    # A random tiny model: the logits' max abs difference relative to their spread. int4 blocks (the head int8):
    # about twice int8's error (tests/test_quantize.py's bound 0.05, for int8 everywhere).
    model = _tiny(tied_head=tied_head)
    reference = _logits(model.config, model.weights())
    got = _logits(model.config, decoding_weights(model, "int4"))
    assert float(jnp.abs(got - reference).max()) < 0.1 * float(reference.max() - reference.min())


def test_without_the_kernels_the_tokens_are_the_same(monkeypatch):
    # XLA's product where the kernels do not run (not built, a GPU or TPU, GPT_CPU_KERNELS=0): the same numbers to
    # float32's rounding, so the same greedy tokens.
    model = _tiny()
    nnx.update(model, jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, nnx.state(model, nnx.Param)))
    prompts = [[5, 17, 99], list(range(30, 43))]
    with_kernel = generate(model, prompts, 16, sampling=GREEDY, quantize="int4")
    monkeypatch.setattr(cpu_kernels, "isa", lambda: None)
    assert generate(model, prompts, 16, sampling=GREEDY, quantize="int4") == with_kernel


def test_an_int4_target_does_not_draft_for_itself_in_int8():
    with pytest.raises(ConfigError, match="draft int8 needs the target's weights in float .*, not int4"):
        Engine(_tiny(), slots=2, cache_length=32, quantize="int4", draft="int8")
