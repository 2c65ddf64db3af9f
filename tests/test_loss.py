"""The chunked LM-head cross-entropy against optax on materialized logits, and the model's loss."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gpt import GPT, GPTConfig
from gpt.model import backend
from gpt.model.loss import _chunk_length, lm_head_cross_entropy

from conftest import some_quick
from jaxprs import walk


def reference_loss(x_BTD, table_VD, targets_BT):
    logits = jnp.einsum("BTD,VD->BTV", x_BTD, table_VD, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets_BT).mean()


B, T, D, V = 3, 37, 16, 101


@pytest.mark.parametrize("positions_per_chunk", some_quick([1, 5, 8, 37], quick=[5, 37]))  # 5 and 8 pad T=37; 37 is one chunk
def test_value_and_gradients_equal_the_materialized_logits(positions_per_chunk):
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    table = jax.random.normal(jax.random.key(1), (V, D))
    targets = jax.random.randint(jax.random.key(2), (B, T), 0, V)
    chunk_bytes = positions_per_chunk * B * V * 4
    assert _chunk_length(T, positions_per_chunk) == positions_per_chunk

    def chunked(x, table):
        return lm_head_cross_entropy(x, table, targets, chunk_bytes=chunk_bytes)

    loss, (dx, dtable) = jax.jit(jax.value_and_grad(chunked, (0, 1)))(x, table)
    ref_loss, (ref_dx, ref_dtable) = jax.value_and_grad(reference_loss, (0, 1))(x, table, targets)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(chunked)(x, table), ref_loss, rtol=1e-6)  # the forward alone
    np.testing.assert_allclose(dx, ref_dx, atol=1e-7)
    np.testing.assert_allclose(dtable, ref_dtable, atol=1e-7)
    # The cotangent scales the gradients computed in the forward pass.
    scaled = jax.grad(lambda x, table: -2.5 * chunked(x, table), (0, 1))(x, table)
    np.testing.assert_allclose(scaled[0], -2.5 * ref_dx, atol=1e-6)
    np.testing.assert_allclose(scaled[1], -2.5 * ref_dtable, atol=1e-6)


@pytest.mark.parametrize("positions_per_chunk", [5, 37])
def test_label_smoothing_equals_optax_smoothed_labels(positions_per_chunk):
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    table = jax.random.normal(jax.random.key(1), (V, D))
    targets = jax.random.randint(jax.random.key(2), (B, T), 0, V)

    def chunked(x, table):
        return lm_head_cross_entropy(x, table, targets, chunk_bytes=positions_per_chunk * B * V * 4,
                                     label_smoothing=0.1)

    def reference(x, table):
        logits = jnp.einsum("BTD,VD->BTV", x, table, preferred_element_type=jnp.float32)
        return optax.softmax_cross_entropy(logits, optax.smooth_labels(jax.nn.one_hot(targets, V), 0.1)).mean()

    loss, (dx, dtable) = jax.jit(jax.value_and_grad(chunked, (0, 1)))(x, table)
    ref_loss, (ref_dx, ref_dtable) = jax.value_and_grad(reference, (0, 1))(x, table)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(dx, ref_dx, atol=1e-7)
    np.testing.assert_allclose(dtable, ref_dtable, atol=1e-7)


def test_bfloat16_inputs_give_bfloat16_gradients_close_to_float32():
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    table = jax.random.normal(jax.random.key(1), (V, D)) * 0.3
    targets = jax.random.randint(jax.random.key(2), (B, T), 0, V)
    loss, (dx, dtable) = jax.value_and_grad(lm_head_cross_entropy, (0, 1))(
        x.astype(jnp.bfloat16), table.astype(jnp.bfloat16), targets)
    ref_loss, (ref_dx, ref_dtable) = jax.value_and_grad(reference_loss, (0, 1))(x, table, targets)
    assert loss.dtype == jnp.float32 and dx.dtype == dtable.dtype == jnp.bfloat16
    # bfloat16 keeps 8 bits of mantissa: the inputs' rounding alone moves the logits by ~1%.
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
    np.testing.assert_allclose(dx.astype(jnp.float32), ref_dx, atol=2e-2 * float(jnp.abs(ref_dx).max()))
    np.testing.assert_allclose(dtable.astype(jnp.float32), ref_dtable, atol=2e-2 * float(jnp.abs(ref_dtable).max()))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_a_padded_head_gives_the_unpadded_loss_and_gradients(monkeypatch, smoothing):
    # The backend's `head_rows_multiple`: the product runs over 128 rows (27 of them zeros), and the padded
    # logits count neither in the softmax nor in the smoothed targets; the table's gradient keeps V rows.
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    table = jax.random.normal(jax.random.key(1), (V, D))
    targets = jax.random.randint(jax.random.key(2), (B, T), 0, V)

    def loss_and_grads():
        chunked = lambda x, table: lm_head_cross_entropy(x, table, targets, chunk_bytes=5 * B * V * 4,  # noqa: E731
                                                         label_smoothing=smoothing)
        return jax.jit(jax.value_and_grad(chunked, (0, 1)))(x, table), head_product_widths(chunked, x, table)

    (loss, (dx, dtable)), widths = loss_and_grads()
    monkeypatch.setenv(backend.OVERRIDE_ENV, '{"head_rows_multiple": 128}')
    (padded_loss, (padded_dx, padded_dtable)), padded_widths = loss_and_grads()
    assert widths == {V} and padded_widths == {128}
    assert padded_dtable.shape == (V, D)
    np.testing.assert_allclose(padded_loss, loss, rtol=1e-6)
    np.testing.assert_allclose(padded_dx, dx, atol=1e-7)
    np.testing.assert_allclose(padded_dtable, dtable, atol=1e-7)


def head_product_widths(loss, x, table) -> set[int]:
    """The widths of the logits [M, P] that the head's products (x [M, D] by the table [P, D]) write in the
    program of `loss`'s gradient."""
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, table).jaxpr
    return {eqn.outvars[0].aval.shape[-1] for eqn in walk(jaxpr) if eqn.primitive.name == "dot_general"
            and eqn.params["dimension_numbers"][0] == ((1,), (1,)) and eqn.outvars[0].aval.ndim == 2}


def test_bfloat16_logits_stay_within_their_rounding_of_float32_logits(monkeypatch):
    # The backend's `head_logits="compute"`: the product writes bfloat16 logits; each moves by at most 2^-8 of
    # the largest, so the loss (a logsumexp minus a logit) by at most twice that.
    x = jax.random.normal(jax.random.key(0), (B, T, D)).astype(jnp.bfloat16)
    table = (jax.random.normal(jax.random.key(1), (V, D)) * 0.3).astype(jnp.bfloat16)
    targets = jax.random.randint(jax.random.key(2), (B, T), 0, V)
    chunked = lambda x, table: lm_head_cross_entropy(x, table, targets)  # noqa: E731
    loss, (dx, dtable) = jax.jit(jax.value_and_grad(chunked, (0, 1)))(x, table)
    monkeypatch.setenv(backend.OVERRIDE_ENV, '{"head_logits": "compute"}')
    assert "preferred_element_type=bfloat16" in str(jax.make_jaxpr(jax.grad(chunked, (0, 1)))(x, table))
    low_loss, (low_dx, low_dtable) = jax.jit(jax.value_and_grad(chunked, (0, 1)))(x, table)
    largest_logit = float(jnp.abs(jnp.einsum("BTD,VD->BTV", x, table, preferred_element_type=jnp.float32)).max())
    assert loss != low_loss  # the logits were rounded
    assert abs(float(low_loss) - float(loss)) <= 2 * largest_logit * 2**-8
    for low, ref in ((low_dx, dx), (low_dtable, dtable)):
        assert low.dtype == jnp.bfloat16
        np.testing.assert_allclose(low.astype(jnp.float32), ref.astype(jnp.float32),
                                   atol=2e-2 * float(jnp.abs(ref.astype(jnp.float32)).max()))


def test_chunk_length_prefers_an_exact_split():
    assert _chunk_length(256, 83) == 64  # 4 chunks of 64, no padding
    assert _chunk_length(256, 41) == 32  # 7 would pad; 8 divides
    assert _chunk_length(256, 1000) == 256
    assert _chunk_length(37, 8) == 8  # 37 is prime: 5 chunks of 8, 3 positions of padding
    assert _chunk_length(10, 0) == 1


@pytest.mark.parametrize("scan_layers", [pytest.param(False, marks=pytest.mark.slow), True])
def test_model_loss_and_gradients_equal_the_logits_cross_entropy(scan_layers):
    config = GPTConfig.preset("tiny", scan_layers=scan_layers)
    model = GPT(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, config.vocab_size)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def fused(params):
        return nnx.merge(graphdef, params).loss(inputs, targets)

    def plain(params):
        logits = nnx.merge(graphdef, params)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = jax.jit(jax.value_and_grad(fused))(params)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(plain))(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for (path, g), ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, ref, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_scanned_and_unrolled_layers_agree():
    configs = [GPTConfig.preset("tiny", scan_layers=flag) for flag in (False, True)]
    unrolled, scanned = (GPT(config, rngs=nnx.Rngs(0)) for config in configs)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, configs[0].vocab_size)
    np.testing.assert_allclose(unrolled(tokens), scanned(tokens), atol=1e-5)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_table_gradient_is_reduced_across_devices_once_not_per_chunk():
    from gpt.model.sharding import make_mesh

    mesh = make_mesh(data=8)
    x = jax.random.normal(jax.random.key(0), (8, T, D))
    table = jax.random.normal(jax.random.key(1), (V, D))
    targets = jax.random.randint(jax.random.key(2), (8, T), 0, V)
    grad = jax.jit(jax.grad(lambda x, table: lm_head_cross_entropy(x, table, targets, chunk_bytes=5 * V * 4), (0, 1)))
    with jax.set_mesh(mesh):
        x = jax.device_put(x, jax.NamedSharding(mesh, jax.P("data")))
        hlo = grad.lower(x, table).compile().as_text()
        dx, dtable = grad(x, table)
    loop_bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    assert loop_bodies, "the chunks should run in a loop"
    computations = {block.split(" ", 1)[0].lstrip("%"): block for block in re.split(r"\n(?=%|ENTRY)", hlo)}
    for name in loop_bodies:
        assert "all-reduce" not in computations[name], f"a cross-device reduction inside the chunk loop {name}"
    assert "all-reduce" in hlo  # the one after the loop
    ref_dx, ref_dtable = jax.grad(reference_loss, (0, 1))(np.asarray(x), table, targets)
    np.testing.assert_allclose(dtable, ref_dtable, atol=1e-6)
    np.testing.assert_allclose(dx, ref_dx, atol=1e-7)
