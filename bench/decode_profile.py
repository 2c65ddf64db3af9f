"""Where a decode step's time goes: the engine's decoding of a batch traced with JAX's profiler, then
`bench/step_profile.py`'s table of it (per token: time by category, ops a token, idle gaps).

    python bench/decode_profile.py --dtype bfloat16 --batch 1     # GPT-2 124M's shape, random weights
    python bench/decode_profile.py --smoke                        # tiny shapes on any device (the suite)
    python bench/decode_profile.py --variant all+chunk16          # with sample_bench's decode levers

The engine (what `generate`, `sample.py` and `serve.py` run) decodes `batch` prompts of `prompt_tokens`
for `new_tokens` tokens, once untimed (every program compiled and run) and once traced; the trace
directory holds the decode call's optimized HLO, so each op is sorted by the code it came from. The
prefills' ops are `other programs`. On a GPU, `idle` is the time the device waited for the host: the
decode loop's condition read back, and the launches between calls.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import jax
import numpy as np
import tyro
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import step_profile  # noqa: E402

from gpt.inference import device_slots  # noqa: E402
from gpt.inference.engine import Engine  # noqa: E402
from gpt.inference.request import Request  # noqa: E402
from gpt.inference.sampling import GREEDY  # noqa: E402
from gpt.model.config import GPTConfig  # noqa: E402
from gpt.model.transformer import GPT  # noqa: E402
from gpt.train.checkpoint import config_to_json  # noqa: E402
from gpt.train.profile import StepTrace  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Args:
    out: str = "decode_profile"
    """The trace's directory."""
    preset: str = "gpt2"
    smoke: bool = False
    """A tiny model, a short decode: the code path on a CPU, not a figure."""
    dtype: str = "float32"
    batch: int = 1
    prompt_tokens: int = 64
    new_tokens: int = 128
    steps_per_call: int = 1
    """Decode steps a device call (serve.py's default is 1; generate runs all in one call)."""
    variant: str = "baseline"
    """sample_bench's decode levers (`decode_levers()`) to run with: this process starts again with them, as
    XLA reads its flags when it starts."""


def decode_program_text(engine: Engine, num_steps: int) -> str:
    """The optimized HLO of the engine's decode call over all of its slots."""
    device = engine.device
    with device.on_mesh():
        return device_slots.compiled_decode.lower(device.config, device.weights, device.slots, np.int32(num_steps),
                                              np.bool_(False), max_steps=device.max_steps).compile().as_text()


def with_variant(args: Args) -> None:
    """Start this process again with `args.variant`'s levers, unless it runs with them already."""
    from sample_bench import decode_levers

    levers = decode_levers()
    levers.check([args.variant])
    if args.variant != "baseline" and os.environ.get("DECODE_PROFILE_VARIANT") != args.variant:
        env = {**os.environ, **levers.env(args.variant), "DECODE_PROFILE_VARIANT": args.variant}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main(args: Args) -> str:
    with_variant(args)
    if args.smoke:
        args = dataclasses.replace(args, preset="tiny", prompt_tokens=8, new_tokens=6)
    config = GPTConfig.preset(args.preset, dtype=args.dtype)
    engine = Engine(GPT(config, rngs=nnx.Rngs(0)), slots=args.batch, cache_length=args.prompt_tokens + args.new_tokens,
                    steps_per_call=args.steps_per_call)
    engine.warmup(log=lambda line: None)
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.prompt_tokens)).tolist()

    def decode_all():
        completions = [engine.submit(Request(prompt, args.new_tokens, GREEDY)) for prompt in prompts]
        engine.run(completions)
        jax.block_until_ready(engine.device.slots)

    decode_all()  # untimed: every program compiled and run once
    trace = StepTrace(args.out)
    trace.start()
    decode_all()
    trace.stop(args.new_tokens, {"model": config_to_json(config), "decode_rows": args.batch},
               decode_program_text(engine, args.steps_per_call))
    return step_profile.main(step_profile.Args(trace=args.out))


if __name__ == "__main__":
    print(main(tyro.cli(Args)))
