"""The server facing hostile clients: values that had been 500s, a bug's 500 (JSON, counted, nothing else
ends), a multi-megabyte prompt and a burst of bad requests during a stream (no gap over a second), queued
requests of disconnected clients (gone at once), the API key, shutdown at the deadline (every request
ends, streams with finish_reason "abort"), and bounded connections."""

import concurrent.futures
import json
import logging
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from gpt.serve import ServeConfig
from gpt.serve import app as app_module
from gpt.serve.server import startup_lines
from gpt.tokenizer import get_tokenizer

from bounds import bound
from serving import Server, alone
from training import ROOT


def post(server, content: bytes, path: str = "/v1/completions", **kwargs) -> httpx.Response:
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60,
                      **kwargs)


def counted(server, status: int) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(f'gpt_requests_total{{status="{status}"}}'):
            return float(line.split()[-1])
    return 0.0


def stream_gaps(server, prompt: str, max_tokens: int, out: dict) -> None:
    """Stream a greedy completion, recording its text and the longest gap between its events."""
    times, text = [], []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                text.append(json.loads(line[6:])["choices"][0]["text"])
    out["text"], out["gap"] = "".join(text), max(b - a for a, b in zip(times, times[1:]))


def test_values_that_had_been_500s_get_400_and_a_bug_gets_a_json_500(server, model, monkeypatch):
    before = counted(server, 400)
    for body in [b'{"model": "tiny", "prompt": "x", "user": 1' + b"0" * 5000 + b"}",
                 b'{"model": "tiny", "prompt": "x", "temperature": 1' + b"0" * 400 + b"}",
                 b'{"model": "tiny", "prompt": ' + b"[" * 500 + b"1" + b"]" * 500 + b"}"]:
        reply = post(server, body)
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error", reply.text
    assert counted(server, 400) == before + 3

    def bug(raw, limits):
        raise ZeroDivisionError("a bug")

    out = {}
    streaming = threading.Thread(target=stream_gaps, args=(server, "Beside a bug", 40, out))
    server.delay_s = 0.02
    try:
        streaming.start()
        while server.engine.live_slots == 0:  # parsed and running before the bug is put in
            time.sleep(0.01)
        monkeypatch.setattr(app_module, "parse_completion", bug)
        reply = post(server, b'{"model": "tiny", "prompt": "x"}')
        monkeypatch.undo()
        streaming.join()
    finally:
        server.delay_s = 0.0
    assert reply.status_code == 500 and reply.json()["error"]["type"] == "server_error"
    assert "ZeroDivisionError" in reply.json()["error"]["message"] and counted(server, 500) == 1
    assert out["text"] == alone(model, "Beside a bug", 40)  # the request beside it ran to its end


@pytest.mark.slow  # a further case of a check the quick tier makes
def test_a_huge_prompt_and_a_burst_of_bad_requests_stall_no_stream(server, model):
    server.delay_s = 0.02  # a stream of 150 tokens takes over 3 s
    out, health = {}, []
    streaming = threading.Thread(target=stream_gaps, args=(server, "Keep streaming", 100, out))
    try:
        streaming.start()
        time.sleep(0.3)
        huge = json.dumps({"model": "tiny", "prompt": "many words " * 600_000}).encode()  # 6.6 MB
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            replies = [pool.submit(post, server, huge)]
            replies += [pool.submit(post, server, json.dumps({"prompt": "tokenize me " * 300_000}).encode(), "/tokenize")]
            replies += [pool.submit(post, server, bad) for bad in [b"{", b"[]", b'{"model": "tiny", "prompt": 1e999}'] * 10]
            while not all(r.done() for r in replies):
                start = time.monotonic()
                assert httpx.get(server.url + "/health", timeout=5).status_code == 200
                health.append(time.monotonic() - start)
                time.sleep(0.05)
        streaming.join()
    finally:
        server.delay_s = 0.0
    statuses = [r.result().status_code for r in replies]
    assert statuses[0] == 400 and statuses[1] == 200 and set(statuses[2:]) == {400}
    assert replies[1].result().json()["count"] == len(get_tokenizer().encode("tokenize me " * 300_000))
    print(f"longest gap between a stream's events {out['gap']:.3f} s, slowest /health {max(health):.3f} s")
    assert out["gap"] < 1.0 and max(health) < 1.0, (out["gap"], max(health))
    assert out["text"] == alone(model, "Keep streaming", 100)


@pytest.mark.slow
def test_queued_requests_of_clients_that_went_leave_the_queue_at_once(model):
    server = Server(model, slots=1, max_queue=2, cache_length=128)
    try:
        server.delay_s = 0.05
        holder = threading.Thread(target=stream_gaps, args=(server, "Hold the slot", 40, {}))
        holder.start()
        while server.engine.live_slots == 0:
            time.sleep(0.01)
        for _ in range(2):  # each waits for the slot, then its client gives up
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=0.3)
        deadline = time.monotonic() + 1.0
        while server.engine.queue_depth and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.engine.queue_depth == 0 and server.engine.live_slots == 1  # the holder still runs
        reply = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "Next", "max_tokens": 5, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == alone(model, "Next", 5)
        holder.join()
    finally:
        server.stop()


def test_an_api_key_is_required_when_one_is_set(model):
    # One slot over 128 positions, as this module's other one-slot servers: their programs compile once.
    server = Server(model, settings={"api_key": "sekret-key"}, slots=1, cache_length=128)
    try:
        for headers in [{}, {"authorization": "Bearer wrong"}, {"authorization": "sekret-key"}]:
            reply = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=headers)
            assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
            assert httpx.get(server.url + "/v1/models", headers=headers).status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
        assert httpx.get(server.url + "/openapi.json").status_code == 401  # the API's description too
        described = httpx.get(server.url + "/openapi.json", headers={"authorization": "Bearer sekret-key"})
        assert described.status_code == 200 and "/v1/completions" in described.json()["paths"]
        for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):  # FastAPI's pages load scripts from a CDN
            assert httpx.get(server.url + page, headers={"authorization": "Bearer sekret-key"}).status_code == 404
        assert server.client.completions.create(model="tiny", prompt="Key", max_tokens=4,
                                                temperature=0).choices[0].text == alone(model, "Key", 4)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert not any("sekret-key" in line for line in server.lines)
    finally:
        server.stop()


def test_shutdown_at_the_deadline_ends_every_request(model, caplog):
    server = Server(model, settings={"shutdown_deadline_s": 1.0}, slots=1, max_queue=4, cache_length=128)
    server.delay_s = 0.05  # the stream would take 5 s
    events, plain = [], {}

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "Cut me", "max_tokens": 100, "stream": True,
                                "temperature": 0}) as reply:  # greedy: its 100 tokens hold no end-of-text
            events.extend(line for line in reply.iter_lines() if line.startswith("data:"))

    def waiting():
        plain["reply"] = httpx.post(server.url + "/v1/completions", timeout=60,
                                    json={"model": "tiny", "prompt": "Queued", "max_tokens": 5})

    with caplog.at_level(logging.WARNING):
        threads = [threading.Thread(target=stream), threading.Thread(target=waiting)]
        threads[0].start()
        while server.engine.live_slots == 0:
            time.sleep(0.01)
        threads[1].start()
        while server.engine.queue_depth == 0:
            time.sleep(0.01)
        start = time.monotonic()
        server.stop()
        for thread in threads:
            thread.join(timeout=30)
    assert time.monotonic() - start < 5
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert plain["reply"].status_code == 503 and "abort" in plain["reply"].json()["error"]["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_connections_are_bounded_in_number_and_in_time(model):
    server = Server(model, settings={"max_connections": 3, "header_timeout_s": 0.5}, slots=1, cache_length=128)
    host, port = server.url.removeprefix("http://").split(":")
    try:
        idle = [socket.create_connection((host, int(port))) for _ in range(2)]
        partial = socket.create_connection((host, int(port)))
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # and never the rest
        time.sleep(0.1)
        with socket.create_connection((host, int(port))) as extra:  # one more than the cap
            extra.settimeout(2)
            answer = extra.recv(65536)
            assert answer.startswith(b"HTTP/1.1 503") and b"max_connections" in answer and extra.recv(1) == b""
        for sock in [*idle, partial]:  # closed by the server after header_timeout_s
            sock.settimeout(2)
            assert sock.recv(1) == b""
            sock.close()
        reply = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "Open", "max_tokens": 3, "temperature": 0})
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == alone(model, "Open", 3)
    finally:
        server.stop()


def test_a_client_gone_mid_body_or_before_its_reply_is_counted_as_such(server, caplog):
    host, port = server.url.removeprefix("http://").split(":")
    before = counted(server, 499)
    with caplog.at_level(logging.WARNING):
        with socket.create_connection((host, int(port))) as sock:  # promises 1000 bytes, sends 10, leaves
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 1000\r\n\r\n{\"model\": ")
            time.sleep(0.2)
        server.delay_s = 0.05
        try:  # a plain request whose client leaves before the reply
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 60},
                           timeout=0.3)
            deadline = time.monotonic() + 5
            while counted(server, 499) < before + 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            server.delay_s = 0.0
    assert counted(server, 499) == before + 2
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def test_the_start_up_line_warns_of_a_public_address_served_without_a_key():
    def lines(**settings):
        return startup_lines(ServeConfig(**{"no_playground": True, **settings}), "tiny", 8000, 8, None)

    assert lines() == ["serving 'tiny' on http://127.0.0.1:8000/v1 (8 slots)"]
    assert lines(host="::1") == ["serving 'tiny' on http://::1:8000/v1 (8 slots)"]
    assert "no API key" in lines(host="0.0.0.0")[1] and "GPT_API_KEY" in lines(host="0.0.0.0")[1]
    assert lines(host="0.0.0.0", api_key="k") == ["serving 'tiny' on http://0.0.0.0:8000/v1 (8 slots, API key required)"]
    # With the playground (the default), its page's address after the rest.
    assert lines(no_playground=False) == ["serving 'tiny' on http://127.0.0.1:8000/v1 (8 slots)",
                                          "playground (in a browser): http://127.0.0.1:8000/"]


ACCEPT_SCRIPT = """
import asyncio, logging, resource, sys
logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(message)s")
from gpt.serve.server import _listen

async def main():
    listener = _listen("127.0.0.1", 0)  # serve.py's listening socket
    server = await asyncio.get_running_loop().create_server(asyncio.Protocol, sock=listener)  # holds them open
    resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
    print(server.sockets[0].getsockname()[1], flush=True)
    sys.stdin.readline()  # the client's connections are open
    start = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.sleep(3)
    end = resource.getrusage(resource.RUSAGE_SELF)
    print(f"cpu {end.ru_utime + end.ru_stime - start.ru_utime - start.ru_stime:.3f}", flush=True)

asyncio.run(main())
"""


@pytest.mark.slow
def test_out_of_descriptors_the_accept_loop_backs_off_with_one_line_a_second():
    process = subprocess.Popen([sys.executable, "-c", ACCEPT_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        port = int(process.stdout.readline())
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(80)]  # more than 48 descriptors
        process.stdin.write("\n")
        process.stdin.flush()
        out, err = process.communicate(timeout=bound(30))
    finally:
        process.kill()
        for client in locals().get("clients", []):
            client.close()
    cpu = float(out.split("cpu ")[1])
    warnings = [line for line in err.splitlines() if "out of file descriptors" in line]
    assert "Traceback" not in err and 1 <= len(warnings) <= 5 and cpu < 0.5, (cpu, err[-2000:])
