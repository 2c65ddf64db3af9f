"""The shapes an engine compiles its programs for: prompt lengths in buckets, decode calls over some of the
slots, and the pieces that run after a prefix (a chunked prompt's, a prefix-cached one's). Plain numbers, no JAX:
each shape here is one compiled program, so warm-up compiles exactly these and a round never another.
"""

from __future__ import annotations

from jax.sharding import Mesh

from gpt.model.backend import choices

__all__ = ["MIN_PROMPT_BUCKET", "prompt_buckets", "bucket", "power_of_two", "decode_widths", "pieces_after_prefixes",
           "cached_prefix_length"]

MIN_PROMPT_BUCKET = 16


def decode_widths(num_slots: int, mesh: Mesh | None) -> list[int]:
    """The numbers of rows a decode call is compiled for: on a CPU, powers of two below the slot count
    and the slot count (a call runs the fewest that hold every live slot: a step over 8 rows costs about
    twice one over 1 there); elsewhere, or over a mesh, the slot count alone (a GPU's step costs about
    the same for 1 row as for 8)."""
    if mesh is not None or not choices().narrow_decodes:
        return [num_slots]
    return [1 << i for i in range(num_slots.bit_length()) if 1 << i < num_slots] + [num_slots]


def prompt_buckets(longest: int) -> list[int]:
    """The prompt lengths a prefill is compiled for: 16, 32, then each power of two and one and a half
    times it (48, 64, 96, 128, 192, ...) below `longest` (the cache length, or the prefill chunk), and
    `longest`. A prompt runs in the smallest that holds it: at most a third of a prefill is padding
    (with powers of two alone, up to half), for a few more programs to compile."""
    buckets, n = [], MIN_PROMPT_BUCKET
    while n < longest:
        buckets += [n] + ([n * 3 // 2] if n >= 2 * MIN_PROMPT_BUCKET and n * 3 // 2 < longest else [])
        n *= 2
    return buckets + [longest]


def bucket(buckets: list[int], length: int) -> int:
    """The smallest of `buckets` (ascending) that holds a piece of `length` tokens."""
    return next(b for b in buckets if b >= length)


def power_of_two(n: int, minimum: int = 1) -> int:
    """The smallest power of two that holds n (n >= 1), at least `minimum`: a size that many values of n
    share, so that they share its compiled programs."""
    return max(minimum, 1 << (n - 1).bit_length())


def pieces_after_prefixes(buckets: list[int], chunk: int, length: int,
                          prefix_cached: list[int]) -> list[tuple[int, int]]:
    """The (prefix length, piece length) pairs a prefill runs over a prefix that already holds tokens, for
    prompts of up to `length` tokens (the cache) in chunks of `chunk` (`buckets`: prompt_buckets(chunk)):
    a chunked prompt's chunks, then its last piece (at most what follows its first chunk); a prefix-cached
    prompt's (any bucket, over each of the prefix lengths in `prefix_cached`). Sorted."""
    pieces = set()
    if length > chunk + 1:  # a prompt of chunk + 1 tokens and one more fit: prompts can be chunked
        pieces = {(length, chunk)} | {(length, b) for b in buckets if b <= bucket(buckets, min(chunk, length - chunk))}
    return sorted(pieces | {(n, b) for n in prefix_cached for b in buckets})


def cached_prefix_length(chunk: int, length: int, prompt_length: int) -> int:
    """The positions of a prefix-cached prompt's prefix: the prefill chunk for a prompt that fits one (a cache of
    the full `length` would cost each of them a copy of it), else the cache length."""
    return chunk if prompt_length <= chunk else length
