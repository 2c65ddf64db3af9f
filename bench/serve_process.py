"""serve.py in a process of its own, as a user runs it, for the benches that load it over HTTP."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_serve(directory: Path | str, *flags: str, log_path: Path | None = None,
                env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """serve.py over `directory` on a free port with `flags`, warmed up; returns the process and its /v1 URL.

    Its output goes to `log_path` (for the caller to read afterwards), else to an unnamed temporary file: a
    file, not a pipe, so that nothing has to drain it while it serves. `env` replaces the environment (None:
    this process's). The caller stops it (`process.terminate(); process.wait()`)."""
    with open(log_path, "w+") if log_path else tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "serve.py"), "--init_from", str(directory), "--port", "0", *flags],
            stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        while True:
            log.seek(0)
            text = log.read()
            found = re.search(r"on (http://\S+/v1)", text)
            if found:
                return process, found.group(1)
            if process.poll() is not None:
                raise RuntimeError(f"serve.py ended before serving (exit {process.returncode}):\n{text[-3000:]}")
            time.sleep(0.1)
