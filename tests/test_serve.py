"""The OpenAI-compatible server, on 127.0.0.1 with an ephemeral port, driven by the official client."""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import openai
import pytest

from gpt.model import gpt2
from gpt.tokenizer import get_tokenizer

from bounds import bound
from serving import Server, alone
from training import ROOT


def test_openai_client_completions_equal_generate_text(server, model):
    assert any("warm-up: done" in line for line in server.lines)
    reply = server.client.completions.create(model="tiny", prompt="Hello there", max_tokens=24, temperature=0)
    assert reply.choices[0].text == alone(model, "Hello there", 24)
    assert reply.usage.prompt_tokens == 2 and reply.usage.completion_tokens == 24
    assert reply.choices[0].finish_reason == "length"

    chunks = list(server.client.completions.create(model="tiny", prompt="Hello there", max_tokens=24,
                                                   temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) > 1

    chunks = list(server.client.completions.create(model="tiny", prompt="Hello there", max_tokens=24, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == reply.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage
    assert [m.id for m in server.client.models.list().data] == ["tiny"]
    assert server.client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("gpt-4")


def test_prompts_as_lists_ids_n_logprobs_and_stop(server, model):
    tokenizer = get_tokenizer()
    reply = server.client.completions.create(model="tiny", prompt=["One", tokenizer.encode("Two words")], n=2,
                                             max_tokens=10, temperature=0, logprobs=3)
    texts = {c.index: c.text for c in reply.choices}
    assert texts[0] == texts[1] == alone(model, "One", 10) and texts[2] == texts[3] == alone(model, "Two words", 10)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 10 and all(len(top) == 3 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == texts[0]
    assert logprobs.token_logprobs[0] == pytest.approx(max(logprobs.top_logprobs[0].values()))  # greedy: the top

    # The same batch without top alternatives: the same logprobs, bit for bit. (A request alone would run
    # in a one-row decode step, whose matmul sums in another order: equal only to float32 rounding.)
    own = server.client.completions.create(model="tiny", prompt=["One", tokenizer.encode("Two words")], n=2,
                                           max_tokens=10, temperature=0, logprobs=0)
    own = next(c for c in own.choices if c.index == 0)
    assert own.logprobs.token_logprobs == logprobs.token_logprobs and own.logprobs.top_logprobs is None

    stop = texts[0][5:9]
    cut = server.client.completions.create(model="tiny", prompt="One", max_tokens=10, temperature=0, stop=[stop])
    assert cut.choices[0].text == texts[0][: texts[0].index(stop)] and cut.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_clients_get_their_single_request_results(server, model):
    words = "the quick brown fox jumps over a lazy dog while seven tired wizards quietly brew potions".split()
    prompts = [" ".join(words[: 1 + (3 * i) % len(words)]) for i in range(16)]
    max_tokens = [4 + (5 * i) % 29 for i in range(16)]

    def ask(i):
        reply = server.client.completions.create(model="tiny", prompt=prompts[i], max_tokens=max_tokens[i],
                                                 temperature=0, stream=i % 2 == 1)
        return "".join(c.choices[0].text for c in reply) if i % 2 else reply.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(ask, range(16)))
    assert got == [alone(model, p, m) for p, m in zip(prompts, max_tokens)]


@pytest.mark.slow
def test_a_server_over_a_device_mesh_answers_as_one_device_does(model):
    from gpt.model.sharding import make_mesh

    # 8 CPU devices. 64 positions hold these prompts and their 12 tokens, in four prompt buckets to warm up (128: six).
    server = Server(model, slots=4, max_queue=8, cache_length=64, mesh=make_mesh(data=2, tensor=4))
    try:
        prompts = ["The mesh", "Heads split four ways, and the slots two ways", "x"]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(lambda p: server.client.completions.create(
                model="tiny", prompt=p, max_tokens=12, temperature=0), prompts))
        assert [r.choices[0].text for r in replies] == [alone(model, p, 12) for p in prompts]
        assert {len(w.sharding.device_set) for w in jax.tree.leaves(server.engine.device.weights)} == {8}
    finally:
        server.stop()


def test_seeds_reproduce_per_request_whatever_else_runs(server):
    ask = lambda **kw: server.client.completions.create(model="tiny", prompt="Seeds", max_tokens=16,  # noqa: E731
                                                        temperature=1.0, top_p=0.95, **kw).choices[0].text
    first = ask(seed=5)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        noise = [pool.submit(ask, seed=s) for s in range(5)]
        again = pool.submit(ask, seed=5).result()
        [n.result() for n in noise]
    assert again == first and ask(seed=6) != first


def test_a_short_request_finishes_while_a_long_one_decodes(server):
    server.delay_s = 0.01
    try:
        finished = {}

        def ask(name, max_tokens):
            server.client.completions.create(model="tiny", prompt="Long and short", max_tokens=max_tokens, temperature=0)
            finished[name] = time.monotonic()

        long = threading.Thread(target=ask, args=("long", 100))
        long.start()
        while server.engine.live_slots == 0:
            time.sleep(0.005)
        ask("short", 3)
        long.join()
        assert finished["short"] < finished["long"]
    finally:
        server.delay_s = 0.0


@pytest.mark.parametrize("body, param, message", [
    ({"model": "other", "prompt": "x"}, "model", "model 'other' is not served here"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 200}, "max_tokens", "beyond the context of 128 tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": -0.5}, "temperature", "temperature must be >= 0"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p", r"top_p must be in \(0, 1\]"),
    ({"model": "tiny", "prompt": "x", "top_p": 1.5}, "top_p", r"top_p must be in \(0, 1\]"),
    ({"model": "tiny", "prompt": ""}, "prompt", "prompt is empty"),
    ({"model": "tiny", "prompt": []}, "prompt", "prompt must be a non-empty string"),
    ({"model": "tiny", "prompt": [1, 50257]}, "prompt", r"token id 50257 outside the vocabulary \[0, 50257\)"),
    ({"model": "tiny", "prompt": [-1]}, "prompt", "token id -1 outside the vocabulary"),
    ({"model": "tiny", "prompt": "x", "max_tokens": "ten"}, "max_tokens", "max_tokens must be an integer"),
    ({"model": "tiny", "prompt": "x", "n": 0}, "n", r"n must be in \[1, 16\]"),
    ({"model": "tiny", "prompt": "x", "logprobs": 9}, "logprobs", r"logprobs must be an integer in \[0, 5\], got 9"),
    ({"model": "tiny", "prompt": "x", "stop": 3}, "stop", "stop must be"),
    ({"model": "tiny", "prompt": ["a", "b", "c"], "n": 6}, "n", r"3 prompts x n=6 is 18 completions; at most 16"),
    ({"model": "tiny", "prompt": "x", "echo": 1}, "echo", "echo must be true or false, got 1"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0; 0 only with echo"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -1}, "max_tokens", "max_tokens must be >= 1, got -1; 0 only with echo"),
    ({"model": "tiny", "prompt": "x", "echo": True, "max_tokens": -1}, "max_tokens", "max_tokens must be >= 1, got -1"),
    ({"model": "tiny", "prompt": "x", "echo": True, "logprobs": 6}, "logprobs", r"logprobs must be an integer in \[0, 5\]"),
    ({"model": "tiny", "prompt": "x", "logit_bias": {"50256": -100}}, "logit_bias", "logit_bias is not supported"),
    ({"model": "tiny", "prompt": "x", "stream": True, "stream_options": [1]}, "stream_options", "must be an object"),
    ([1, 2], None, "must be a JSON object"),
])
def test_bad_requests_get_400_naming_the_field(server, body, param, message):
    reply = httpx.post(server.url + "/v1/completions", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert __import__("re").search(message, error["message"])
    # Only OpenAI's words for the fields: none of the engine's own names for them.
    assert not __import__("re").search(r"prompt_logprobs|stop_strings|stop_tokens|max_new_tokens", error["message"])


def test_json_infinities_are_bounded_and_huge_knobs_run(server, model):
    """Python's JSON reader takes NaN and Infinity: a knob that must be finite gets a 400, and a top-k past
    int32 runs (it keeps every token) without failing the requests beside it."""
    post = lambda body: httpx.post(server.url + "/v1/completions", content=body,  # noqa: E731
                                   headers={"content-type": "application/json"}, timeout=60)
    for field in ("temperature", "repetition_penalty"):
        reply = post(f'{{"model": "tiny", "prompt": "x", "{field}": Infinity}}')
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field
        assert "finite, got inf" in reply.json()["error"]["message"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(server.client.completions.create, model="tiny", prompt="Beside", max_tokens=12,
                             temperature=0)
        huge = post('{"model": "tiny", "prompt": "x", "max_tokens": 4, "top_k": 1e300, "seed": 1}')
        assert beside.result().choices[0].text == alone(model, "Beside", 12)
    assert huge.status_code == 200 and huge.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("setting, message", [
    (dict(slots=0), "Engine slots must be an integer >= 1, got 0"),
    (dict(port=70000), r"--port must be in \[0, 65535\], got 70000"),
    (dict(prefill_chunk=8), "Engine prefill_chunk must be an integer >= 16, got 8"),
    (dict(prefix_cache_tokens=-1), "Engine prefix_cache_tokens must be an integer >= 0, got -1"),
    (dict(max_connections=0), "ServeConfig.max_connections must be >= 1, got 0"),
    (dict(shutdown_deadline_s=float("nan")), "--shutdown_deadline_s must be >= 0, got nan"),
    (dict(max_request_mb=0), "--max_request_mb must be positive and finite, got 0"),
    (dict(host="256.1.1.1"), "--host '256.1.1.1' is not an address to listen on"),
    (dict(mesh="data=3"), r"mesh data=3 x fsdp=1 x tensor=1 = 3 devices, but there are 8"),
    (dict(port="taken"), "cannot listen on --host 127.0.0.1 --port [0-9]+: Address already in use"),
    (dict(dtype="float64"), "dtype must be one of float32, bfloat16, float16, got 'float64'"),
    (dict(max_connections=10**7), "--max_connections 10000000 is more than this process's [0-9]+ file descriptors"),
    (dict(header_timeout_s=0), "--header_timeout_s must be positive and finite, got 0"),
    (dict(api_key=" "), "--api_key is empty"),
    (dict(draft="ngram", draft_tokens=0), r"draft_tokens must be an integer in \[1, 32\], got 0"),
])
def test_bad_server_settings_fail_before_loading(tmp_path, setting, message):
    from gpt.errors import ConfigError
    from gpt.inference.engine_settings import EngineSettings
    from gpt.serve import ServeConfig, serve

    setting = dict(setting)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        if setting.get("port") == "taken":  # found at once, not after loading and warming up the model
            setting = {"port": taken.getsockname()[1]}
        engine = {name: setting.pop(name) for name in list(setting) if name in EngineSettings.__dataclass_fields__}
        with pytest.raises(ConfigError, match=message):  # the model path does not exist: nothing was loaded
            serve(ServeConfig(init_from=str(tmp_path / "no_model"), compile_cache=False,
                              engine=EngineSettings(**engine), **{"port": 0, **setting}))


def test_malformed_json_gets_400_and_the_server_stays_up(server, model):
    reply = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny", "prompt": ',
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
    reply = httpx.post(server.url + "/v1/completions", content=b"[" * 100_000 + b"]" * 100_000)  # had been a 500
    assert reply.status_code == 400 and "nests JSON arrays or objects too deeply" in reply.json()["error"]["message"]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert server.client.completions.create(model="tiny", prompt="Still", max_tokens=5,
                                            temperature=0).choices[0].text == alone(model, "Still", 5)


def test_a_body_over_the_limit_gets_413_unread_and_the_server_stays_up(server, model):
    body = json.dumps({"model": "tiny", "prompt": "x" * (9 << 20)}).encode()  # the default limit is 8 MiB
    declared = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    chunked = httpx.post(server.url + "/v1/completions", headers={"content-type": "application/json"},
                         content=(body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)))  # no length given
    for reply in (declared, chunked):
        assert reply.status_code == 413 and "over 8388608 bytes" in reply.json()["error"]["message"]
    reply = server.client.completions.create(model="tiny", prompt="Still here", max_tokens=6, temperature=0)
    assert reply.choices[0].text == alone(model, "Still here", 6)


def test_unknown_routes_get_openai_errors(server):
    with pytest.raises(openai.NotFoundError, match="POST /v1/embeddings: Not Found; this server answers POST "
                                                   "/v1/completions, POST /v1/chat/completions"):
        server.client.embeddings.create(model="tiny", input="Hi")
    reply = httpx.get(server.url + "/v1/completions")
    assert reply.status_code == 405 and reply.headers["allow"] == "POST"
    assert reply.json()["error"]["message"].startswith("GET /v1/completions: Method Not Allowed")


def test_metrics_are_exported(server):
    server.client.completions.create(model="tiny", prompt="Count me", max_tokens=6, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for series in ("gpt_queue_depth", "gpt_live_slots", "gpt_generated_tokens_total", "gpt_tokens_per_second",
                   "gpt_time_to_first_token_seconds_bucket", "gpt_inter_token_latency_seconds_bucket",
                   'gpt_requests_total{status="400"}'):
        assert series in text
    tokens = next(line for line in text.splitlines() if line.startswith("gpt_generated_tokens_total"))
    assert float(tokens.split()[1]) >= 6


@pytest.mark.slow
def test_a_status_line_while_requests_come_and_none_while_idle(model):
    server = Server(model, settings={"status_interval_s": 0.1}, warmup=False, slots=2, max_queue=4, cache_length=64)
    try:
        time.sleep(0.5)  # five intervals with nothing to say
        assert not [line for line in server.lines if line.startswith("serving:")]
        server.client.completions.create(model="tiny", prompt="Status", max_tokens=8, temperature=0)
        with pytest.raises(openai.BadRequestError):
            server.client.completions.create(model="tiny", prompt="Status", max_tokens=-1)
        deadline = time.monotonic() + bound(30)
        while not any("2 requests answered" in line for line in server.lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        line = next(line for line in server.lines if "2 requests answered" in line)
        assert line.startswith("serving: 0 running, 0 waiting; ") and "tokens/s over the last 10 s" in line, line
        assert line.endswith("; 8 tokens and 2 requests answered in all (1 refused)"), line
    finally:
        server.stop()


@pytest.mark.slow
def test_a_full_queue_gets_429_and_a_disconnect_frees_the_slot(model):
    server = Server(model, slots=1, max_queue=1, cache_length=128)
    try:
        server.delay_s = 0.05  # 100 tokens take ~5 s: long enough to act while they run
        with httpx.stream("POST", server.url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": "Hold the slot", "max_tokens": 100, "stream": True}) as held:
            lines = held.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it is decoding now
            waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
                server.client.completions.create, model="tiny", prompt="Wait", max_tokens=3, temperature=0)
            while server.engine.queue_depth == 0:
                time.sleep(0.005)
            with pytest.raises(openai.RateLimitError):
                server.client.completions.create(model="tiny", prompt="One too many", max_tokens=3)
        # The held stream's client went away: its request is cancelled and the waiting one gets the slot
        # long before the 100 tokens could have finished.
        started = time.monotonic()
        reply = waiting.result(timeout=10)
        assert time.monotonic() - started < 2.5
        assert reply.choices[0].text == alone(model, "Wait", 3)
        assert server.engine.live_slots == 0 and server.engine.queue_depth == 0
    finally:
        server.stop()


@pytest.mark.slow
def test_a_signal_during_warm_up_stops_the_server_at_once(tmp_path, model):
    gpt2.save(model, tmp_path / "model")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "serve.py"), "--init_from", str(tmp_path / "model"), "--port", "0",
         "--no-compile_cache"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert next(process.stdout).startswith("warm-up: compiling prefill 1/")
        process.send_signal(signal.SIGTERM)  # 7 more shapes to compile: it had waited for them all, then crashed
        assert process.wait(timeout=bound(60)) == 128 + signal.SIGTERM
        assert process.stderr.read().strip().endswith("stopped by SIGTERM")
    finally:
        process.kill()
        process.communicate()  # reaps it and closes its pipes


@pytest.mark.slow
def test_sigterm_finishes_running_requests_and_exits(tmp_path, model):
    gpt2.save(model, tmp_path / "model")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    # Over a mesh of 2 devices, the model drafting for itself from its directory: --mesh and --draft reach
    # the engine, and change no token.
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "serve.py"), "--init_from", str(tmp_path / "model"), "--port", "0",
         "--slots", "2", "--model_name", "tiny", "--no-compile_cache", "--shutdown_deadline_s", "20",
         "--mesh", "tensor=2", "--draft", str(tmp_path / "model")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("serving"):
                break
        url = line.split(" on ")[1].split()[0]
        assert line.rstrip().endswith("(2 slots, over a mesh data=1 x fsdp=1 x tensor=2)")
        with httpx.stream("POST", url + "/completions", timeout=60,
                          json={"model": "tiny", "prompt": "Finish me", "max_tokens": 100, "stream": True,
                                "temperature": 0}) as reply:
            events = reply.iter_lines()
            first = next(e for e in events if e.startswith("data:"))
            process.send_signal(signal.SIGTERM)
            rest = [e for e in events if e.startswith("data:")]
        chunks = [json.loads(e[5:]) for e in [first, *rest] if e != "data: [DONE]"]
        assert rest[-1] == "data: [DONE]" and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in chunks) == alone(model, "Finish me", 100)
        assert process.wait(timeout=bound(30)) == 128 + signal.SIGTERM  # uvicorn re-raises it after its shutdown
    finally:
        process.kill()
        process.communicate()  # reaps it and closes its pipes
    with pytest.raises(httpx.ConnectError):
        httpx.get(url.rsplit("/v1", 1)[0] + "/health")


def test_connections_send_small_replies_at_once():
    """serve.py's connections inherit TCP_NODELAY from its listener: with Nagle's algorithm on, a reply
    written as headers then body waited for the client's delayed ACK (40 ms a request, on the asyncio loop
    serve.py runs uvicorn on)."""
    from gpt.serve.server import _listen

    with _listen("127.0.0.1", 0) as listener:
        listener.listen()
        with socket.create_connection(listener.getsockname()):
            accepted, _ = listener.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
