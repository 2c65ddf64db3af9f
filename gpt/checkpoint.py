"""Training checkpoints with Orbax: params, optimizer state and metadata (step, loader state, configs).

Orbax writes each step into a temporary directory and renames it only when complete, so a save cut short
(by a crash or a kill) is never picked up as the latest step. Arrays are restored onto whatever shardings
the caller asks for, so a checkpoint written on 8 devices restores on 1 and the other way round.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

from gpt.config import GPTConfig
from gpt.model import GPT

__all__ = ["CheckpointManager", "load_model", "has_checkpoint"]


def _abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


class CheckpointManager:
    """Saves and restores {params, opt_state} + JSON metadata under `out_dir/checkpoints/<step>`."""

    def __init__(self, out_dir: str | os.PathLike, keep: int = 3, async_save: bool = True):
        self.directory = Path(out_dir).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params, opt_state, metadata: dict, wait: bool = False) -> None:
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
            metadata=ocp.args.JsonSave(metadata),
        ), force=True)
        if wait:
            self.manager.wait_until_finished()

    def restore(self, step: int, params, opt_state, param_shardings, opt_shardings):
        """(params, opt_state, metadata) of `step`, placed on the given shardings. `params` and
        `opt_state` give the structure (their values are not read)."""
        restored = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(params, param_shardings)),
            opt_state=ocp.args.StandardRestore(_abstract(opt_state, opt_shardings)),
            metadata=ocp.args.JsonRestore(),
        ))
        return restored["params"], restored["opt_state"], restored["metadata"]

    def metadata(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))["metadata"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def has_checkpoint(out_dir: str | os.PathLike) -> bool:
    directory = Path(out_dir) / "checkpoints"
    return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())


def load_model(out_dir: str | os.PathLike, step: int | None = None, dtype: str | None = None) -> GPT:
    """The GPT of a training run's latest (or given) checkpoint, on the default device."""
    manager = CheckpointManager(out_dir, async_save=False)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint in {manager.directory}")
        metadata = manager.metadata(step)
        config = GPTConfig(**metadata["model_config"])
        if dtype is not None:
            config = dataclasses.replace(config, dtype=dtype)
        model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
        graphdef, state = nnx.split(model)
        abstract = nnx.to_pure_dict(state)
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        restored = manager.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_abstract(abstract, jax.tree.map(lambda _: sharding, abstract))),
        ))
        return nnx.merge(graphdef, restored["params"])
    finally:
        manager.close()


def config_to_json(config) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(config)))
