"""Training checkpoints: Orbax writes the bytes; this module decides which checkpoints can be trusted.

What a checkpoint under `out_dir/checkpoints/<step>` guarantees:

- **Complete or absent.** Orbax writes each step into a temporary directory and renames it into place
  only when every file is written, so a save cut short (a crash, `kill -9`, a full disk) is never listed.
- **Finite.** The training loop saves only after a step whose loss, gradient norm and updated parameters
  were all finite (the jitted step reports it); restoring checks finiteness again.
- **Checksummed.** Orbax does not verify array data on restore (tensorstore decodes whatever bytes are on
  disk), so each array's checksum is stored in the step's JSON metadata at save and compared after
  restore. The checksum is two 32-bit weighted sums of the array's bits, computed on the devices where the
  array lives: integer sums are exact in any order, so the value is the same on any mesh, and a
  checkpoint written on 8 devices verifies on 1.
- **Shapes before bytes.** A step's recorded shapes are compared with its stored arrays' before Orbax reads
  any: a read Orbax refuses midway leaves tasks behind that asyncio reports later, as tracebacks.
- **Fallback, never silent deletion.** A step that cannot be read, or whose checksums or finiteness do not
  hold, is reported in one line and moved aside to `out_dir/corrupt_checkpoints/`; the next newest step
  is tried.
- **Failed saves surface at once.** An asynchronous save that failed (a full disk, a permission) is
  raised by `check_for_errors()`, which the loop calls after every step, as one line that ends with the
  OS error (`DiskFull`, exit 2, where the disk filled; else `RunFailed`); the previous checkpoints are intact.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from gpt.errors import ConfigError, MissingInput, causes, first_line, write_failed
from gpt.model.config import GPTConfig, check_dtype
from gpt.model.sharding import abstract, replicated
from gpt.model.transformer import GPT
from gpt.train.fused_qkv import fused, unfused, written_fused
from gpt.train.step import all_finite

__all__ = ["CheckpointManager", "load_model", "newest_model_config", "checksums", "is_finite"]


# ------------------------------------------------------------------------------------------ checksums

def _bits_u32(x: jax.Array) -> jax.Array:
    """The array's bits, one uint32 per element (16- and 8-bit types widened)."""
    x = x.reshape(-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _leaf_checksum(x: jax.Array) -> jax.Array:
    """uint32 [2]: sum(bits * (2i + 1)) and sum(mix(bits) * odd(i)), both mod 2**32.

    Each weight is odd, so changing any one element always changes both sums."""
    bits = _bits_u32(x)
    i = jax.lax.iota(jnp.uint32, bits.size)
    first = jnp.sum(bits * (2 * i + 1), dtype=jnp.uint32)
    second = jnp.sum((bits ^ (bits >> 15)) * ((i * jnp.uint32(0x9E3779B1)) | 1), dtype=jnp.uint32)
    return jnp.stack([first, second])


def _replicated_like(tree):
    """Where small results of a computation over `tree` go: every device of its mesh (None: jit's default)."""
    sharding = next((leaf.sharding for leaf in jax.tree.leaves(tree) if hasattr(leaf, "sharding")), None)
    return replicated(sharding.mesh) if isinstance(sharding, jax.sharding.NamedSharding) else None


@functools.cache
def _jitted(function, out_sharding):
    """One jitted per-array reduction per (function, output placement). It compiles once per kind of array
    (shape, dtype, placement), shared by the parameters, both Adam moments and every later save and restore
    of the same model; a program over a whole tree would compile again for each tree."""
    return jax.jit(function, out_shardings=out_sharding)


def _of_each_leaf(function, tree) -> list[np.ndarray]:
    """`function` of every array in `tree`, computed where the array lives, each read before the next starts.

    One at a time because a reduction over a sharded array is a collective: XLA's CPU client, given scores of
    them in flight at once over one mesh, can leave a collective's participants waiting for each other until it
    aborts the process (seen within a few saves on 8 host devices; bench/RESULTS.md, "The suite's time on 2
    cores, and a deadlock in XLA's CPU collectives"). A read per array costs a round trip, small beside writing
    the array."""
    program = _jitted(function, _replicated_like(tree))
    return [np.asarray(program(x)) for x in jax.tree.leaves(tree)]


def checksums(tree) -> dict[str, list[int]]:
    """{leaf path: [sum1, sum2]} of every array in `tree`, computed where the arrays live (any mesh)."""
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(tree)]
    return {path: [int(v) for v in sums] for path, sums in zip(paths, _of_each_leaf(_leaf_checksum, tree))}


def is_finite(tree) -> bool:
    """True when every array in `tree` holds only finite values (`gpt.train.step.all_finite`, on its mesh)."""
    return all(bool(finite) for finite in _of_each_leaf(all_finite, tree))


def _first_mismatch(want: dict, got: dict) -> str | None:
    for path in sorted(set(want) | set(got)):
        if want.get(path) != got.get(path):
            return path
    return None


# ------------------------------------------------------------------------------------------ the manager

def _names(path) -> tuple[str, ...]:
    """A tree path's keys as text (a named tuple's field, as orbax stores it, is a dict key)."""
    return tuple(str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))) for key in path)


def _check_stored_shapes(item_dir: Path, target) -> None:
    """Raise ValueError naming the first array of `target` (abstract) whose shape differs from the one stored
    under `item_dir`, from orbax's metadata alone (no array is read)."""
    stored = ocp.StandardCheckpointHandler().metadata(item_dir).tree
    shapes = {_names(path): leaf.shape for path, leaf in jax.tree_util.tree_flatten_with_path(stored)[0]}
    for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        have = shapes.get(_names(path))
        if have is not None and tuple(have) != tuple(leaf.shape):
            raise ValueError(f"{item_dir.name}/{'/'.join(_names(path))} is recorded as {tuple(leaf.shape)}, "
                             f"stored as {tuple(have)}")


def _os_error(error: BaseException) -> BaseException:
    """The OSError behind `error` (`causes`), or `error` itself."""
    return next((cause for cause in causes(error) if isinstance(cause, OSError)), error)


class CheckpointManager:
    """Saves and restores {params, opt_state} + JSON metadata under `out_dir/checkpoints/<step>`, with the
    guarantees in this module's docstring."""

    def __init__(self, out_dir: str | os.PathLike, keep: int = 3, async_save: bool = True):
        self.out_dir = Path(out_dir).absolute()
        self.directory = self.out_dir / "checkpoints"
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._saving: int | None = None  # the step of the save in flight, for the error message

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params, opt_state, metadata: dict) -> None:
        """Start saving `step` (asynchronously); the arrays' checksums go into its metadata."""
        metadata = {**metadata, "checksums": {"params": checksums(params), "opt_state": checksums(opt_state)}}
        self.wait()  # Orbax would wait for the previous save too; a failure then is that save's, not this one's
        self._saving = step
        try:
            self.manager.save(step, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
                metadata=ocp.args.JsonSave(metadata),
            ), force=True)
        except Exception as error:
            raise self._save_failed(error) from error

    def check_for_errors(self) -> None:
        """Raise the failure (`_save_failed`) of a save that ran in the background, if it failed."""
        try:
            self.manager.check_for_errors()
        except Exception as error:
            raise self._save_failed(error) from error

    def wait(self) -> None:
        try:
            self.manager.wait_until_finished()
        except Exception as error:
            raise self._save_failed(error) from error

    def _save_failed(self, error: BaseException) -> Exception:
        """The failure of the save in flight, after its temporary directory is removed (on a full disk, that
        frees the room it took): `DiskFull` where the disk filled, else RunFailed."""
        for partial in self.directory.glob(f"{self._saving}.orbax-checkpoint-tmp*"):
            shutil.rmtree(partial, ignore_errors=True)
        self.manager.reload()
        last = self.latest_step()
        kept = (f"the last complete checkpoint is step {last}" if last is not None else
                "no checkpoint was saved before it: a restart starts from step 0")
        return write_failed(error, f"saving checkpoint step {self._saving} to {self.directory} failed; {kept}; the "
                                   f"cause: {_os_error(error)}")

    def close(self) -> None:
        """Finish pending saves and release Orbax's threads; a failed save is raised (`_save_failed`)."""
        try:
            self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:  # the failure, if any, was raised by wait() above
                pass

    def metadata(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(metadata=ocp.args.JsonRestore()))["metadata"]

    def newest_metadata(self) -> tuple[int, dict] | None:
        """(step, metadata) of the newest step whose metadata can be read as a JSON object, or None if there is
        none."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                metadata = self.metadata(step)
            except Exception:  # unreadable metadata: restore_newest_intact reports and moves it aside
                continue
            if isinstance(metadata, dict):  # else as unreadable (a list had reached callers' .get)
                return step, metadata
        return None

    def check_trained_on(self, data_identity: str, data_dir: str | os.PathLike, advice: str) -> None:
        """ConfigError ending with `advice` when the newest checkpoint was trained on other prepared shards than
        `data_dir`'s, whose identity is `data_identity` (`gpt.data.shards.verify_shards`). A checkpoint from
        before shards had checksums records none, and passes."""
        newest = self.newest_metadata()
        trained_on = None if newest is None else newest[1].get("data_identity")
        if trained_on is not None and trained_on != data_identity:
            raise ConfigError(f"the prepared shards in {data_dir} are not those step {newest[0]} was trained on "
                              f"(their checksums differ); {advice}")

    def _restore_verified(self, step: int, trees: dict, shardings: dict) -> tuple[dict, dict]:
        """Restore the named trees of `step` onto `shardings` and verify them; raises ValueError with the
        reason when a checksum or finiteness check fails (reading errors propagate as they are). A step of a
        run that kept one `qkv_kernel` is restored as it was written, verified, then split (`fused_qkv`)."""
        older = written_fused(self.metadata(step))
        targets = {name: abstract(tree, shardings[name]) for name, tree in trees.items()}
        targets = {name: fused(target) if older else target for name, target in targets.items()}
        for name, target in targets.items():
            _check_stored_shapes(self.directory / str(step) / name, target)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            metadata=ocp.args.JsonRestore(),
            **{name: ocp.args.StandardRestore(target) for name, target in targets.items()},
        ))
        metadata = restored["metadata"]
        saved = metadata.get("checksums") if isinstance(metadata, dict) else None
        for name in trees:
            if not isinstance(saved, dict) or not isinstance(saved.get(name), dict):
                raise ValueError(f"its record holds no checksums of {name}: it cannot be verified")
            path = _first_mismatch(saved[name], checksums(restored[name]))
            if path is not None:
                raise ValueError(f"checksum mismatch in {name}{path}")
            if not is_finite(restored[name]):
                raise ValueError(f"non-finite values in {name}")
        if older:
            return {name: unfused(restored[name], shardings[name]) for name in trees}, metadata
        return {name: restored[name] for name in trees}, metadata

    def restore_newest_intact(self, trees: dict, shardings: dict, log=print) -> tuple[int, dict, dict] | None:
        """(step, restored trees, metadata) of the newest step that reads and verifies, moving every newer
        corrupt step aside with one line of `log`; None when no step is left.

        `trees` ({"params": ..., "opt_state": ...}) gives the structure; `shardings` where each goes.
        """
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                restored, metadata = self._restore_verified(step, trees, shardings)
                problem = None
            except Exception as error:  # a corrupt step fails in many ways; none of them may stop a resume
                problem = f"{type(error).__name__}: {first_line(error)}"
            if jax.process_count() > 1:  # every process must take the same step
                failed = multihost_utils.process_allgather(np.int32(problem is not None))
                problem = problem or ("unreadable on another process" if failed.any() else None)
            if problem is None:
                return step, restored, metadata
            moved = self._move_aside(step)
            log(f"checkpoint step {step} is corrupt ({problem}); moved it to {moved}; trying the previous one")
        return None

    def _move_aside(self, step: int) -> Path:
        target = self.out_dir / "corrupt_checkpoints" / str(step)
        suffix = 1
        while target.exists():
            target, suffix = self.out_dir / "corrupt_checkpoints" / f"{step}.{suffix}", suffix + 1
        if jax.process_index() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(self.directory / str(step)), str(target))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"gpt: checkpoint {step} moved aside")
        self.manager.reload()
        return target


def newest_model_config(out_dir: str | os.PathLike) -> GPTConfig:
    """The GPTConfig its newest finished checkpoint records (no weights read); MissingInput where it has none."""
    manager = CheckpointManager(out_dir, async_save=False)
    try:
        newest = manager.newest_metadata()
    finally:
        manager.close()
    if newest is None:
        raise MissingInput(f"no finished checkpoint in {manager.directory}")
    return GPTConfig(**newest[1]["model_config"])


def load_model(out_dir: str | os.PathLike, step: int | None = None, dtype: str | None = None) -> GPT:
    """The GPT of a training run's newest intact (or given) checkpoint, on the default device.

    Checksums and finiteness are verified; a corrupt newest step is skipped with a warning (not moved:
    reading a run never changes it)."""
    if dtype is not None:
        check_dtype(dtype)  # the caller's, not a checkpoint's fault: never "no intact checkpoint"
    manager = CheckpointManager(out_dir, async_save=False)
    try:
        saved = sorted(manager.manager.all_steps(), reverse=True)
        if not saved:
            raise MissingInput(f"no finished checkpoint in {manager.directory}")
        if step is not None and step not in saved:
            raise MissingInput(f"no checkpoint of step {step} in {manager.directory}; the saved steps are "
                               f"{', '.join(map(str, sorted(saved)))}")
        steps = saved if step is None else [step]
        problems = []
        for candidate in steps:
            try:
                config = GPTConfig(**manager.metadata(candidate)["model_config"])
                if dtype is not None:
                    config = dataclasses.replace(config, dtype=dtype)
                graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))))
                abstract = nnx.to_pure_dict(state)
                sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
                restored, _ = manager._restore_verified(
                    candidate, {"params": abstract}, {"params": jax.tree.map(lambda _: sharding, abstract)})
            except Exception as error:  # corrupt: say so, try an older step
                problems.append(f"step {candidate}: {type(error).__name__}: {first_line(error, 200)}")
                continue
            for problem in problems:
                print(f"warning: skipped corrupt checkpoint {problem}", flush=True)
            return nnx.merge(graphdef, restored["params"])
        raise MissingInput(f"no intact checkpoint in {manager.directory}: " + "; ".join(problems))
    finally:
        manager.close()


def config_to_json(config) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(config)))
