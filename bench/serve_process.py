"""serve.py in a process of its own, as a user runs it, for the benches that load it over HTTP."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_serve(directory: Path | str, *flags: str) -> tuple[subprocess.Popen, str]:
    """serve.py over `directory` on a free port with `flags`, warmed up; returns the process and its /v1 URL.
    Its later output is read and dropped (a full pipe would stop it). The caller stops it
    (`process.terminate(); process.wait()`)."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "serve.py"), "--init_from", str(directory), "--port", "0", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        found = re.search(r"on (http://\S+/v1)", line)
        if found:
            threading.Thread(target=process.stdout.read, daemon=True).start()
            return process, found.group(1)
    raise RuntimeError(f"serve.py ended before serving (exit {process.wait()})")
