"""Hugging Face checkpoint directories as files: their safetensors read (one file, or shards and their index),
and an export written whole or not at all. What the tensors and config.json mean is each model family's
module's business (`gpt.model.gpt2`, `gpt.model.llama`)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from gpt.errors import ConfigError, MissingInput, first_line, write_failed
from gpt.tokenizer_json import FILES as TOKENIZER_JSON_FILES

__all__ = ["hub_snapshot", "read_config_json", "read_safetensors", "write_export"]

_WEIGHTS, _INDEX = "model.safetensors", "model.safetensors.index.json"
# What an export of ours holds: config.json and the weights, and the tokenizer's files where it has them.
_EXPORT_FILES = {"config.json", _WEIGHTS}
# The tokenizer files an export may hold beside its weights: GPT-2's (`gpt.tokenizer.hf_tokenizer_files`), or a
# model's own tokenizer.json, with its tokenizer_config.json where it has one (`gpt.tokenizer_json.FILES`).
_TOKENIZER_FILES = ({"vocab.json", "merges.txt", "tokenizer_config.json"}, set(TOKENIZER_JSON_FILES[:1]),
                    set(TOKENIZER_JSON_FILES))


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
                       f"it where there is a network (`huggingface-cli download {name}`) or pass a directory with "
                       f"config.json and model.safetensors")


def read_config_json(directory: Path) -> dict:
    """A checkpoint directory's config.json; MissingInput or ConfigError in one line when it has none or it
    is not a JSON object."""
    path = directory / "config.json"
    if not path.is_file():
        raise MissingInput(f"{directory} has no config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path} is not valid JSON: {first_line(error)}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object")
    return config


def read_safetensors(directory: Path) -> dict[str, np.ndarray] | None:
    """Every tensor of `model.safetensors`, or of the shards `model.safetensors.index.json` names, as numpy
    arrays of their stored dtypes (bfloat16 as ml_dtypes'); None when the directory has neither."""
    if (directory / _INDEX).is_file():
        tensors = {}
        for shard in sorted(set(json.loads((directory / _INDEX).read_text())["weight_map"].values())):
            tensors.update(_read_file(directory / shard))
        return tensors
    if (directory / _WEIGHTS).is_file():
        return _read_file(directory / _WEIGHTS)
    return None


def _read_file(path: Path) -> dict[str, np.ndarray]:
    """One safetensors file's tensors. Read through its JAX reader, on the host: the numpy one refuses
    bfloat16, the dtype the hub's Llama and Qwen checkpoints are stored in."""
    with jax.default_device(jax.devices("cpu")[0]), safe_open(path, framework="flax") as file:
        return {name: np.asarray(file.get_tensor(name)) for name in file.keys()}


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
        previous = (names in (_EXPORT_FILES, *(_EXPORT_FILES | files for files in _TOKENIZER_FILES))
                    and "model_type" in json.loads((target / "config.json").read_text()))
    except (OSError, ValueError, TypeError):
        previous = False
    if not previous:
        raise ConfigError(f"refusing to export into {str(out_dir)!r}: it is not empty and is not a previous export "
                          f"(it holds {sorted(names)[:5]}); name a new or empty directory")
