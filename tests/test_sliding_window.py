"""Sliding-window attention (a layer's queries see only the last `sliding_window` positions): Mistral's on every
layer, Qwen2's on some and Gemma 3's (two local layers to a global one, with its sandwich norms, RMSNorms of
1 + scale, scaled embeddings, query scale and two rotary bases) load at transformers' logits, decode its greedy
tokens with prompts longer than the window, and give the same tokens in chunks as in one prefill (their exports:
tests/test_llama.py); the window's mask is the same in training, prefill and each decode path."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from gpt import GPT, GPTConfig
from gpt.errors import ConfigError
from gpt.generate import generate
from gpt.inference.engine import Engine
from gpt.inference.request import Request
from gpt.inference.sampling import GREEDY
from gpt.model import llama
from gpt.model.kv_cache import KVCache
from gpt.model.transformer import transform

from hf_reference import LLAMA_SHAPE, hf_logits, random_hf_llama

WINDOWED = ["mistral", "qwen2-window", "gemma3"]
# The quick tier's: Gemma 3 (Mistral's window runs in the quick tier's chunked prompt).
SOME_QUICK = [pytest.param("mistral", marks=pytest.mark.slow), pytest.param("qwen2-window", marks=pytest.mark.slow),
              "gemma3"]
KINDS = {"mistral": ("l", 6), "qwen2-window": ("gl", 5), "gemma3": ("llg", 5)}  # layer_kinds, sliding_window


@pytest.mark.parametrize("family", WINDOWED)
def test_logits_match_transformers_past_the_window(tmp_path, family):
    hf_model, directory = random_hf_llama(tmp_path, family)
    model = llama.load(directory)
    assert (model.config.layer_kinds, model.config.sliding_window) == KINDS[family]
    tokens = np.random.default_rng(0).integers(0, LLAMA_SHAPE["vocab_size"], (2, 40))
    np.testing.assert_allclose(np.asarray(model(tokens)), hf_logits(hf_model, tokens), atol=1e-4, rtol=0)
    global_only = llama.load(directory).config.replace(layer_kinds="", sliding_window=None)
    unwindowed = nnx.merge(nnx.graphdef(GPT(global_only, rngs=nnx.Rngs(0))), nnx.state(model))
    assert np.abs(np.asarray(unwindowed(tokens)) - hf_logits(hf_model, tokens)).max() > 1e-2  # the window matters


@pytest.mark.parametrize("family", SOME_QUICK)
def test_greedy_generate_equals_transformers_with_prompts_longer_than_the_window(tmp_path, family):
    hf_model, directory = random_hf_llama(tmp_path, family, seed=1)
    model = llama.load(directory)
    prompts = [[5, 17, 250, 3, 9, 11, 40, 2, 99, 123, 7], [42, 8]]
    ours = generate(model, prompts, 20, sampling=GREEDY)
    for prompt, tokens in zip(prompts, ours):
        with torch.no_grad():
            theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):]
        assert tokens == theirs.tolist()
    assert generate(model, prompts, 20, sampling=GREEDY, draft="int8", draft_tokens=3) == ours  # verified a few a row


def test_a_prompt_in_chunks_past_the_window_gives_one_prefills_logprobs(tmp_path):
    """Chunks of 16 over a window of 6: each chunk's queries see the window's end of the chunk before."""
    _, directory = random_hf_llama(tmp_path, "mistral", seed=2)
    model = llama.load(directory)
    prompt = [(11 * i + 5) % 300 for i in range(45)]
    results = []
    for chunk in (16, 256):
        engine = Engine(model, slots=1, cache_length=64, prefill_chunk=chunk)
        request = engine.submit(Request(prompt, 8, GREEDY, logprobs=1))
        engine.run([request])
        results.append(request)
    assert results[0].tokens == results[1].tokens
    assert results[0].logprobs == pytest.approx(results[1].logprobs, abs=1e-4)
    logprobs_TV = jax.nn.log_softmax(model(jnp.asarray([prompt + results[0].tokens]))[0], axis=-1)
    assert results[0].logprobs == pytest.approx([float(logprobs_TV[44 + i, t]) for i, t in
                                                 enumerate(results[0].tokens)], abs=1e-4)


@pytest.mark.slow  # the quick tier keeps each family's greedy generation past its window
def test_each_layer_kind_is_its_own_mask_in_training_and_in_the_cache():
    """One model of global, local and position-less layers: the plain forward, the forward scanned over its layers
    (each layer's window and frequencies traced), a prefill and decode steps through the cache all give the same
    logits; and a local layer's output at a position does not depend on tokens beyond its window (gradients)."""
    config = GPTConfig.preset("tiny", position="rope", layer_kinds="lgn", n_layer=3, sliding_window=4,
                              rope_local_theta=100.0)
    model = GPT(config, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 20)))
    plain = np.asarray(model(tokens))
    scanned = nnx.merge(nnx.graphdef(GPT(config.replace(scan_layers=True), rngs=nnx.Rngs(0))), nnx.state(model))
    np.testing.assert_allclose(np.asarray(scanned(tokens)), plain, atol=2e-5, rtol=0)
    cached = generate(model, np.asarray(tokens[:, :12]), 8, sampling=GREEDY)
    for row in range(2):
        np.testing.assert_array_equal(cached[row][:1], np.argmax(plain[row, 11:12], -1))
    cache = KVCache.init(config, 2, 32, page_length=8)
    logits, cache = model(tokens[:, :12], cache=cache)
    steps = [logits[:, -1]]
    for t in range(12, 20):
        logits, cache = model(tokens[:, t:t + 1], cache=cache)
        steps.append(logits[:, -1])
    np.testing.assert_allclose(np.stack(steps[:-1], 1), plain[:, 11:19], atol=2e-5, rtol=0)

    local_only = config.replace(layer_kinds="l", n_layer=1)
    one = GPT(local_only, rngs=nnx.Rngs(1))

    def output_at_15(x_1TD):
        return transform(local_only, one.weights(), x_1TD, jnp.arange(20)[None])[0][0, 15].sum()

    seen = np.abs(np.asarray(jax.grad(output_at_15)(one.wte[...][tokens[:1]]))[0]).sum(-1) > 0
    np.testing.assert_array_equal(seen, (np.arange(20) > 15 - 4) & (np.arange(20) <= 15))


def test_gemma3s_older_config_fields_and_what_it_cannot_hold(tmp_path):
    """The hub's Gemma 3 files name their pattern (`sliding_window_pattern`) and local base (`rope_local_base_freq`)
    where transformers 5 writes `layer_types` and `rope_parameters`: both read alike. Soft-capped logits and a
    multimodal checkpoint are refused in one line."""
    _, directory = random_hf_llama(tmp_path, "gemma3")
    config = json.loads((directory / "config.json").read_text())
    new = llama.read_config(directory)
    older = {key: value for key, value in config.items() if key not in ("layer_types", "rope_parameters")}
    (directory / "config.json").write_text(json.dumps({**older, "sliding_window_pattern": 3, "rope_theta": 5000.0,
                                                       "rope_local_base_freq": 10000.0}))
    assert llama.read_config(directory) == new
    for change, message in [({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 .soft-capped logits. "
                                                                 "is not supported"),
                            ({"model_type": "gemma3", "text_config": config}, "model_type 'gemma3' .a multimodal "
                                                                              "checkpoint: its text model")]:
        (directory / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ConfigError, match=message) as error:
            llama.load(directory)
        assert "\n" not in str(error.value)


def test_a_window_and_its_layers_disagreeing_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="sliding_window=None and layer_kinds='gl' disagree"):
        GPTConfig.preset("tiny", position="rope", layer_kinds="gl")
    with pytest.raises(ConfigError, match="layer_kinds must be letters of g, l, n"):
        GPTConfig.preset("tiny", position="rope", layer_kinds="gx", sliding_window=4)
    with pytest.raises(ConfigError, match="no rotary positions .'n'., but position is 'learned'"):
        GPTConfig.preset("tiny", layer_kinds="n")


def test_a_local_layers_attention_flops_are_its_windows():
    """The MFU's FLOPs a token count a local layer's attention over the keys it sees: its window, not the sequence."""
    from gpt.model.transformer import flops_per_token

    windowed = GPTConfig.preset("tiny", position="rope", layer_kinds="lg", n_layer=2, sliding_window=4)
    global_only = windowed.replace(layer_kinds="", sliding_window=None)
    per_key = 12 * windowed.n_head * windowed.head_dim
    assert flops_per_token(global_only, 128) - flops_per_token(windowed, 128) == per_key * (128 - 4)
    assert flops_per_token(global_only, 3) == flops_per_token(windowed, 3)  # a sequence inside the window
