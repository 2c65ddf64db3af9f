"""The shapes an engine compiles, as plain numbers (no JAX program runs here). That warm-up compiles exactly
these, and a round never another, is tests/test_engine.py's test_no_compile_after_warmup."""

import pytest

from gpt.inference.shapes import bucket, cached_prefix_length, pieces_after_prefixes, power_of_two, prompt_buckets


@pytest.mark.parametrize("longest, buckets", [
    (16, [16]),
    (100, [16, 32, 48, 64, 96, 100]),
    (128, [16, 32, 48, 64, 96, 128]),
    (256, [16, 32, 48, 64, 96, 128, 192, 256]),
])
def test_a_prompt_runs_in_the_smallest_bucket_that_holds_it(longest, buckets):
    assert prompt_buckets(longest) == buckets
    for length in range(1, longest + 1):
        assert bucket(buckets, length) == min(b for b in buckets if b >= length)


def test_a_chunked_prompt_runs_its_chunks_and_a_last_piece_no_longer_than_what_follows_its_first_chunk():
    assert pieces_after_prefixes(prompt_buckets(32), 32, 128, []) == [(128, 16), (128, 32)]
    assert pieces_after_prefixes(prompt_buckets(64), 64, 80, []) == [(80, 16), (80, 64)]  # at most 16 follow


def test_nothing_runs_after_a_prefix_when_no_prompt_can_be_chunked_or_prefix_cached():
    assert pieces_after_prefixes(prompt_buckets(128), 128, 128, []) == []
    assert pieces_after_prefixes(prompt_buckets(32), 32, 33, []) == []  # a prompt of 33 leaves no room to decode


def test_a_prefix_cached_prompt_runs_any_bucket_over_either_prefix_length():
    buckets = prompt_buckets(32)
    prefix_cached = sorted({cached_prefix_length(32, 128, n) for n in (1, 128)})
    assert prefix_cached == [32, 128]
    assert pieces_after_prefixes(buckets, 32, 128, prefix_cached) == [(32, 16), (32, 32), (128, 16), (128, 32)]


def test_power_of_two_is_the_smallest_that_holds_at_least_the_minimum():
    assert [power_of_two(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    assert [power_of_two(n, 16) for n in (1, 16, 17)] == [16, 16, 32]
