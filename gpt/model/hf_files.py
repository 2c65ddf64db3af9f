"""Hugging Face checkpoint directories as files: their safetensors read (one file, or shards and their index),
and an export written whole or not at all. What the tensors and config.json mean is each model family's
module's business (`gpt.model.gpt2`, `gpt.model.llama`)."""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import tempfile
from pathlib import Path

import jax
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from gpt.errors import ConfigError, MissingInput, first_line, write_failed
from gpt.run_tokenizer import END_OF_TURN
from gpt.tokenizer_json import FILES as TOKENIZER_JSON_FILES

__all__ = ["hub_snapshot", "read_config_json", "read_json_file", "read_safetensors", "check_weight_files",
           "header_shapes", "check_tensor_shapes", "write_export"]

_WEIGHTS, _INDEX = "model.safetensors", "model.safetensors.index.json"
_MAX_JSON_BYTES = 16 << 20  # a config.json or a shard index is kilobytes; a larger one is no model's
# What an export of ours holds: config.json and the weights, and the tokenizer's files where it has them.
_EXPORT_FILES = {"config.json", _WEIGHTS}
# The tokenizer files an export may hold beside its weights: GPT-2's (`gpt.tokenizer.hf_tokenizer_files`), or a
# model's own tokenizer.json, with its tokenizer_config.json where it has one (`gpt.tokenizer_json.FILES`), and the
# end of turn a run keeps (`gpt.run_tokenizer.END_OF_TURN`).
_TOKENIZER_FILES = ({"vocab.json", "merges.txt", "tokenizer_config.json"}, {*TOKENIZER_JSON_FILES, END_OF_TURN})


def _hub_cache_dirs() -> list[Path]:
    if os.environ.get("HF_HUB_CACHE"):
        return [Path(os.environ["HF_HUB_CACHE"])]
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return [home / "hub"]


def hub_snapshot(name: str, also: str | None = None) -> Path:
    """The directory of hub model `name` (e.g. "HuggingFaceTB/SmolLM2-135M"; or of `also`, another name it goes
    by) in the local Hugging Face cache, offline: its main snapshot, else any with a config.json. MissingInput
    in one line, saying how to get it, when the cache has none."""
    looked = []
    for cache in _hub_cache_dirs():
        for repo in (name, *([also] if also else [])):
            repo_dir = cache / f"models--{repo.replace('/', '--')}"
            looked.append(str(repo_dir))
            ref = repo_dir / "refs" / "main"
            snapshots = ([repo_dir / "snapshots" / ref.read_text().strip()] if ref.is_file()
                         else sorted((repo_dir / "snapshots").glob("*")))
            for snapshot in snapshots:
                if (snapshot / "config.json").is_file():
                    return snapshot
    raise MissingInput(f"{name!r} is not in the local Hugging Face cache (looked in {', '.join(looked)}); download "
                       f"it where there is a network (`hf download {name}`, huggingface-hub's command) or pass a "
                       f"directory with config.json and model.safetensors")


def read_config_json(directory: Path) -> dict:
    """A checkpoint directory's config.json; MissingInput or ConfigError in one line when it has none or it
    is not a JSON object (`read_json_file`)."""
    path = directory / "config.json"
    if not path.is_file():
        raise MissingInput(f"{directory} has no config.json")
    config = read_json_file(path)
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return config


def read_json_file(path: Path) -> object:
    """A small JSON file of a model directory: a plain file (never a FIFO or a device, which could block or
    never end) of at most 16 MiB, valid UTF-8 JSON nested within Python's bound; ConfigError in one line
    otherwise."""
    _check_plain_file(path)
    if path.stat().st_size > _MAX_JSON_BYTES:
        raise ConfigError(f"{path} is {path.stat().st_size:,} bytes, more than the {_MAX_JSON_BYTES:,} a model's "
                          f"JSON file may have")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ConfigError(f"{path} is nested too deep to be a model's JSON file") from None
    except (OSError, ValueError) as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(f"{path} is not valid JSON: {first_line(error)}") from None


def _check_plain_file(path: Path) -> None:
    """ConfigError unless `path` is a regular file (a link to one is followed: the shard index's names are
    confined apart, `_shard_path`)."""
    try:
        mode = path.stat().st_mode
    except OSError as error:
        raise MissingInput(f"{path} cannot be read: {first_line(error)}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{path} is not a regular file (a FIFO, a device or a directory is never read)")


def read_safetensors(directory: Path) -> dict[str, np.ndarray] | None:
    """Every tensor of `model.safetensors`, or of the shards `model.safetensors.index.json` names, as numpy
    arrays of their stored dtypes (bfloat16 as ml_dtypes'); None when the directory has neither. The index
    names only plain files inside the directory (`_shard_path`); a file that is not safetensors is ConfigError
    in one line naming it."""
    if (directory / _INDEX).exists():
        tensors = {}
        for shard in _shards(directory):
            tensors.update(_read_file(shard))
        return tensors
    if (directory / _WEIGHTS).exists():
        return _read_file(directory / _WEIGHTS)
    return None


def check_weight_files(directory: Path) -> None:
    """Each safetensors file of `directory` (`model.safetensors`, or the index's shards) read as far as its header,
    which must fit the file (no tensor's data is read); ConfigError or MissingInput in one line as
    `read_safetensors` would raise, before the work that a load comes after (a corpus's preparation)."""
    header_shapes(directory)


def header_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape by name, from the headers of `directory`'s safetensors files alone (no tensor's data
    read); {} where it has none. ConfigError or MissingInput in one line for a file that is not safetensors, or a
    shard the index may not name."""
    files = _shards(directory) if (directory / _INDEX).exists() else [directory / _WEIGHTS] if (
        directory / _WEIGHTS).exists() else []
    shapes = {}
    for path in files:
        _check_plain_file(path)
        try:
            with safe_open(path, framework="numpy") as file:
                shapes.update({name: tuple(file.get_slice(name).get_shape()) for name in file.keys()})
        except (SafetensorError, ValueError, OSError) as error:
            raise ConfigError(f"{path} is not a readable safetensors file: {first_line(error)}") from None
    return shapes


def check_tensor_shapes(directory: Path, expected: dict[str, tuple[int, ...] | int], optional=lambda name: False,
                        rename=lambda name: name) -> None:
    """Before any tensor's data is read: each tensor of `expected` in the headers of `directory`'s safetensors files
    (their names after `rename`) with that shape (a tuple) or that many values (an int, where a family's files
    are reshaped into ours), and no other but those `optional` allows; ConfigError in one line naming the tensor
    and what was expected. A directory without safetensors files (a GPT-2 pytorch_model.bin) is checked as it
    loads instead."""
    shapes = {rename(name): shape for name, shape in header_shapes(directory).items()}
    if not shapes:
        return
    for name, want in expected.items():
        if name not in shapes:
            raise ConfigError(f"{directory}: missing tensor {name!r}")
        if isinstance(want, tuple) and shapes[name] != want:
            raise ConfigError(f"{directory}: tensor {name!r} has shape {shapes[name]}, expected {want}")
        if isinstance(want, int) and math.prod(shapes[name]) != want:
            raise ConfigError(f"{directory}: tensor {name!r} holds {math.prod(shapes[name]):,} values; config.json's "
                              f"shapes give it {want:,}")
    unexpected = sorted(name for name in shapes if name not in expected and not optional(name))
    if unexpected:
        raise ConfigError(f"{directory}: unexpected tensors {unexpected[:8]}")


def _shards(directory: Path) -> list[Path]:
    """The shard files `model.safetensors.index.json` names, each once, in name order; ConfigError in one line
    for an index that is not {"weight_map": {tensor: shard file}} or names a file it may not."""
    index_path = directory / _INDEX
    index = read_json_file(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"{index_path} is not a shard index: it needs \"weight_map\", an object of tensor names to "
                          f"shard file names")
    return [_shard_path(directory, name) for name in sorted(set(weight_map.values()))]


def _shard_path(directory: Path, name: str) -> Path:
    """The shard file `name` of the index: a plain file name or relative path that stays inside `directory`
    however its links resolve (an index may not point at another model's shard, at `..`, or at a FIFO that
    would block the read for good); ConfigError or MissingInput in one line naming it."""
    where = f"{directory / _INDEX}: shard {name!r}"
    if not name or Path(name).is_absolute() or ".." in Path(name).parts or name in (".", "./"):
        raise ConfigError(f"{where} is not a file name inside the model's directory")
    path = directory / name
    if not path.exists():
        raise MissingInput(f"{where} is missing")
    if not path.resolve().is_relative_to(directory.resolve()):
        raise ConfigError(f"{where} links outside the model's directory")
    _check_plain_file(path)
    return path


def _read_file(path: Path) -> dict[str, np.ndarray]:
    """One safetensors file's tensors. Read through its JAX reader, on the host: the numpy one refuses
    bfloat16, the dtype the hub's Llama and Qwen checkpoints are stored in. A file that is not safetensors
    (truncated, empty, a header past its end) is ConfigError in one line."""
    _check_plain_file(path)
    try:
        with jax.default_device(jax.devices("cpu")[0]), safe_open(path, framework="flax") as file:
            return {name: np.asarray(file.get_tensor(name)) for name in file.keys()}
    except (SafetensorError, ValueError, OSError) as error:
        raise ConfigError(f"{path} is not a readable safetensors file: {first_line(error)}") from None


def write_export(out_dir: str | os.PathLike, tensors: dict[str, np.ndarray], texts: dict[str, str]) -> Path:
    """`tensors` as out_dir/model.safetensors and each of `texts` (config.json, the tokenizer's) as a file.

    Never destroys: the destination must be new, empty, or a previous export (`_check_destination`). The
    directory is written beside its destination and renamed into place, so it appears whole or not at all; a
    previous export is replaced only once the new one is complete. Files and directory get the usual
    permissions under the process's umask."""
    out_dir = Path(out_dir)
    _check_destination(out_dir)
    umask = os.umask(0)
    os.umask(umask)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))  # mkdtemp makes it 0700
    except OSError as e:
        raise write_failed(e, f"cannot write an export at {str(out_dir)!r}: {e}") from None
    retired = staging.with_name(staging.name + ".old")
    try:
        save_file(tensors, staging / _WEIGHTS, metadata={"format": "pt"})
        for name, text in texts.items():
            (staging / name).write_text(text, encoding="utf-8")
        for file in staging.iterdir():
            file.chmod(0o666 & ~umask)
        staging.chmod(0o777 & ~umask)
        if out_dir.exists():
            out_dir.rename(retired)  # a previous export (checked above), replaced by two renames
        try:
            staging.rename(out_dir)
        except OSError:
            if retired.exists():
                retired.rename(out_dir)  # the previous export, back where it was
            raise
    except (OSError, SafetensorError) as e:  # a full disk, say (safetensors' own error): out_dir is as it was
        raise write_failed(e, f"writing the export to {str(out_dir)!r} failed, and nothing there changed: {e}"
                           ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(retired, ignore_errors=True)
    return out_dir


def _check_destination(out_dir: Path) -> None:
    """Refuse a destination whose contents an export would destroy: the working directory or one of its
    parents, a training run's out_dir, or a non-empty directory that is not a previous export (exactly
    config.json, with a model_type, and model.safetensors, with or without a tokenizer's files)."""
    target, cwd = out_dir.resolve(), Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise ConfigError(f"refusing to export into {str(out_dir)!r}: it is the working directory or one of its "
                          f"parents; name a new directory")
    if target.exists() and not target.is_dir():
        raise ConfigError(f"refusing to export into {str(out_dir)!r}: it is a file")
    if not target.is_dir() or not any(target.iterdir()):
        return
    if (target / "checkpoints").exists() or (target / "metrics.jsonl").exists():
        raise ConfigError(f"refusing to export into {str(out_dir)!r}: it is a training run's out_dir; name a new "
                          f"directory")
    names = {entry.name for entry in target.iterdir()}
    try:
        previous = (_EXPORT_FILES <= names and any(names - _EXPORT_FILES <= files for files in _TOKENIZER_FILES)
                    and "model_type" in json.loads((target / "config.json").read_text()))
    except (OSError, ValueError, TypeError):
        previous = False
    if not previous:
        raise ConfigError(f"refusing to export into {str(out_dir)!r}: it is not empty and is not a previous export "
                          f"(it holds {sorted(names)[:5]}); name a new or empty directory")
