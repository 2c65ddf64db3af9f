"""Train-step time and per-device bytes on meshes of fake CPU devices: a check that sharding duplicates
nothing (every device holds 1/(fsdp x tensor) of the state, the total work stays flat), not a speed figure.

    python bench/mesh_scaling.py            # sets 8 fake CPU devices itself
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from gpt.model.config import GPTConfig  # noqa: E402
from gpt.model.sharding import bytes_per_device, make_mesh  # noqa: E402
from gpt.model.transformer import GPT, num_params  # noqa: E402
from gpt.train.optimizer import OptimizerConfig  # noqa: E402
from gpt.train.step import init_train_state, make_train_step  # noqa: E402

MESHES = [(1, 1, 1), (8, 1, 1), (2, 2, 2), (1, 2, 4), (1, 1, 8), (1, 8, 1)]


def main() -> None:
    config = GPTConfig.preset("small", n_layer=4, n_head=8, n_embd=256, vocab_size=50304)  # 50304 = 8 x 6288
    optimizer = OptimizerConfig(max_steps=100)
    batch = np.random.default_rng(0).integers(0, 50257, (1, 8, 129), dtype=np.int32)
    print(f"# {num_params(config):,} params, batch 8 x 128, float32; {jax.device_count()} fake CPU devices "
          f"sharing {os.cpu_count()} cores")
    print("| mesh (data, fsdp, tensor) | ms/step | params + Adam state per device (MiB) | x of one device |")
    print("| --- | --- | --- | --- |")
    single = None
    for shape in MESHES:
        mesh = make_mesh(*shape, devices=jax.devices()[: int(np.prod(shape))])
        graphdef, params, opt_state, shardings = init_train_state(GPT(config, rngs=nnx.Rngs(0)), optimizer, mesh)
        stored = max(bytes_per_device((params, opt_state)).values())
        step = make_train_step(graphdef, optimizer, dropout=False, mesh=mesh, shardings=shardings)
        for i in range(2):
            params, opt_state, metrics = step(params, opt_state, batch, jax.random.key(i))
        float(metrics["loss"])
        start = time.perf_counter()
        for i in range(5):
            params, opt_state, metrics = step(params, opt_state, batch, jax.random.key(i))
        float(metrics["loss"])
        seconds = (time.perf_counter() - start) / 5
        single = single or stored
        print(f"| {shape} | {seconds * 1e3:.0f} | {stored / 2**20:.1f} | {stored / single:.3f} |")


if __name__ == "__main__":
    main()
