"""Memory that the arithmetic can find is checked before it is allocated: an engine's keys and values (slots x
cache length, and the prefix cache's positions) against the devices' memory, in the library and by serve.py
before it loads anything; and a TPU topology larger than any there is, before its devices are laid out."""

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from flax import nnx

from gpt import GPT, GPTConfig
from gpt.errors import ConfigError
from gpt.hardware import parse_topology
from gpt.inference.engine import Engine
from gpt.inference.engine_settings import EngineSettings

from bounds import bound

ROOT = Path(__file__).resolve().parents[1]


def test_keys_and_values_past_the_devices_memory_are_one_line_from_the_arithmetic():
    config = GPTConfig.preset("gpt2")
    position = 12 * 2 * 12 * 64 * 4  # layers x (k, v) x heads x head size x float32's bytes
    settings = EngineSettings(slots=100_000).checked(config)
    assert settings.state_bytes(config) == position * 100_000 * 1024
    with pytest.raises(ConfigError, match=r"^100000 slots of 1024 positions: the decoding slots' cache needs 7,031.25 "
                                          r"GiB per device \(their keys and values\), over the cpu's [\d,.]+ GiB: "
                                          r"use fewer slots$"):
        settings.check_state_fits(config, jax.devices()[:1], "use fewer slots")
    with pytest.raises(ConfigError, match=r"^8 slots of 1024 positions and 10000000000 prefix-cache positions: .* "
                                          r"686,6.* GiB .*, or fewer --prefix_cache_tokens$"):
        EngineSettings(prefix_cache_tokens=10 ** 10).checked(config).check_state_fits(config, jax.devices()[:1], "x")
    EngineSettings(slots=8).checked(config).check_state_fits(config, jax.devices()[:1], "x")  # fits: nothing said


def test_an_engine_refuses_them_before_it_allocates():
    model = GPT(GPTConfig.preset("tiny"), rngs=nnx.Rngs(0))
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"^1000000000 slots of 64 positions: the decoding slots' cache needs"):
        Engine(model, slots=10 ** 9)
    assert time.monotonic() - start < 5


def test_a_topology_larger_than_any_is_one_line_at_once():
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"^TPU topology 'v5e-256x100000' is 25,600,000 chips, more than the 65,536"):
        parse_topology("v5e-256x100000")
    assert parse_topology("v5e-256x256").chips == 256 and time.monotonic() - start < 1


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--slots", "100000"], ["--prefix_cache_tokens", "10000000000"],
                                   ["--compile_only", "v5e-256x100000"]], ids=["slots", "prefix cache", "topology"])
def test_serve_py_refuses_them_within_seconds_and_little_memory(tmp_path, flags):
    """serve.py on a tiny GPT-2 of a 1,024-position context: one line, exit 2, within 15 s and under 2 GiB of the
    host's memory (a GPT-2 run had been refused after 77 s and 8.4 GiB; a Llama had passed 10 GiB in silence)."""
    from gpt.model import gpt2

    tiny = GPTConfig.preset("tiny", vocab_size=50257, block_size=1024)
    directory = gpt2.save(GPT(tiny, rngs=nnx.Rngs(0)), tmp_path / "model")
    # Its own peak: VmHWM, this process's high-water mark since its exec (ru_maxrss would carry the forking
    # pytest worker's over into the child).
    peak = ("import atexit, re, runpy, sys; atexit.register(lambda: print('peak KiB', re.search(r'VmHWM:\\s*(\\d+)', "
            "open('/proc/self/status').read()).group(1), file=sys.stderr)); sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", peak, "serve.py", "--init_from", str(directory), "--port", "0",
                           *flags], cwd=ROOT, capture_output=True, text=True, timeout=bound(120),
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    seconds = time.monotonic() - start
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and lines[-2].startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    assert seconds < 15 and int(lines[-1].split()[-1]) < 2 * 2 ** 20, (seconds, lines[-1])
