"""The train step's memory by configuration, from the compiled program alone (nothing runs): XLA's buffer
assignment for the step's temporaries (activations kept for the backward pass, gradients, workspace) and
its arguments, for each of scan_layers x remat.

    python bench/step_memory.py                                  # GPT-2 124M, micro-batch 8 x 1024, bfloat16
    python bench/step_memory.py --micro_batch 32 --accumulation 16   # gpu_bench's shape (on a GPU: its own assignment)

On a CPU this is the CPU compiler's assignment, not a GPU's; it shows what each knob keeps, which is the
same program on either.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import tyro
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt.model.config import GPTConfig  # noqa: E402
from gpt.model.sharding import make_mesh  # noqa: E402
from gpt.model.transformer import GPT  # noqa: E402
from gpt.train.optimizer import OptimizerConfig  # noqa: E402
from gpt.train.step import init_train_state, make_train_step  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Args:
    preset: str = "gpt2"
    micro_batch: int = 8
    block_size: int = 1024
    accumulation: int = 1
    dtype: str = "bfloat16"
    scan_layers: tuple[bool, ...] = (False, True)
    remat: tuple[bool, ...] = (False, True)


def step_memory(args: Args, scan_layers: bool, remat: bool) -> dict:
    """{temp, arguments} bytes of the compiled train step at `args`' shape."""
    config = GPTConfig.preset(args.preset, block_size=max(args.block_size, 1024), dtype=args.dtype,
                              scan_layers=scan_layers, remat=remat)
    optimizer = OptimizerConfig(max_steps=1000)
    mesh = make_mesh(devices=jax.devices()[:1])
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(model)
    abstract = jax.eval_shape(lambda: init_train_state(GPT(config, rngs=nnx.Rngs(0)), optimizer, mesh)[1:3])
    step = make_train_step(graphdef, optimizer, dropout=False, mesh=mesh,
                           shardings=jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]),
                                                  abstract))
    batch = jax.ShapeDtypeStruct((args.accumulation, args.micro_batch, args.block_size + 1), jnp.int32)
    with jax.set_mesh(mesh):
        lowered = step.jitted.lower(*abstract, batch, jax.random.key(0), jnp.zeros(2, jnp.float32))
    analysis = lowered.compile().memory_analysis()
    return {"temp": analysis.temp_size_in_bytes, "arguments": analysis.argument_size_in_bytes}


def main(args: Args) -> None:
    print(f"# {args.preset}, micro-batch {args.micro_batch} x block {args.block_size} x {args.accumulation}, "
          f"{args.dtype}; {jax.devices()[0].device_kind}")
    print("| scan_layers | remat | temporaries (GiB) | arguments (GiB) |\n| --- | --- | --- | --- |")
    for scan_layers, remat in itertools.product(args.scan_layers, args.remat):
        memory = step_memory(args, scan_layers, remat)
        print(f"| {scan_layers} | {remat} | {memory['temp'] / 2**30:.2f} | {memory['arguments'] / 2**30:.2f} |",
              flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
