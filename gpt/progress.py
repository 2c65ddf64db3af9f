"""How a long job (training, preparing a corpus, scoring one) shows its progress: a bar where a person watches a
terminal, a plain line every so often where its output goes to a file or a pipe (CI's log, `nohup`, SLURM,
Kubernetes), a JSON object a line for a log shipper, or nothing.

`Progress` counts units of work (steps, bytes, windows) towards an optional total and reports the figures its
owner gives (`report(loss=3.41, tokens_per_s=4210)`). A bar shows them beside itself; a line reads

    train: step 120/300 (40%), loss 3.412, 4,210 tokens/s, ETA 2 min 5 s

and a JSON line is the figures with the count and the ETA. A job without figures of its own (a corpus's bytes)
calls `tick`, which writes a line once `every_s` seconds have passed since the last.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from typing import Literal, TextIO

from tqdm import tqdm

__all__ = ["Progress", "ProgressChoice", "Style", "STYLES", "duration"]

Style = Literal["auto", "bar", "lines", "json", "none"]
STYLES: tuple[str, ...] = ("auto", "bar", "lines", "json", "none")
"""auto: the bar where stdout is a terminal, else lines; none: no progress at all (the job's other lines stay)."""


@dataclasses.dataclass(frozen=True)
class ProgressChoice:
    """The `--quiet` and `--log_format` flags of the commands that run for long (train.py, gpt.eval)."""

    quiet: bool = False
    """Show no progress (no bar, no progress lines): only the results, warnings and errors."""
    log_format: Literal["text", "json"] = "text"
    """text: a progress bar where stdout is a terminal, else a plain line at each report (a file, a pipe, CI's
    log); json: every progress line and result line as one JSON object, for a log shipper."""

    @property
    def progress_style(self) -> Style:
        return "none" if self.quiet else "json" if self.log_format == "json" else "auto"


def duration(seconds: float) -> str:
    """`seconds` as a person reads a time left: "45 s", "2 min 5 s", "3 h 20 min"."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def _figure(name: str, value) -> str:
    """One figure of a line: a rate with thousands separators, a loss to 4 figures, a share in percent."""
    if isinstance(value, float) and name.endswith("_per_s"):
        return f"{value:,.0f} {name.removesuffix('_per_s').replace('_', ' ')}/s"
    if isinstance(value, float) and name == "mfu":
        return f"MFU {value:.1%}"
    if isinstance(value, float):
        return f"{name.replace('_', ' ')} {value:.4g}"
    return f"{name.replace('_', ' ')} {value}"


class Progress:
    """Units of `what`'s work done so far (`update`), and its figures (`report`), shown in `style`.

    `total` is the count at the end (None: unknown), `initial` where it starts (a resumed run's step); `unit`
    names a unit ("step", "B" for bytes, shown in MiB on a line). Lines and JSON go to `stream` (stdout
    unless told), the bar to stderr, as tqdm's. Use it as a context manager, which closes the bar.
    """

    def __init__(self, what: str, total: int | None = None, initial: int = 0, unit: str = "step",
                 style: Style = "auto", stream: TextIO | None = None, every_s: float = 10.0):
        if style not in STYLES:
            raise ValueError(f"progress style must be one of {STYLES}, got {style!r}")
        self.stream = stream if stream is not None else sys.stdout
        if style == "auto":
            style = "bar" if _is_terminal(sys.stdout) else "lines"
        self.what, self.total, self.initial, self.unit, self.style = what, total, initial, unit, style
        self.every_s = every_s
        self.count = initial
        self.started = self.last_line = time.monotonic()
        self.bar = tqdm(total=total, initial=initial, desc=what, unit=unit, unit_scale=unit == "B",
                        file=sys.stderr, dynamic_ncols=True) if style == "bar" else None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, n: int = 1) -> None:
        """`n` more units done."""
        self.count += n
        if self.bar is not None:
            self.bar.update(n)

    def tick(self) -> None:
        """A line (or JSON object) of the count alone, once `every_s` seconds have passed since the last."""
        if self.style in ("lines", "json") and time.monotonic() - self.last_line >= self.every_s:
            rate = (self.count - self.initial) / max(time.monotonic() - self.started, 1e-9)
            self.report(**({} if self.unit == "B" else {f"{self.unit}s_per_s": rate}))

    def report(self, at: int | None = None, **figures) -> None:
        """The count (`at`, where the figures are of an earlier count than now) and `figures`: beside the bar,
        or as a line, or as a JSON object."""
        if self.bar is not None:
            self.bar.set_postfix({name: f"{value:,.0f}" if name.endswith("_per_s") else
                                  f"{value:.4g}" if isinstance(value, float) else value
                                  for name, value in figures.items() if value is not None}, refresh=False)
            return
        self.last_line = time.monotonic()
        if self.style == "json":
            counted = self.unit if self.unit != "B" else "bytes"
            record = {"progress": self.what, counted: self.count if at is None else at, "total": self.total,
                      **figures, "eta_s": self.eta_seconds()}
            print(json.dumps(record), file=self.stream, flush=True)
        elif self.style == "lines":
            parts = [self._count_text(self.count if at is None else at),
                     *(_figure(n, v) for n, v in figures.items() if v is not None)]
            eta = self.eta_seconds()
            if eta is not None and self.count < self.total:
                parts.append(f"ETA {duration(eta)}")
            print(f"{self.what}: " + ", ".join(parts), file=self.stream, flush=True)

    def write(self, line: str, **record) -> None:
        """A line of the job's own (a validation loss), also with style none: above the bar, or on `stream`;
        `record` (its figures) as a JSON object instead in style json, where there is one."""
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(json.dumps(record) if self.style == "json" and record else line, file=self.stream, flush=True)

    def eta_seconds(self) -> float | None:
        """Seconds left at the rate since this began; None without a total or before any unit is done (a
        first step's compile counts in its rate until the later steps outweigh it)."""
        done, elapsed = self.count - self.initial, time.monotonic() - self.started
        if self.total is None or done <= 0 or elapsed <= 0:
            return None
        return max(self.total - self.count, 0) * elapsed / done

    def _count_text(self, count: int) -> str:
        if self.unit == "B":
            mib = lambda n: f"{n / 2**20:,.1f}"  # noqa: E731
            text = f"{mib(count)} MiB" if self.total is None else f"{mib(count)} of {mib(self.total)} MiB"
            rate = (self.count - self.initial) / max(time.monotonic() - self.started, 1e-9) / 2**20
            return f"{text} ({rate:,.1f} MiB/s)"
        if self.total is None:
            return f"{count:,} {self.unit}s"
        return f"{self.unit} {count:,}/{self.total:,} ({math.floor(100 * count / max(self.total, 1))}%)"


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        return False
