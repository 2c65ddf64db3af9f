"""Decoding in fixed-length chunks (`gpt.model.backend`'s `decode_chunk`, a GPU's choice: steps unrolled
between two checks of the loop's condition, which a GPU reads back on the host): forced here on the CPU,
it gives exactly the tokens of the step-by-step loop."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from gpt.generate import generate
from gpt.inference import decoding
from gpt.inference.decoder import Decoder
from gpt.inference.decoding import decode, decode_chunk_length, init_slots
from gpt.inference.engine import Engine
from gpt.inference.request import Request
from gpt.inference.sampling import Sampling
from gpt.model import backend

from serving import decisive_model


@pytest.fixture(scope="module")
def model():
    return decisive_model(vocab_size=256)  # the engine tests' model


@pytest.fixture
def chunks(monkeypatch):
    """chunks(n): decode in chunks of up to n steps from now on (the programs traced afresh)."""
    def use(n: int):
        chosen = dataclasses.replace(backend.choices(), decode_chunk=n)
        monkeypatch.setattr(decoding, "choices", lambda: chosen)
        jax.clear_caches()

    yield use
    jax.clear_caches()  # the rest of the process traces with the table's own choice


REQUESTS = [  # (prompt length, max tokens, temperature, stop strings): lengths that end mid-chunk
    (3, 13, 0.0, ()), (17, 5, 0.0, ("e",)), (9, 29, 0.9, ()), (30, 11, 1.2, ("a", "o")), (1, 1, 0.0, ()),
]


def completions(model, steps_per_call: int) -> list[list[int]]:
    engine = Engine(model, slots=2, cache_length=64, steps_per_call=steps_per_call, prefill_chunk=16)
    engine.warmup(log=lambda line: None)
    compiled = engine.compiled_shapes()
    submitted = [engine.submit(Request(list(range(2, n + 2)), m, Sampling(temperature=t), seed=n, stop_strings=ss))
                 for n, m, t, ss in REQUESTS]  # five requests over two slots: admitted as others finish
    engine.run(submitted)
    assert engine.compiled_shapes() == compiled, "compiled after the warm-up"
    return [c.tokens for c in submitted], [c.finish_reason for c in submitted]


@pytest.mark.slow  # a GPU's choice, two engines warmed up a case (the quick tier: the chunks' program, below)
@pytest.mark.parametrize("chunk, steps_per_call", [(4, 8), (8, 8), (3, 8)])
def test_chunks_give_the_step_by_step_loops_tokens_stops_and_lengths(model, chunks, chunk, steps_per_call):
    chunks(1)
    want = completions(model, steps_per_call)
    chunks(chunk)
    assert completions(model, steps_per_call) == want


@pytest.mark.slow  # a further case of a check the quick tier makes
def test_generate_in_chunks_gives_the_same_tokens(model, chunks):
    prompts = [[5, 6, 7], list(range(1, 40)), [9]]
    chunks(1)
    want = generate(model, prompts, 21, sampling=Sampling(temperature=0.7), seed=3)
    chunks(8)
    assert generate(model, prompts, 21, sampling=Sampling(temperature=0.7), seed=3) == want


def test_a_call_of_one_chunk_has_no_loop_and_a_longer_one_checks_once_a_chunk(model, chunks):
    config = model.config
    slots = init_slots(config, 2, 32, 4)
    weights = Decoder.of(model).weights

    def whiles(eqns) -> list:
        return [eqn for eqn in eqns if eqn.primitive.name == "while"]

    def decode_jaxpr(max_steps: int):
        return jax.make_jaxpr(decode, static_argnums=(0, 5))(config, weights, slots, jnp.int32(max_steps),
                                                             jnp.bool_(False), max_steps).jaxpr

    chunks(1)
    [loop] = whiles(decode_jaxpr(8).eqns)  # the decode loop, its body one step
    step = len(loop.params["body_jaxpr"].jaxpr.eqns)
    chunks(8)
    assert decode_chunk_length(8) == 8 and decode_chunk_length(12) == 6 and decode_chunk_length(7) == 7
    assert not whiles(decode_jaxpr(8).eqns)  # one chunk: eight steps in a line, no decode loop
    [loop] = whiles(decode_jaxpr(16).eqns)  # a loop whose body is eight steps: one check a chunk
    assert len(loop.params["body_jaxpr"].jaxpr.eqns) == 8 * step
