"""What the code does differently on a CPU, a GPU and a TPU, in one table (as `gpt.model.sharding.RULES` is for
mesh axes). The CPU's and GPU's choices were measured; the figures are in bench/RESULTS.md under the name given.
No TPU has run this code: its row is reasoned from the programs compiled for TPU topologies on a CPU
(`train.py --compile_only`; RESULTS, "Compiled for TPUs on a CPU"), and each cell says why.

| choice | CPU | GPU | TPU | why |
| --- | --- | --- | --- | --- |
| `attention` | `plain`: softmax(q k^T) v written out, heads as a batch axis | `dot_product`: `jax.nn.dot_product_attention` (cuDNN's fused kernel at 16-bit, `fused_causal`) | `splash`: Pallas' splash kernel for causal attention (`gpt.model.splash`), plain under a mask | XLA's CPU has no fused kernel and the plain form avoids a transposed copy of k; on a TPU the plain form writes the T x T scores to HBM: at two layers of GPT-2 its compiled step holds 0.58 GiB more temporaries and reads 18% more bytes than splash's ("Compiled for TPUs on a CPU") |
| `loss_chunk_bytes` | 128 MiB of float32 logits a chunk | 1 GiB | 256 MiB | a chunk stays in the last-level cache; on a GPU fewer, larger chunks keep the matmuls big ("Training"); on a TPU, 256 MiB holds the loss's temporaries within 0.08 GiB of 64 MiB's and 1.1 GiB under whole logits' at 8 sequences a chip, a quarter of 64 MiB's loop iterations, each product over 1,000 rows for its 128 x 128 units ("Compiled for TPUs on a CPU") |
| `cpu_kernels` | a decode step's matmuls of 1-16 int8 or float32 rows, and its attention, through compiled kernels, where built | XLA's ops | XLA's ops | XLA's CPU dots read a few rows' weights below the memory's speed; its attention over the cache is many small programs ("CPU decoding", "The decode step's small programs") |
| `few_rows_matmul` | without the kernels, 2-16 float32 rows as a multiply and a sum | a dot | a dot | XLA's CPU runs 2-16 rows as a GEMM far from the memory's speed ("Serving") |
| `score_rows` | a prompt's scores (the LM head, its logsumexp and top logprobs) 128 positions at a time | all at once | all at once | 128 rows of GPT-2's logits (26 MB) stay in the last-level cache for the reductions over them ("Scoring prompts, and sampling sooner") |
| `kv_page_length` | an engine's cache in pages of 128 slots | one page | one page | a decode step reads only the pages its rows reached ("Paged KV cache"); cuDNN, and a TPU's fused dot over the cache, read one buffer under the mask |
| `narrow_decodes` | decodes compiled for 1, 2, 4, ... rows | for every slot | for every slot | a step over 8 rows costs about twice one over 1 on a CPU, about the same on a GPU ("Serving"); a TPU's matrix units are 128 rows wide |
| `decode_chunk` | 1: a decode call's loop checks after every step whether to go on | 8 steps unrolled between checks | 1 | a GPU's while loop reads its condition back on the host at every iteration, and waits for it before the next; a CPU's does not, and gains from stopping at once (to be measured on a GPU: "The decode loop in chunks"); a TPU evaluates its loop's condition on the chip, as a CPU does (reasoned, not measured) |

| `head_rows_multiple` | 1: the LM head's rows as they are | 1 | 1 | the loss's product over the head padded with zero rows to a multiple of this (llm.c's 50304 for 50257), their logits left out of the softmax: a matrix unit's tiles divide the padded width. Off until a GPU measures it (`bench/gpu_bench.py --variants padded_vocab`); checkpoints, export and decoding never see the padding |
| `head_logits` | `float32` | `float32` | `float32` | the dtype the loss's product over the head writes its logits in: `compute` (bfloat16 in training) halves the bytes of the step's largest tensor, its logsumexp still accumulated in float32. Off until a GPU measures it (`--variants bf16_logits`) |
| `params_cast_once` | off | off | off | the blocks' matrices and biases cast to the compute dtype once a step, before the micro-batches, rather than in every micro-batch's forward: the same numbers (tested bit for bit). Off until a GPU measures it (`--variants cast_once`) |

`choices()` reads the platform of the active mesh's devices, so that a program compiled for a TPU topology on a
CPU machine takes the TPU's row; with no mesh active, JAX's default backend's. A process started with
`GPT_BACKEND_CHOICES` set to a JSON object (`{"head_logits": "compute"}`) runs with those cells of its row
changed: how `bench/gpu_bench.py --variants` measures a row's alternatives, each in a process of its own.

XLA's own GPU options are set before JAX starts, so they are a set of environment variables rather than a row's
cell: `GPU_XLA_OPTIONS`, measured as one variant (`--variants xla_options`) and in force nowhere until it wins.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import typing
from typing import Literal

import jax

from gpt.errors import ConfigError

__all__ = ["BackendChoices", "CHOICES", "choices", "OVERRIDE_ENV", "GPU_XLA_OPTIONS"]

OVERRIDE_ENV = "GPT_BACKEND_CHOICES"


@dataclasses.dataclass(frozen=True)
class BackendChoices:
    """One backend's row of the table above."""

    attention: Literal["plain", "dot_product", "splash"]
    loss_chunk_bytes: int
    cpu_kernels: bool  # `gpt.model.cpu_kernels`: CPU custom calls
    few_rows_matmul: bool
    score_rows: int | None  # None: every position of a prefill at once
    kv_page_length: int | None  # None: the whole cache is one page
    narrow_decodes: bool
    decode_chunk: int  # decode steps run unrolled between two checks of the decode loop's condition
    head_rows_multiple: int  # the loss's product over the head padded to a multiple of this many rows
    head_logits: Literal["float32", "compute"]  # the dtype of the loss's logits
    params_cast_once: bool  # the blocks' weights cast to the compute dtype once a step, not once a micro-batch


CHOICES = {
    "cpu": BackendChoices(attention="plain", loss_chunk_bytes=128 << 20, cpu_kernels=True,
                          few_rows_matmul=True, score_rows=128, kv_page_length=128, narrow_decodes=True,
                          decode_chunk=1, head_rows_multiple=1, head_logits="float32", params_cast_once=False),
    "gpu": BackendChoices(attention="dot_product", loss_chunk_bytes=1 << 30, cpu_kernels=False,
                          few_rows_matmul=False, score_rows=None, kv_page_length=None, narrow_decodes=False,
                          decode_chunk=8, head_rows_multiple=1, head_logits="float32", params_cast_once=False),
    "tpu": BackendChoices(attention="splash", loss_chunk_bytes=256 << 20, cpu_kernels=False,
                          few_rows_matmul=False, score_rows=None, kv_page_length=None, narrow_decodes=False,
                          decode_chunk=1, head_rows_multiple=1, head_logits="float32", params_cast_once=False),
}


def choices() -> BackendChoices:
    """The row of the platform a program is being compiled for: the active mesh's devices' (a TPU topology's on
    a CPU machine), else JAX's default backend's; an unknown platform takes the GPU's row with XLA's attention."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = jax.default_backend() if device is None else device.platform
    row = CHOICES.get(platform, dataclasses.replace(CHOICES["gpu"], attention="plain"))
    changes = _overrides(os.environ.get(OVERRIDE_ENV, ""))
    return dataclasses.replace(row, **changes) if changes else row


@functools.cache
def _overrides(text: str) -> dict:
    """`GPT_BACKEND_CHOICES`' cells, checked against the table's fields and their types (ConfigError else)."""
    if not text:
        return {}
    try:
        changes = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{OVERRIDE_ENV} must be a JSON object, got {text!r} ({error})") from None
    if not isinstance(changes, dict):
        raise ConfigError(f"{OVERRIDE_ENV} must be a JSON object, got {text!r}")
    names = [field.name for field in dataclasses.fields(BackendChoices)]
    for name, value in changes.items():
        if name not in names:
            raise ConfigError(f"{OVERRIDE_ENV} names {name!r}, not a backend choice (one of {', '.join(names)})")
        if not _allowed(name, value):
            raise ConfigError(f"{OVERRIDE_ENV}'s {name} cannot be {value!r} (the GPU's row has "
                              f"{getattr(CHOICES['gpu'], name)!r})")
    return changes


def _allowed(name: str, value) -> bool:
    """A value of a choice's Literal, or of a type some row's cell has (so None only where a row has None)."""
    hint = typing.get_type_hints(BackendChoices)[name]
    if typing.get_origin(hint) is Literal:
        return value in typing.get_args(hint)
    return type(value) in {type(getattr(row, name)) for row in CHOICES.values()}


# XLA's GPU options for training, as one set (set before JAX starts): cuBLAS rather than Triton for the products,
# cuDNN's LayerNorm, O1's latency-hiding scheduler and double-buffered loops, one CUDA stream's worth of
# connections (the order kernels were queued in), and no command buffers (a training step is a few long kernels).
GPU_XLA_OPTIONS = {
    "XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_cublaslt=true "
                 "--xla_gpu_enable_cudnn_layer_norm=true --xla_gpu_enable_command_buffer=",
    "JAX_OPTIMIZATION_LEVEL": "O1",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
}
