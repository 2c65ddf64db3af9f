"""llama.cpp as a peer of the CPU benches: built from source by bench/llama_cpp.sh, fed the GGUF that its own
converter makes of a bench's HF directory, run as llama-batched-bench (decode speed) and llama-server (the
serving load, and greedy tokens to check against ours)."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent


def build() -> tuple[Path, Path]:
    """(build directory, source directory), building llama.cpp the first time (minutes on 2 cores)."""
    lines = subprocess.run(["bash", str(BENCH / "llama_cpp.sh")], check=True, capture_output=True,
                           text=True).stdout.split()
    return Path(lines[0]), Path(lines[1])


# What llama-quantize makes from the f32 GGUF (the converter writes f32 and q8_0 itself).
QUANTIZED_TYPES = ("Q4_K_M", "Q4_0")


def convert(hf_directory: Path, outtype: str) -> Path:
    """The GGUF (`outtype` f32, q8_0, or one of QUANTIZED_TYPES) of a GPT-2 or Llama HF directory that holds
    GPT-2's tokenizer (`sample_bench.write_gpt2_vocab`), by llama.cpp's own converter (and its llama-quantize)."""
    build_dir, source = build()
    out = Path(hf_directory) / f"model-{outtype}.gguf"
    if out.exists():
        return out
    if outtype in QUANTIZED_TYPES:
        subprocess.run([str(build_dir / "bin" / "llama-quantize"), str(convert(hf_directory, "f32")), str(out),
                        outtype], check=True, capture_output=True)
        return out
    config_path = Path(hf_directory) / "config.json"
    config = json.loads(config_path.read_text())
    if "n_positions" in config:
        config.setdefault("n_ctx", config["n_positions"])  # the converter's gpt2 reads n_ctx
    config_path.write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(hf_directory), "--outfile",
                    str(out), "--outtype", outtype], check=True, env=env, capture_output=True)
    return out


@functools.cache
def repacks(gguf: Path) -> bool:
    """Whether llama.cpp runs `gguf` with its weights repacked for this CPU (its default). Where the repacked path
    crashes (seen: Gemma 3 in q8_0 on a Xeon with AMX, llama-cpp-python 0.3.36's source), every run of that file
    goes without (`--no-repack`), and the benches' rows say so."""
    binary = build()[0] / "bin" / "llama-batched-bench"
    probe = subprocess.run([str(binary), "-m", str(gguf), "-c", "64", "-npp", "8", "-ntg", "2", "-npl", "1"],
                           capture_output=True, text=True)
    return probe.returncode >= 0


def _repack_flags(gguf: Path) -> list[str]:
    return [] if repacks(gguf) else ["--no-repack"]


def batched_bench(gguf: Path, prompt_tokens: int, new_tokens: int, batches: list[int], threads: int) -> dict:
    """llama-batched-bench: for each batch, (prefill seconds, tokens/s) with tokens/s = batch * new_tokens over
    the prefill and decode time together (as ours is measured); each row its own prompt."""
    binary = build()[0] / "bin" / "llama-batched-bench"
    context = max(batches) * (prompt_tokens + new_tokens)
    out = subprocess.run([str(binary), "-m", str(gguf), "-c", str(context), "-b", "2048", "-ub", "512",
                          "-npp", str(prompt_tokens), "-ntg", str(new_tokens), "-npl", ",".join(map(str, batches)),
                          "-t", str(threads), "--output-format", "jsonl", *_repack_flags(gguf)], check=True,
                         capture_output=True, text=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{") and '"pl"' in line]
    return {row["pl"]: (row["t_pp"], row["pl"] * row["tg"] / row["t"]) for row in rows}


class LlamaServer:
    """llama-server on an ephemeral port of 127.0.0.1 with `slots` parallel sequences of `slot_context`
    positions each; a context manager that stops it."""

    def __init__(self, gguf: Path, slots: int, slot_context: int, threads: int):
        binary = build()[0] / "bin" / "llama-server"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-np", str(slots),
             "-c", str(slots * slot_context), "-t", str(threads), "--no-webui", *_repack_flags(gguf)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.process.returncode}")
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("llama-server did not become ready in 120 s")

    def greedy_tokens(self, prompt: list[int], new_tokens: int) -> list[int]:
        reply = httpx.post(f"{self.url}/completion", timeout=300, json={
            "prompt": prompt, "n_predict": new_tokens, "temperature": 0, "top_k": 1, "cache_prompt": False,
            "return_tokens": True, "ignore_eos": True, "samplers": ["top_k"]}).json()
        return reply["tokens"]

    def stream(self, prompt: list[int], max_tokens: int):
        """Greedy decoding of `prompt` streamed: each event's new token ids, as they arrive."""
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "samplers": ["top_k"],
                "ignore_eos": True, "stream": True, "return_tokens": True}
        with httpx.stream("POST", f"{self.url}/completion", json=body, timeout=600) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: ") and (tokens := json.loads(line[6:]).get("tokens")):
                    yield tokens

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
