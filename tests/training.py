"""Helpers shared by the training tests: a tiny model, a short run, and train.py's flags for it."""

import socket
from pathlib import Path

import jax
import numpy as np

from gpt.model.config import GPTConfig
from gpt.train import TrainConfig, train

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(n_layer=2, n_head=2, n_embd=64)
# Two of the test process's eight CPU devices: still a data-parallel mesh (a batch split, gradients reduced
# across devices), at ~2.3x the steps a second of all eight, which share the machine's cores and each update
# a replica of the parameters. Tests about meshes name theirs (and num_devices=None: every device).
TINY = dict(model=GPTConfig.preset("small", **MODEL), block_size=32, batch_size=8, eval_iters=2, log_interval=5,
            sample_tokens=0, warmup_steps=2, lr=3e-3, num_devices=2)


def cli_flags(**changes) -> list[str]:
    """train.py's flags for TINY with `changes` (a `model` change replaces the GPTConfig; a None leaves the
    flag out, to its default)."""
    fields = {**TINY, **changes}
    model = fields.pop("model")
    flags = [f"--model.{name}={getattr(model, name)}" for name in MODEL]
    for name, value in fields.items():
        if value is None:
            continue
        flags += [f"--{name}", *map(str, value)] if isinstance(value, tuple) else [f"--{name}={value}"]
    return flags


def run(tmp_path, corpus, log=lambda *_: None, **changes) -> dict:
    """train() on TINY in tmp_path/run, 8 steps, no eval or checkpoint before the end unless changed."""
    fields = {**TINY, "data": (corpus,), "out_dir": str(tmp_path / "run"), "max_steps": 8,
              "eval_interval": 100, "checkpoint_interval": 100, **changes}
    return train(TrainConfig.from_flags(**fields), log=log)


def flat(params) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(params)]


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (for a test's coordinator)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
