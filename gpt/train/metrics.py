"""The run's metrics, the same records to `out_dir/metrics.jsonl` and to TensorBoard (`out_dir/tensorboard`).

A resumed run re-runs the steps after its checkpoint, so the writer starts by forgetting them: the JSONL
file is rewritten (atomically) without records past the resume step, and TensorBoard is told to purge
events past it (`purge_step`). Each step is then logged once, however often the run was interrupted.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from gpt.errors import write_failed

__all__ = ["MetricsWriter"]


class MetricsWriter:
    """`write({"step": s, name: value, ...})` appends one record; only process 0 of a run writes."""

    def __init__(self, out_dir: str | os.PathLike, resume_step: int, enabled: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        SummaryWriter = _summary_writer_class()  # imported here: processes that do not write never load it
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "metrics.jsonl"
        self._forget_after(resume_step)
        self.jsonl = open(self.path, "a")
        self.tensorboard = SummaryWriter(str(out_dir / "tensorboard"), purge_step=resume_step + 1)

    def _forget_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):  # a line cut short by a crash
                continue
        staging = self.path.with_suffix(".jsonl.tmp")
        staging.write_text("".join(line + "\n" for line in kept))
        staging.replace(self.path)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        try:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
            for key, value in record.items():
                if key != "step" and value is not None:
                    self.tensorboard.add_scalar(key, value, record["step"])
        except OSError as e:  # a full disk: one line, where a traceback had ended the run
            message = (f"writing step {record.get('step')}'s metrics to {self.path} failed ({e}); the run stopped, "
                       f"its saved checkpoints intact: make room, then rerun to resume")
            raise write_failed(e, message) from None

    def close(self) -> None:
        if self.enabled:
            for file in (self.jsonl, self.tensorboard):
                try:
                    file.close()
                except OSError:  # its last flush, on the full disk that stopped the run: reported already
                    pass


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without PyTorch: where torch is installed tensorboardX's writer
    imports it (1.5-2 s of a run's start, to accept torch tensors, where we log floats). Torch is hidden from
    that one import unless something already loaded it."""
    hidden = "torch" not in sys.modules
    if hidden:
        sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter
    finally:
        if hidden:
            del sys.modules["torch"]
    return SummaryWriter
