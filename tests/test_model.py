"""The model's shape, size, causality and config validation."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gpt import GPT, GPTConfig, KVCache
from gpt.errors import ConfigError
from gpt.model.transformer import embed, lm_head, num_params, standard_normal, transform

from conftest import some_quick

POSITIONS = ("learned", "sinusoidal", "rope")


def test_gpt2_preset_has_124m_parameters():
    config = GPTConfig.preset("gpt2")
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    counted = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert counted == num_params(config) == 124_439_808


def test_an_eager_call_of_a_new_shape_compiles_one_program(caplog):
    """A model called at a prompt, in a notebook or a test compiles one program per new shape: its default
    positions, the forward, the head and the id check do not each compile their own small ones."""
    model = GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))
    model(np.ones((1, 5), np.int32))  # the weights' own first uses compile whatever they compile
    cache, tokens = KVCache.init(model.config, 3, 16), jnp.full((3, 9), 4, jnp.int32)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        caplog.clear()
        model(np.ones((2, 11), np.int32))
        model(tokens, cache=cache)
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Finished XLA compilation")]
    assert len(compiled) == 2 and all("_compiled_logits" in m for m in compiled), compiled


def test_an_eager_loss_compiles_once_per_shape(caplog):
    """`GPT.loss` called again at the same shape (a validation loop over windows) compiles nothing more."""
    model = GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))
    tokens = np.ones((2, 11), np.int32)
    first = float(model.loss(tokens, tokens))
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        caplog.clear()
        again = [float(model.loss(tokens, tokens)) for _ in range(3)]
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Finished XLA compilation")]
    assert not compiled and again == [first] * 3


@pytest.mark.parametrize("position", POSITIONS)
def test_forward_shapes_and_dtypes(position):
    config = GPTConfig.preset("tiny", position=position)
    model = GPT(config, rngs=nnx.Rngs(0))
    logits = model(jnp.zeros((3, 7), jnp.int32))
    assert logits.shape == (3, 7, config.vocab_size) and logits.dtype == jnp.float32
    assert bool(jnp.isfinite(logits).all())


@pytest.mark.parametrize("position", some_quick(POSITIONS, quick=["rope"]))  # rope: positions inside attention
def test_loss_at_t_has_no_gradient_from_later_tokens(position):
    config = GPTConfig.preset("tiny", position=position)
    model = GPT(config, rngs=nnx.Rngs(0))
    T, t = 16, 6
    tokens = jax.random.randint(jax.random.key(1), (2, T), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(T), (2, T))
    weights = model.weights()
    embeddings = embed(config, weights, tokens, positions)

    def loss_at_t(x):
        hidden, _ = transform(config, weights, x, positions)
        logits = lm_head(weights, hidden)
        return -jax.nn.log_softmax(logits[:, t])[jnp.arange(2), tokens[:, t + 1]].sum()

    grad = np.asarray(jax.jit(jax.grad(loss_at_t))(embeddings))  # one program, not one per operation
    assert np.all(grad[:, t + 1 :] == 0.0)
    assert np.all(np.abs(grad[:, : t + 1]).sum(-1) > 0)  # and the past does matter


def test_bf16_compute_with_float32_params():
    config = GPTConfig.preset("tiny", dtype="bfloat16", param_dtype="float32")
    model = GPT(config, rngs=nnx.Rngs(0))
    assert model.wte[...].dtype == jnp.float32
    reference = GPT(config.replace(dtype="float32"), rngs=nnx.Rngs(0))
    tokens = jnp.arange(20, dtype=jnp.int32).reshape(2, 10)
    low, high = model(tokens), reference(tokens)
    assert low.dtype == jnp.float32
    assert float(jnp.abs(low - high).max()) < 0.05 * float(jnp.abs(high).max())


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(n_embd=30, n_head=4), "n_embd=30 must be divisible by GPTConfig.n_head=4"),
        (dict(n_embd=36, n_head=4, position="rope"), "even head_dim"),
        (dict(position="alibi"), "GPTConfig.position must be"),
        (dict(n_layer=0), "GPTConfig.n_layer must be a positive integer"),
        (dict(dropout=1.5), "GPTConfig.dropout must be in [0, 1)"),
        (dict(dtype="float8"), "GPTConfig.dtype must be one of"),
        (dict(rope_theta=float("nan")), "GPTConfig.rope_theta must be positive and finite, got nan"),
        (dict(layer_norm_epsilon=float("inf")), "GPTConfig.layer_norm_epsilon must be positive and finite, got inf"),
        (dict(activation="swish"), "GPTConfig.activation must be 'gelu', 'relu2' or 'silu', got 'swish'"),
        (dict(norm="batchnorm"), "GPTConfig.norm must be 'layernorm' or 'rmsnorm', got 'batchnorm'"),
        (dict(mlp_width=0), "GPTConfig.mlp_width must be a positive integer or None, got 0"),
        (dict(gated_mlp=[False]), "GPTConfig.gated_mlp must be true or false, got [False]"),  # a truthy list had
        (dict(bias="false"), "GPTConfig.bias must be true or false, got 'false'"),  # built another model's shape
    ],
)
def test_invalid_config_names_the_field(fields, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        GPTConfig(**fields)


@pytest.mark.parametrize("tokens, message", [
    (jnp.array([[1, 256]]), r"token id 256 is outside the vocabulary \[0, 256\)"),  # a gather had clamped it
    (np.array([[-1, 2]]), r"token id -1 is outside the vocabulary"),
    (jnp.ones((1, 65), jnp.int32), "65 tokens are more than the model's context of 64"),  # learned positions clamped
    (jnp.array([1, 2, 3]), r"tokens must be integer ids \[B, T\], got shape \(3,\)"),
    (jnp.array([[1.0, 2.0]]), "got shape .1, 2. and dtype float32"),
])
def test_the_forward_refuses_what_it_would_silently_clamp(tokens, message):
    model = GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match=message):
        model(tokens)
    assert model([[1, 2]]).shape == (1, 2, 256)  # nested lists are ids too


def test_ids_closed_over_by_a_jitted_function_are_checked_and_run():
    # Under jit, the check's min and max of concrete ids would be traced (no values to compare) unless
    # evaluated at once; ids that arrive as arguments are traced and go unchecked.
    graphdef, params = nnx.split(GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0)))
    good, bad = jnp.array([[1, 2, 3]]), jnp.array([[1, 256]])
    logits = jax.jit(lambda params: nnx.merge(graphdef, params)(good))(params)
    passed = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))(params, good)
    np.testing.assert_array_equal(logits, passed)
    with pytest.raises(ConfigError, match=r"token id 256 is outside the vocabulary"):
        jax.jit(lambda params: nnx.merge(graphdef, params)(bad))(params)


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_init_draws_the_values_jax_random_normal_draws(dtype):
    # The init draws flat and reshapes (a faster compile): the values must be those drawn in the shape.
    key = jax.random.key(3)
    for shape in [(2, 32, 3, 4, 8), (256, 32), (2, 4, 8, 32), (7,)]:
        np.testing.assert_array_equal(standard_normal(key, shape, dtype), jax.random.normal(key, shape, dtype))


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError, match="unknown GPTConfig preset 'gpt3'.*gpt2-medium"):
        GPTConfig.preset("gpt3")


def test_presets_have_openai_shapes():
    shapes = {name: (c.n_layer, c.n_head, c.n_embd) for name, c in
              ((n, GPTConfig.preset(n)) for n in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"))}
    assert shapes == {"gpt2": (12, 12, 768), "gpt2-medium": (24, 16, 1024),
                      "gpt2-large": (36, 20, 1280), "gpt2-xl": (48, 25, 1600)}


def plain_forward(config: GPTConfig, p: dict, tokens: np.ndarray) -> np.ndarray:
    """The logits of a model with rotary positions, relu(x)^2, an untied head, no biases and optionally
    QK-norm and fewer key heads than query heads, in float64 numpy, one operation at a time: the reference for
    those pieces."""
    def norm(x, scale=None):
        x = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + config.layer_norm_epsilon)
        return x * scale

    def rms(x, scale):
        return x / np.sqrt((x**2).mean(-1, keepdims=True) + config.layer_norm_epsilon) * scale

    def rotate(x):  # x [T, N, H]: channel i pairs with i + H/2, turned by position x theta^(-i / (H/2))
        half = x.shape[-1] // 2
        angle = np.arange(x.shape[0])[:, None, None] * config.rope_theta ** (-np.arange(half) / half)
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * np.cos(angle) - b * np.sin(angle), b * np.cos(angle) + a * np.sin(angle)], -1)

    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    blocks, (T,) = p["blocks"], tokens.shape
    x = p["wte"][tokens]
    for layer in range(config.n_layer):
        h = norm(x, blocks["ln1_scale"][layer])
        q = np.einsum("td,dnh->tnh", h, blocks["q_kernel"][layer])
        # Each key head serves n_head / kv_heads consecutive query heads (Llama's repeat_kv).
        k, v = (np.repeat(np.einsum("td,dkh->tkh", h, blocks["kv_kernel"][layer][:, i]),
                          config.n_head // config.kv_heads, axis=1) for i in range(2))
        if config.qk_norm:
            q, k = rms(q, blocks["q_norm_scale"][layer]), rms(k, blocks["k_norm_scale"][layer])
        q, k = rotate(q), rotate(k)
        scores = np.einsum("tnh,snh->nts", q, k) / np.sqrt(config.head_dim)
        scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
        attention = np.exp(scores - scores.max(-1, keepdims=True))
        attention /= attention.sum(-1, keepdims=True)
        x = x + np.einsum("nts,snh,nhd->td", attention, v, blocks["out_kernel"][layer])
        hidden = norm(x, blocks["ln2_scale"][layer]) @ blocks["fc_kernel"][layer]
        x = x + np.maximum(hidden, 0) ** 2 @ blocks["proj_kernel"][layer]  # relu(x)^2
    return norm(x, p["lnf_scale"]) @ p["lm_head"].T


@pytest.mark.parametrize("qk_norm, n_kv_head, head_size", [(True, None, None), (False, None, None), (True, 2, 12),
                                                           (False, 1, None)])
def test_the_modern_pieces_equal_a_plain_implementation(qk_norm, n_kv_head, head_size):
    config = GPTConfig.preset("tiny", position="rope", qk_norm=qk_norm, activation="relu2", tied_head=False,
                              bias=False, n_kv_head=n_kv_head, head_size=head_size)
    model = GPT(config, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model))
    # Scaled up, so that attention is far from uniform and QK-norm changes it; the norms' scales away from 1.
    rng = np.random.default_rng(1)
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: a * 8.0 if a.ndim >= 3 else rng.uniform(0.5, 1.5, a.shape).astype(a.dtype)
        if str(path[-1].key).endswith("scale") else a, params)
    nnx.update(model, params)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, 24)
    want = plain_forward(config, params, tokens)
    got = np.asarray(model(jnp.asarray(tokens[None], jnp.int32)))[0]
    np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max(), rtol=0)
    assert set(params) == {"wte", "blocks", "lnf_scale", "lm_head"}  # no biases, no position table
    assert num_params(config) == sum(a.size for a in jax.tree.leaves(params))


def _loss_and_grad(config: GPTConfig, tokens, key=None):
    graphdef, state = nnx.split(GPT(config, rngs=nnx.Rngs(0)))

    def loss(state, tokens):
        return nnx.merge(graphdef, state).loss(tokens[:, :-1], tokens[:, 1:], dropout_key=key)

    step = jax.jit(jax.value_and_grad(loss))
    return step(state, tokens), step.lower(state, tokens).compile().memory_analysis().temp_size_in_bytes


REMAT_MODEL = dict(n_layer=4, n_head=4, n_embd=64, block_size=128, vocab_size=256)


@pytest.mark.parametrize("dropout, scan_layers", [
    pytest.param(0.0, False, marks=pytest.mark.slow), (0.0, True), pytest.param(0.1, False, marks=pytest.mark.slow),
    pytest.param(0.1, True, marks=pytest.mark.slow)])
def test_remat_gives_the_same_loss_and_gradients(scan_layers, dropout):
    tokens = jax.random.randint(jax.random.key(1), (4, 129), 0, 256)
    key = jax.random.key(2) if dropout else None
    config = GPTConfig.preset("small", **REMAT_MODEL, dropout=dropout, scan_layers=scan_layers)
    (loss, grads), _ = _loss_and_grad(config, tokens, key)
    (remat_loss, remat_grads), _ = _loss_and_grad(config.replace(remat=True), tokens, key)
    assert remat_loss == loss
    for got, want in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(grads)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("scan_layers", [pytest.param(False, marks=pytest.mark.slow), True])
def test_remat_keeps_a_fraction_of_the_activations_scanned_or_unrolled(scan_layers):
    """XLA's peak memory for the step's buffers: remat keeps each block's input and recomputes the rest
    in the backward pass (unrolled as well as scanned: XLA would otherwise hoist the recomputation back
    into the forward, and keep everything)."""
    tokens = jnp.zeros((8, 129), jnp.int32)
    config = GPTConfig.preset("small", **REMAT_MODEL, scan_layers=scan_layers)
    _, kept = _loss_and_grad(config, tokens)
    _, recomputed = _loss_and_grad(config.replace(remat=True), tokens)
    assert recomputed < 0.5 * kept, (recomputed, kept)
