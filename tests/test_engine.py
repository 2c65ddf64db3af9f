"""The decoding engine on the caller's thread: continuous batching, per-request seeds, cancellation,
the queue bound, no compile after warm-up."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gpt import GPT, GPTConfig
from gpt.errors import ConfigError
from gpt.generate import generate
from gpt.inference.decoder import Decoder
from gpt.inference.decoding import Admission, Settings, decode, free, init_slots, insert, prefill
from gpt.inference.engine import Engine
from gpt.inference.request import Request
from gpt.inference.sampling import GREEDY, Sampling
from gpt.inference.scheduler import QueueFull

from serving import decisive_model


@pytest.fixture(scope="module")
def model():
    return decisive_model(vocab_size=256)  # scaled up: varied greedy paths, far from ties


def run_until(engine, completion, rounds=1000):
    for _ in range(rounds):
        if completion.done.is_set():
            return
        engine.step()
    raise AssertionError("the completion never ended")


@pytest.mark.slow  # the scheduler's order is checked without JAX in the quick tier (tests/test_scheduler.py)
def test_a_short_request_overtakes_a_long_one(model):
    engine = Engine(model, slots=2, cache_length=128)
    long = engine.submit(Request([1, 2, 3], 60, GREEDY))
    for _ in range(5):
        engine.step()
    assert len(long.tokens) == 6 and not long.done.is_set()
    short = engine.submit(Request([9, 8, 7, 6, 5], 4, GREEDY))
    run_until(engine, short)
    assert len(short.tokens) == 4 and short.finish_reason == "length"
    assert not long.done.is_set() and len(long.tokens) < 15  # it entered mid-sequence, not after
    run_until(engine, long)
    # Both equal what each gives alone: the slots share a cache but not positions.
    assert long.tokens == generate(model, [[1, 2, 3]], 60, sampling=GREEDY)[0]
    assert short.tokens == generate(model, [[9, 8, 7, 6, 5]], 4, sampling=GREEDY)[0]


@pytest.mark.slow  # the policy, host-only, in the quick tier: tests/test_scheduler.py
def test_a_round_admits_first_come_and_prefills_shortest_first(model):
    """Free slots go to the earliest requests; among those, the shortest prompt gets its first token first
    (the round's last first token comes no later, and the others sooner)."""
    engine = Engine(model, slots=2, cache_length=128)
    firsts = []

    def submit(name, prompt):
        return engine.submit(Request(prompt, 3, GREEDY),
                             lambda c: firsts.append(name) if len(c.tokens) == 1 and name not in firsts else None)

    long, short, shortest = submit("long", [5] * 12), submit("short", [1, 2, 3]), submit("shortest", [4])
    engine.step()
    assert firsts == ["short", "long"] and shortest.tokens == []  # it came last: it waits for a slot
    engine.run([long, short, shortest])
    assert long.tokens == generate(model, [[5] * 12], 3, sampling=GREEDY)[0]


def test_a_long_prompt_runs_in_chunks_while_the_others_decode(model):
    """A prompt longer than the prefill chunk runs a chunk per round, and the live slot decodes between
    its chunks instead of waiting for all of it; it then gives what a whole prefill gives: the same
    tokens, greedy and sampled with a repetition penalty (its seen tokens span every chunk), and the plain
    forward's logprobs."""
    prompt = [(11 * i + 5) % 256 for i in range(70)]  # chunks of 16: four, and a last of 6
    requests = [Request(prompt, 10, GREEDY, logprobs=2),
                Request(prompt, 10, Sampling(temperature=0.8, repetition_penalty=3.0), seed=5)]
    engine = Engine(model, slots=2, cache_length=128, prefill_chunk=16)
    running = engine.submit(Request([1, 2, 3], 40, GREEDY))
    engine.step()
    for request in requests:
        long = engine.submit(request)
        before = len(running.tokens)
        while not long.tokens:
            engine.step()
        assert len(running.tokens) - before >= 4  # a token a round while the chunks ran
        run_until(engine, long)
        whole = Engine(model, slots=1, cache_length=128)  # prefill_chunk 256: one prefill
        alone = whole.submit(request)
        whole.run([alone])
        assert long.tokens == alone.tokens
        assert long.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    logprobs_TV = jax.nn.log_softmax(model(jnp.asarray([prompt + long.tokens]))[0], axis=-1)
    assert long.logprobs == pytest.approx([float(logprobs_TV[69 + i, t]) for i, t in enumerate(long.tokens)], abs=1e-4)
    run_until(engine, running)
    assert running.tokens == generate(model, [[1, 2, 3]], 40, sampling=GREEDY)[0]


def test_a_request_cancelled_between_its_chunks_frees_its_slot(model):
    engine = Engine(model, slots=1, cache_length=128, prefill_chunk=16)
    long = engine.submit(Request(list(range(1, 61)), 5, GREEDY))
    engine.step()
    engine.step()
    long.cancel()
    short = engine.submit(Request([3, 4], 5, GREEDY))  # takes the slot in the round that frees it
    run_until(engine, short)
    assert long.finish_reason == "cancelled" and long.tokens == []
    assert short.tokens == generate(model, [[3, 4]], 5, sampling=GREEDY)[0]
    assert not engine.step() and engine.live_slots == 0  # nothing left over: no chunk runs for the cancelled one


@pytest.mark.slow
def test_chunked_prompts_sharing_a_prefill_over_a_mesh_give_what_each_gives_alone(model):
    """Over a mesh's data axis two prompts run each prefill and chunk together; the shorter one ends a chunk
    before the other, and is chosen from where it ended; and when one is cancelled between chunks, the
    other still reads its own row."""
    from gpt.model.sharding import make_mesh

    mesh = make_mesh(data=2, devices=jax.devices()[:2])
    engine = Engine(model, slots=2, cache_length=128, prefill_chunk=16, mesh=mesh)
    prompts = [[(5 * i + 1) % 256 for i in range(20)], [(3 * i + 2) % 256 for i in range(40)]]
    completions = [engine.submit(Request(prompt, 8, GREEDY)) for prompt in prompts]
    engine.run(completions)
    alone = [generate(model, [prompt], 8, sampling=GREEDY)[0] for prompt in prompts]
    assert [c.tokens for c in completions] == alone
    # The first row cancelled between chunks: the second goes on from its own row of the chunks' cache.
    completions = [engine.submit(Request(prompt, 8, GREEDY)) for prompt in prompts]
    engine.step()
    completions[0].cancel()
    engine.run(completions)
    assert completions[0].tokens == [] and completions[1].tokens == alone[1]


def test_a_decode_over_some_slots_equals_one_over_all():
    """`decode` over rows [3, 0, 1] of 4 slots (slot 0 cancelled: a padding row) gives slots 1 and 3 the
    tokens, logprobs and cache that a decode over all 4 gives them, and leaves slot 2 untouched, over a
    cache of 3 pages that the rows have crossed into, each row's 2 key heads serving its 4 query heads."""
    model = GPT(GPTConfig.preset("tiny", block_size=320, n_kv_head=2), rngs=nnx.Rngs(1))
    nnx.update(model, jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, nnx.state(model, nnx.Param)))
    config, weights = model.config, Decoder.of(model).weights
    lengths = [150, 5, 200, 131]
    tokens = jnp.asarray([[(7 * i + 3 * row) % 256 for i in range(256)] for row in range(4)], jnp.int32)
    unscored = jnp.zeros((4,), jnp.bool_)
    prefix, _ = jax.jit(prefill, static_argnames="config")(config, weights, None, tokens, jnp.asarray(lengths, jnp.int32),
                                                          tokens, unscored, unscored)
    admission = Admission(slots=jnp.arange(4, dtype=jnp.int32), max_tokens=jnp.full((4,), 50, jnp.int32),
                          settings=Settings.empty(4, 2))
    slots, _ = insert(weights, init_slots(config, 4, 320, 2), prefix, admission)
    assert len(slots.cache.k[0]) == 3  # pages of 128, 128 and 64 slots
    slots = jax.jit(free)(slots, jnp.asarray([True, False, True, False]))
    run = jax.jit(decode, static_argnames=("config", "max_steps"))
    full, full_out = run(config, weights, slots, 5, False, max_steps=5)
    rows = jnp.asarray([3, 0, 1], jnp.int32)
    some, some_out = run(config, weights, slots, 5, False, max_steps=5, rows_R=rows)

    assert int(some_out.steps) == 5 and some_out.token.shape == full_out.token.shape
    assert (some_out.token == full_out.token).all() and (full_out.token[:, 1] >= 0).all()
    assert jnp.allclose(some_out.logprob[:, [1, 3]], full_out.logprob[:, [1, 3]], atol=1e-5)
    assert (some.cache.lengths == full.cache.lengths).all() and list(some.cache.lengths) == [150, 10, 200, 136]
    assert (some.last_token == full.last_token).all() and (some.seen == full.seen).all()
    N = config.kv_heads  # a slot's rows in the cache
    for layer in range(config.n_layer):
        for new, old, want in zip(some.cache.k[layer] + some.cache.v[layer], slots.cache.k[layer] + slots.cache.v[layer],
                                  full.cache.k[layer] + full.cache.v[layer]):
            for slot in (1, 3):
                assert jnp.allclose(new[slot * N:(slot + 1) * N], want[slot * N:(slot + 1) * N], atol=1e-5)
            assert (new[2 * N:3 * N] == old[2 * N:3 * N]).all()


@pytest.mark.slow  # a further case of a check the quick tier makes
def test_seeds_reproduce_whatever_else_runs(model):
    request = Request([4, 5, 6], 20, Sampling(temperature=1.0, top_k=50), seed=11)
    alone = Engine(model, slots=4, cache_length=64)
    want = alone.submit(request)
    alone.run([want])
    busy = Engine(model, slots=4, cache_length=64)
    others = [busy.submit(Request([7] * n, 30, Sampling(temperature=t, top_p=0.9), seed=n))
              for n, t in [(3, 0.7), (9, 1.3)]]
    busy.step()
    got = busy.submit(request)  # enters while the others are mid-sequence, in another slot
    busy.run([got, *others])
    assert got.tokens == want.tokens
    other_seed = Engine(model, slots=4, cache_length=64)
    different = other_seed.submit(Request([4, 5, 6], 20, Sampling(temperature=1.0, top_k=50), seed=12))
    other_seed.run([different])
    assert different.tokens != want.tokens


def test_cancel_frees_the_slot(model):
    engine = Engine(model, slots=1, cache_length=128, max_queue=1)
    first = engine.submit(Request([1, 2], 100, GREEDY))
    engine.step()
    waiting = engine.submit(Request([3, 4], 5, GREEDY))
    with pytest.raises(QueueFull, match="max_queue=1"):
        engine.submit(Request([5], 5))
    first.cancel()
    run_until(engine, waiting)
    assert first.finish_reason == "cancelled" and len(first.tokens) < 100
    assert waiting.tokens == generate(model, [[3, 4]], 5, sampling=GREEDY)[0]
    assert engine.live_slots == 0 and engine.queue_depth == 0


def test_stop_tokens_and_lengths_end_requests(model):
    free = generate(model, [[1, 2, 3]], 20, sampling=GREEDY)[0]
    stop = free[7]
    engine = Engine(model, slots=2, cache_length=128)
    stopped = engine.submit(Request([1, 2, 3], 20, GREEDY, stop_tokens=[stop]))
    engine.run([stopped])
    assert stopped.tokens == free[: free.index(stop)] and stopped.finish_reason == "stop"
    one = engine.submit(Request([1, 2, 3], 1, GREEDY))
    engine.run([one])
    assert one.tokens == free[:1] and one.finish_reason == "length"


def test_logprobs_are_the_plain_forwards(model):
    """Each token's logprob and its top alternatives equal log_softmax of the plain forward's logits at
    that position, with a sampled (not greedy) request sharing the batch."""
    prompt = [5, 9, 2, 7]
    engine = Engine(model, slots=2, cache_length=128)
    greedy = engine.submit(Request(prompt, 12, GREEDY, logprobs=5))
    sampled = engine.submit(Request([3, 3], 12, Sampling(temperature=1.0), seed=4, logprobs=2))
    engine.run([greedy, sampled])
    for completion, request_prompt in ((greedy, prompt), (sampled, [3, 3])):
        tokens = request_prompt + completion.tokens
        logprobs_TV = jax.nn.log_softmax(model(jnp.asarray([tokens]))[0], axis=-1)
        for i, token in enumerate(completion.tokens):
            row = logprobs_TV[len(request_prompt) - 1 + i]
            assert completion.logprobs[i] == pytest.approx(float(row[token]), abs=1e-4)
            top = jax.lax.top_k(row, completion.request.logprobs)
            assert [t for t, _ in completion.top_logprobs[i]] == [int(t) for t in top[1]]
            assert [lp for _, lp in completion.top_logprobs[i]] == pytest.approx([float(v) for v in top[0]], abs=1e-4)


@pytest.mark.slow  # three warm-ups, each compiling every program
def test_the_warmup_checks_its_largest_programs_memory_before_running_and_compiles_nothing_more_for_it(
        model, monkeypatch):
    import gpt.program_report
    from gpt.inference.device_slots import DeviceSlots
    from gpt.program_report import sharded_bytes

    compiles = []

    def count(event: str, *_, **__) -> None:
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    counted = {}
    try:
        for check in (True, False):
            with monkeypatch.context() as patch:
                if not check:
                    patch.setattr(DeviceSlots, "check_largest_fit", lambda *_: None)
                jax.clear_caches()  # every program compiled afresh by each
                engine = Engine(model, slots=3, cache_length=96, prefill_chunk=64)
                compiles.clear()
                engine.warmup(log=lambda line: None)
                counted[check] = len(compiles)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert counted[True] == counted[False] > 0  # the check's two programs are the warm-up's own

    # Room for the weights and the slots, not for the prefill's logits over 64 positions: one line, before it runs.
    engine = Engine(model, slots=3, cache_length=98, prefill_chunk=64)
    room = sharded_bytes((engine.device.weights, engine.device.slots)) + 64 * model.config.vocab_size
    monkeypatch.setattr(gpt.program_report, "device_memory_bytes", lambda device: room)
    with pytest.raises(ConfigError, match=r"^3 slots of 98 positions: the prefill of 1 x 64 tokens needs .* GiB per "
                                          r"device .* over the cpu's .*: use fewer --slots") as error:
        engine.warmup(log=lambda line: None)
    assert "\n" not in str(error.value)


def test_no_compile_after_warmup(model):
    engine = Engine(model, slots=4, cache_length=64, steps_per_call=2, prefill_chunk=16)  # 17, 40 and 60 in chunks
    engine.warmup(log=lambda line: None)
    compiled = engine.compiled_shapes()
    requests = [Request(list(range(1, n + 1)), m, Sampling(t, k, p, mp, r), seed=n, logprobs=lp, stop_tokens=st,
                        stop_strings=ss)
                for n, m, t, k, p, mp, r, lp, st, ss in [
                    (1, 5, 0.0, None, None, None, 1.0, 0, (), ()), (40, 20, 0.8, 40, 0.9, None, 1.2, 3, (7,), ()),
                    (17, 30, 1.0, None, None, 0.1, 1.0, 5, (), ("a",)), (60, 4, 0.0, 5, None, None, 2.0, 0, (1, 2), ()),
                    (3, 61, 1.5, None, 0.5, 0.05, 1.0, 1, (), ())]]
    completions = [engine.submit(r) for r in requests]
    engine.step()
    with pytest.raises(RuntimeError, match="warmup runs before the engine serves"):
        engine.warmup(log=lambda line: None)  # its placeholder would take a live request's slot
    completions[1].cancel()
    engine.run(completions)
    assert engine.compiled_shapes() == compiled
    assert all(c.finish_reason in ("stop", "length", "cancelled") for c in completions)
    # The warm-up's placeholder request (prefilled and stepped for real) left nothing behind.
    assert completions[0].tokens == generate(model, [requests[0].prompt], 5, sampling=GREEDY)[0]
    assert len(completions[2].top_logprobs[0]) == 5 and len(completions[4].top_logprobs[0]) == 1


@pytest.mark.parametrize("request_changes, message", [  # every field's bound: tests/test_request.py
    (dict(max_tokens=62), "that is 64, beyond the context of 63 tokens"),
    (dict(stop_tokens=list(range(9))), "at most 8 are allowed"),
])
def test_bad_requests_are_refused_before_anything_runs(model, request_changes, message):
    engine = Engine(model, slots=1, cache_length=63)
    compiled = engine.compiled_shapes()
    with pytest.raises(ConfigError, match=message):
        engine.submit(Request(**{"prompt": [1, 2], "max_tokens": 5, **request_changes}))
    assert engine.compiled_shapes() == compiled and engine.queue_depth == 0


@pytest.mark.parametrize("engine_args, message", [
    (dict(slots=0), "Engine slots must be an integer >= 1, got 0"),
    (dict(slots=True), "Engine slots must be an integer >= 1, got True"),
    (dict(max_queue=2.5), "Engine max_queue must be an integer >= 1, got 2.5"),
    (dict(steps_per_call=-1), "Engine steps_per_call must be an integer >= 1, got -1"),
    (dict(prefill_chunk=8), "Engine prefill_chunk must be an integer >= 16, got 8"),
    (dict(cache_length=129), r"cache_length must be in \[1, 128\] \(the model's context\), got 129"),
    (dict(cache_length=32.5), r"cache_length must be in \[1, 128\] \(the model's context\), got 32.5"),
])
def test_bad_engine_settings_are_refused(model, engine_args, message):
    with pytest.raises(ConfigError, match=message):
        Engine(model, **engine_args)


def test_numpy_integers_are_settings_like_any_other(model):
    engine = Engine(model, slots=np.int64(2), max_queue=np.int32(3), cache_length=np.int64(128))
    completion = engine.submit(Request(np.array([1, 2]), np.int64(3), GREEDY, seed=np.uint32(7)))
    engine.run([completion])
    assert engine.num_slots == 2 and completion.tokens == generate(model, [[1, 2]], 3, sampling=GREEDY)[0]


def test_extreme_knobs_run_beside_other_requests(model):
    """Knobs past what the device's int32/float32 hold keep their meaning, and never fail a round (which
    would end every running request): a top-k past int32 keeps every token, a top-p that float32 rounds
    to 0 keeps the most likely one, so that request decodes greedily."""
    engine = Engine(model, slots=2, cache_length=128)
    running = engine.submit(Request([3, 4, 5], 12, GREEDY))
    engine.step()
    extreme = engine.submit(Request([1, 2], 8, Sampling(temperature=1.0, top_k=10**13, top_p=1e-300),
                                     seed=2**70))
    run_until(engine, running)
    run_until(engine, extreme)
    assert running.finish_reason == extreme.finish_reason == "length"
    assert running.tokens == generate(model, [[3, 4, 5]], 12, sampling=GREEDY)[0]
    assert extreme.tokens == generate(model, [[1, 2]], 8, sampling=GREEDY)[0]



def test_an_engines_settings_are_one_dataclass_that_serve_config_holds(model):
    """serve.py's settings hold the engine's (`EngineSettings`), and sample.py's its draft's (`DraftChoice`),
    declared once, each still a flag of its own name: an Engine takes a ServeConfig's as its settings, and
    keywords change some."""
    import dataclasses

    import tyro

    from gpt.inference.engine_settings import DraftChoice, EngineSettings
    from gpt.sample import SampleConfig
    from gpt.serve import ServeConfig

    engine_fields = {f.name for f in dataclasses.fields(EngineSettings)}
    assert not engine_fields & {f.name for f in dataclasses.fields(ServeConfig)}
    draft_fields = {f.name for f in dataclasses.fields(DraftChoice)}  # sample.py's draft flags are the engine's
    assert issubclass(SampleConfig, DraftChoice) and issubclass(EngineSettings, DraftChoice)
    assert not draft_fields & (set(vars(SampleConfig)["__annotations__"]) | set(vars(EngineSettings)["__annotations__"]))
    config = tyro.cli(ServeConfig, args=["--slots", "2", "--cache_length", "32", "--draft", "ngram", "--draft_tokens",
                                         "3", "--port", "0"])
    assert config.engine == EngineSettings(slots=2, cache_length=32, draft="ngram", draft_tokens=3) and config.port == 0
    engine = Engine(model, config.engine, max_queue=5)
    assert (engine.num_slots, engine.cache_length, engine.max_queue, engine.device.max_draft_tokens) == (2, 32, 5, 3)
    with pytest.raises(TypeError, match="unexpected keyword argument 'port'"):
        Engine(model, port=1)


def test_slots_too_many_for_the_devices_memory_are_one_line_before_anything_is_allocated(model):
    # ~128 GiB of cache: on a CPU the kernel's OOM killer had ended serve.py with no word (exit 137).
    with pytest.raises(ConfigError) as error:
        Engine(model, slots=1 << 22, cache_length=64)
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{1 << 22} slots of 64 positions: the decoding slots' cache "
                                                      "needs "), message
    assert "GiB per device" in message and "--slots" in message and "--cache_length" in message
