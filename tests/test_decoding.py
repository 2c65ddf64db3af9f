"""The engine's device verbs' pieces on their own: a prefill's prompt scores against numpy."""

import jax
import numpy as np
from flax import nnx

from gpt import GPT, GPTConfig
from gpt.inference import decoder
from gpt.inference.decoder import Decoder, decoding_weights
from gpt.inference.decoding import score_prompt
from gpt.inference.sampling import TOP_LOGPROBS
from gpt.model.backend import choices


def test_prompt_scores_taken_a_block_of_positions_at_a_time_are_the_log_softmax():
    """More positions than one block (`score_rows` on a CPU: the last block padded) score as float64 numpy's
    log-softmax of the same logits: each target's logprob, and the top alternatives in order."""
    model = GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))
    weights = Decoder.of(model).weights
    b, P = 2, 100
    assert b * P > choices().score_rows, "the positions must span more than one block"
    rng = np.random.default_rng(0)
    x_bPD = rng.normal(size=(b, P, model.config.n_embd)).astype(np.float32) * 3
    targets_bP = rng.integers(0, model.config.vocab_size, (b, P)).astype(np.int32)
    scores = jax.jit(score_prompt)(weights, x_bPD, targets_bP, np.array([True, True]), np.array([True, False]))

    logits_bPV = x_bPD.astype(np.float64) @ np.asarray(model.wte[...], np.float64).T
    log_softmax = logits_bPV - np.log(np.exp(logits_bPV - logits_bPV.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits_bPV.max(-1, keepdims=True)
    want = np.take_along_axis(log_softmax, targets_bP[..., None], -1)[..., 0]
    np.testing.assert_allclose(scores.logprob, want, rtol=1e-5, atol=1e-5)
    top_ids = np.argsort(-log_softmax[0], axis=-1)[:, :TOP_LOGPROBS]
    np.testing.assert_array_equal(scores.top_ids[0], top_ids)
    np.testing.assert_allclose(scores.top_logprobs[0], np.take_along_axis(log_softmax[0], top_ids, -1),
                               rtol=1e-5, atol=1e-5)


def test_laying_out_a_deeper_model_compiles_one_program_per_kind_of_matrix():
    """The decoding layout runs one small program per kind of matrix with the layer as an operand, so that
    its compiles do not grow with depth (one program over every layer's matrices took GPT-2 124M's int8
    layout 1.7 s to compile)."""

    model = GPT(GPTConfig.preset("tiny", n_layer=5, n_embd=40, n_head=4), rngs=nnx.Rngs(0))
    before = decoder._kernel_layout._cache_size()
    weights = decoding_weights(model, "int8")
    assert decoder._kernel_layout._cache_size() - before == 4  # qkv, out, fc, proj: not 4 x 5
    kernel = model.blocks.fc_kernel[...][3]
    np.testing.assert_allclose(weights.layers[3]["fc_kernel"].dequantize(), kernel.T,
                               atol=float(np.abs(kernel).max()) / 127)
