"""The CPU-or-GPU choices are one table: each place that differs by backend reads `gpt.model.backend`, so
that the GPU's row, put in force on a CPU, changes every one of them (and the CPU's row is what runs)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from gpt.errors import ConfigError
from gpt.inference import decoding, shapes
from gpt.model import attention, backend, cpu_kernels, few_rows, loss
from gpt.model.config import GPTConfig


def test_the_cpu_row_is_in_force_here():
    assert jax.default_backend() == "cpu" and backend.choices() is backend.CHOICES["cpu"]
    with jax.set_mesh(jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])):
        assert backend.choices() is backend.CHOICES["cpu"]


def test_the_row_is_the_active_meshs_platforms(monkeypatch):
    # A program compiled for a TPU topology on this CPU takes the TPU's row: its mesh says what it is for.
    class Device:
        platform = "tpu"

    class Mesh:
        empty, abstract_device = False, Device()

    monkeypatch.setattr(jax.sharding, "get_abstract_mesh", lambda: Mesh())
    assert backend.choices() is backend.CHOICES["tpu"]
    Device.platform = "something new"
    assert backend.choices().attention == "plain" and backend.choices().decode_chunk == backend.CHOICES["gpu"].decode_chunk


@pytest.mark.parametrize("row", ["cpu", "gpu", "tpu"])
def test_each_choice_follows_the_table(monkeypatch, row):
    chosen = backend.CHOICES[row]
    for module in (attention, cpu_kernels, few_rows, loss, decoding, shapes):
        monkeypatch.setattr(module, "choices", lambda: chosen)

    assert shapes.decode_widths(8, None) == ([1, 2, 4, 8] if chosen.narrow_decodes else [8])
    cache = decoding.init_slots(GPTConfig.preset("tiny", block_size=512), 2, 300, 1).cache
    assert [page.shape[1] for page in cache.pages(0)[0]] == ([128, 128, 44] if chosen.kv_page_length else [300])
    four_rows = jnp.ones((4, 8), jnp.float32), jnp.ones((3, 8), jnp.float32)
    kernel_built = cpu_kernels._library() is not None
    traced = lambda fn: str(jax.make_jaxpr(lambda x, w: fn(x, w))(*four_rows))  # noqa: E731 (a new trace each)
    assert ("ffi_call" in traced(few_rows.product)) == (chosen.cpu_kernels and kernel_built)
    assert ("dot_general" in traced(few_rows.xla_product)) != chosen.few_rows_matmul

    lengths = []
    monkeypatch.setattr(loss, "_chunked_loss", lambda x, table, targets, length, *_: lengths.append(length))
    loss.lm_head_cross_entropy(jnp.zeros((1, 4096, 8)), jnp.zeros((50304, 8)), jnp.zeros((1, 4096), jnp.int32))
    assert lengths == [loss._chunk_length(4096, chosen.loss_chunk_bytes // (50304 * 4))]
    assert (lengths[0] < 4096) == (row != "gpu")  # in chunks on a CPU and a TPU, whole on a GPU

    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *args, **kwargs: "fused")  # cuDNN's: not on a CPU
    monkeypatch.setattr(attention, "splash_causal", lambda *args: "splash")  # a TPU's kernel: not here either
    out = attention.attend(jnp.ones((1, 128, 2, 4)), jnp.ones((2, 128, 4)), jnp.ones((2, 128, 4)), None)
    assert (out if isinstance(out, str) else "plain") == {"dot_product": "fused"}.get(chosen.attention, chosen.attention)


def test_the_gpu_row_asks_for_cudnns_kernel_at_16_bit_and_falls_back_to_xlas(monkeypatch):
    # jax.nn.dot_product_attention runs XLA's attention unless cuDNN is named: the GPU row must name it for
    # 16-bit operands (never for float32, which cuDNN's kernel lacks), and take XLA's where cuDNN refuses
    # the call at trace time (an older GPU, a head size it lacks: here, float16 stands for one).
    monkeypatch.setattr(attention, "choices", lambda: backend.CHOICES["gpu"])
    asked = []

    def dot_product_attention(q, k, v, is_causal, implementation):
        asked.append(implementation)
        if implementation == "cudnn" and q.dtype != jnp.bfloat16:
            raise RuntimeError("cuDNN takes 16-bit operands")  # what a refusal looks like
        return q

    monkeypatch.setattr(jax.nn, "dot_product_attention", dot_product_attention)
    for dtype in (jnp.bfloat16, jnp.float32):
        q, kv = jnp.ones((1, 3, 2, 4), dtype), jnp.ones((2, 3, 4), dtype)
        attention.attend(q, kv, kv, None)
    assert asked == ["cudnn", "xla"]
    asked.clear()
    attention.fused_causal(*(jnp.ones((1, 3, 2, 4), jnp.float16),) * 3)  # refused: falls back
    assert asked == ["cudnn", "xla"]


def test_a_process_can_change_cells_of_its_row_and_a_bad_change_is_one_line(monkeypatch):
    # `GPT_BACKEND_CHOICES`: how bench/gpu_bench.py's variants change the row, each in its own process.
    monkeypatch.setenv(backend.OVERRIDE_ENV, '{"head_logits": "compute", "kv_page_length": null}')
    chosen = backend.choices()
    assert chosen.head_logits == "compute" and chosen.kv_page_length is None
    assert dataclasses.replace(chosen, head_logits="float32", kv_page_length=128) == backend.CHOICES["cpu"]
    for text, says in [("{", "must be a JSON object"), ("[1]", "must be a JSON object"),
                       ('{"fast": true}', "names 'fast', not a backend choice"),
                       ('{"head_logits": "float16"}', "head_logits cannot be 'float16'"),
                       ('{"params_cast_once": 1}', "params_cast_once cannot be 1"),
                       ('{"narrow_decodes": null}', "narrow_decodes cannot be None")]:
        monkeypatch.setenv(backend.OVERRIDE_ENV, text)
        with pytest.raises(ConfigError, match=re.escape(says)) as error:
            backend.choices()
        assert "\n" not in str(error.value) and backend.OVERRIDE_ENV in str(error.value)
