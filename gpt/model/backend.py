"""What the code does differently on a CPU and on an accelerator, in one table (as `gpt.model.sharding.RULES`
is for mesh axes). Each choice was measured; the figures are in bench/RESULTS.md under the name given.

| choice | CPU | GPU (and others) | why |
| --- | --- | --- | --- |
| `fused_attention` | no: softmax(q k^T) v written out, heads as a batch axis | yes on a GPU: `jax.nn.dot_product_attention` (cuDNN's fused kernel at 16-bit, `fused_causal`) | XLA's CPU has no fused kernel; the plain form avoids a transposed copy of k |
| `loss_chunk_bytes` | 128 MiB of float32 logits a chunk | 1 GiB | a chunk stays in the last-level cache; elsewhere fewer, larger chunks keep the matmuls big ("Training") |
| `cpu_kernels` | a decode step's matmuls of 1-16 int8 or float32 rows, and its attention, through compiled kernels, where built | XLA's ops | XLA's CPU dots read a few rows' weights below the memory's speed; its attention over the cache is many small programs ("CPU decoding", "The decode step's small programs") |
| `few_rows_matmul` | without the kernels, 2-16 float32 rows as a multiply and a sum | a dot | XLA's CPU runs 2-16 rows as a GEMM far from the memory's speed ("Serving") |
| `score_rows` | a prompt's scores (the LM head, its logsumexp and top logprobs) 128 positions at a time | all at once | 128 rows of GPT-2's logits (26 MB) stay in the last-level cache for the reductions over them ("Scoring prompts, and sampling sooner") |
| `kv_page_length` | an engine's cache in pages of 128 slots | one page | a decode step reads only the pages its rows reached ("Paged KV cache"); cuDNN reads one buffer under the mask |
| `narrow_decodes` | decodes compiled for 1, 2, 4, ... rows | for every slot | a step over 8 rows costs about twice one over 1 on a CPU, about the same on a GPU ("Serving") |
| `decode_chunk` | 1: a decode call's loop checks after every step whether to go on | 8 steps unrolled between checks | a GPU's while loop reads its condition back on the host at every iteration, and waits for it before the next; a CPU's does not, and gains from stopping at once (to be measured on a GPU: "The decode loop in chunks") |
"""

from __future__ import annotations

import dataclasses

import jax

__all__ = ["BackendChoices", "CHOICES", "choices"]


@dataclasses.dataclass(frozen=True)
class BackendChoices:
    """One backend's row of the table above."""

    fused_attention: bool
    loss_chunk_bytes: int
    cpu_kernels: bool  # `gpt.model.cpu_kernels`: CPU custom calls
    few_rows_matmul: bool
    score_rows: int | None  # None: every position of a prefill at once
    kv_page_length: int | None  # None: the whole cache is one page
    narrow_decodes: bool
    decode_chunk: int  # decode steps run unrolled between two checks of the decode loop's condition


CHOICES = {
    "cpu": BackendChoices(fused_attention=False, loss_chunk_bytes=128 << 20, cpu_kernels=True,
                          few_rows_matmul=True, score_rows=128, kv_page_length=128, narrow_decodes=True,
                          decode_chunk=1),
    "gpu": BackendChoices(fused_attention=True, loss_chunk_bytes=1 << 30, cpu_kernels=False,
                          few_rows_matmul=False, score_rows=None, kv_page_length=None, narrow_decodes=False,
                          decode_chunk=8),
}
_OTHER = dataclasses.replace(CHOICES["gpu"], fused_attention=False)  # a TPU: XLA's own attention


def choices() -> BackendChoices:
    """The choices for JAX's default backend."""
    return CHOICES.get(jax.default_backend(), _OTHER)
