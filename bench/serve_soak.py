"""Soak `serve.py` with a long mix of ordinary and hostile clients, and check that it stays whole.

One `serve.py` process (a tiny model with GPT-2's vocabulary, random weights, saved to a temp directory)
takes `--requests` requests from `--clients` concurrent clients, each request one of: a plain completion,
a streamed one, a malformed or hostile body, a stream whose client leaves after a few events, a stream
read slowly, a plain request whose client gives up (a cancellation, waiting or running), an idle
connection that never sends a request, and an unauthenticated one (the server runs with an API key).

It reports, and exits 1 unless all hold: no 5xx; every status as the request's kind expects; the slots and
the queue back to 0 at the end; the server's resident memory after the first tenth of the requests (its
warm state) and at the end, and the growth between (target under 5%); no traceback in the server's log.

    python bench/serve_soak.py --requests 10000 --clients 32
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

from serve_process import start_serve

KEY = "soak-key"
MALFORMED = [b"{", b"[]", b"null", b'{"model": "tiny"}', b'{"model": "tiny", "prompt": 1e999}',
             b'{"model": "tiny", "prompt": "x", "max_tokens": 1' + b"0" * 400 + b"}",
             b'{"model": "tiny", "prompt": "x", "n": 1' + b"0" * 5000 + b"}",
             b'{"model": "tiny", "prompt": ' + b"[" * 200 + b"]" * 200 + b"}",
             b'{"model": "tiny", "prompt": "x", "temperature": NaN}', b"\xff\xfe\x00",
             json.dumps({"model": "tiny", "prompt": "x" * 200_000}).encode(),
             json.dumps({"model": "tiny", "prompt": [50257]}).encode(),
             json.dumps({"model": "tiny", "prompt": "x", "stop": ["s" * 300]}).encode()]
KINDS = {"plain": 40, "stream": 20, "malformed": 15, "leaves": 8, "slow_reader": 4, "gives_up": 6, "idle": 4,
         "no_key": 3}


def save_model(directory: Path) -> None:
    import jax
    from flax import nnx

    from gpt import GPT, GPTConfig
    from gpt.model import gpt2

    model = GPT(GPTConfig.preset("tiny", vocab_size=50257, block_size=128), rngs=nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda p: p * 4.0 if p.ndim >= 2 else p, nnx.state(model, nnx.Param)))
    gpt2.save(model, directory)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def one(client: httpx.AsyncClient, url: str, kind: str, rng: random.Random) -> str:
    """Run one request of `kind`; returns what happened (a status, or how the client ended it)."""
    auth = {"authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": rng.choice(["Hello", "def main(", "The soak", "x " * 40]),
            "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0.0, 0.8])}
    if kind == "plain":
        return str((await client.post(url + "/v1/completions", json=body, headers=auth)).status_code)
    if kind == "malformed":
        reply = await client.post(url + "/v1/completions", content=rng.choice(MALFORMED),
                                  headers={**auth, "content-type": "application/json"})
        return str(reply.status_code)
    if kind == "no_key":
        return str((await client.post(url + "/v1/completions", json=body)).status_code)
    if kind in ("stream", "leaves", "slow_reader"):
        async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True,
                                                                         "max_tokens": body["max_tokens"] + 8},
                                 headers=auth) as reply:
            events = 0
            async for line in reply.aiter_lines():
                if line.startswith("data:"):
                    events += 1
                    if kind == "leaves" and events == 2:
                        return "left"
                    if kind == "slow_reader":
                        await asyncio.sleep(0.05)
                    if line == "data: [DONE]":
                        return str(reply.status_code)
            return f"{reply.status_code} without [DONE]"
    if kind == "gives_up":
        try:
            reply = await client.post(url + "/v1/completions", json={**body, "max_tokens": 64}, headers=auth,
                                      timeout=rng.uniform(0.01, 0.3))
            return str(reply.status_code)
        except httpx.TimeoutException:
            return "gave up"
    if kind == "idle":
        host, port = url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        await asyncio.sleep(rng.uniform(0.05, 0.5))  # then leaves (the server also closes it after 10 s)
        writer.close()
        return "idle"
    raise ValueError(kind)


EXPECTED = {"plain": {"200"}, "stream": {"200"}, "malformed": {"400", "413"}, "leaves": {"left", "200"},
            "slow_reader": {"200"}, "gives_up": {"200", "gave up"}, "idle": {"idle"}, "no_key": {"401"}}


async def soak(url: str, requests: int, clients: int, pid: int, seed: int) -> dict:
    rng = random.Random(seed)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=requests)
    outcomes: collections.Counter = collections.Counter()
    unexpected: collections.Counter = collections.Counter()
    done, warm_rss = 0, None
    queue: asyncio.Queue = asyncio.Queue()
    for kind in kinds:
        queue.put_nowait(kind)

    async def worker(index: int):
        nonlocal done, warm_rss
        own = random.Random(seed * 1000 + index)
        async with httpx.AsyncClient(timeout=60) as client:
            while not queue.empty():
                kind = queue.get_nowait()
                outcome = await one(client, url, kind, own)
                outcomes[(kind, outcome)] += 1
                if outcome not in EXPECTED[kind]:
                    unexpected[(kind, outcome)] += 1
                done += 1
                if done == requests // 10:
                    warm_rss = rss_kb(pid)

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(clients)))
    wall = time.perf_counter() - start
    async with httpx.AsyncClient() as client:
        for _ in range(100):  # the last cancellations free their slots at the engine's next round
            health = (await client.get(url + "/health")).json()
            if health["live_slots"] == 0 and health["queue_depth"] == 0:
                break
            await asyncio.sleep(0.1)
    return {"outcomes": outcomes, "unexpected": unexpected, "wall": wall, "health": health,
            "warm_rss_kb": warm_rss, "end_rss_kb": rss_kb(pid)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp) / "model")
        log_path = Path(tmp) / "serve.log"
        try:
            server, url = start_serve(Path(tmp) / "model", "--model_name", "tiny", "--slots", "8", "--max_queue", "64",
                                      "--no-compile_cache", log_path=log_path,
                                      env={**os.environ, "JAX_PLATFORMS": "cpu", "GPT_API_KEY": KEY})
        except RuntimeError as error:
            sys.exit(str(error))
        try:
            result = asyncio.run(soak(url.removesuffix("/v1"), args.requests, args.clients, server.pid, args.seed))
        finally:
            server.terminate()
            code = server.wait(timeout=60)
        text = log_path.read_text()
    fives = sum(n for (_, outcome), n in result["outcomes"].items() if outcome.startswith("5"))
    growth = (result["end_rss_kb"] - result["warm_rss_kb"]) / result["warm_rss_kb"]
    print(f"{args.requests} requests from {args.clients} clients in {result['wall']:.0f} s "
          f"({args.requests / result['wall']:.0f} requests/s)")
    print("| kind | outcome | count |\n| --- | --- | --- |")
    for (kind, outcome), n in sorted(result["outcomes"].items()):
        print(f"| {kind} | {outcome} | {n} |")
    print(f"5xx: {fives}; unexpected outcomes: {dict(result['unexpected']) or 'none'}")
    print(f"at the end: {result['health']['live_slots']} live slots, {result['health']['queue_depth']} waiting")
    print(f"server RSS: {result['warm_rss_kb'] / 1024:.0f} MiB after the first {args.requests // 10} requests, "
          f"{result['end_rss_kb'] / 1024:.0f} MiB at the end ({growth:+.1%})")
    print(f"server log: {text.count('Traceback')} tracebacks, {len(text.splitlines())} lines; exit {code} on SIGTERM")
    ok = (not fives and not result["unexpected"] and result["health"]["live_slots"] == 0
          and result["health"]["queue_depth"] == 0 and "Traceback" not in text and growth < 0.05)
    if not ok:
        print(text[-4000:])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
