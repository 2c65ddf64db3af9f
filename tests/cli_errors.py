"""Runs CLI invocations that must fail, one after another in this one fresh process, and prints what each
did as JSON: the exit status, everything written to stderr (JAX's compile log included) and whether any
other exception escaped. One interpreter start and one import of the package for a whole list of cases.

    python tests/cli_errors.py CASES.json   # [[script, [flag, ...], working directory], ...]

Run with JAX_LOG_COMPILES=1, so that a compile shows in a case's stderr."""

import contextlib
import io
import json
import logging
import os
import runpy
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class _CurrentStderr(logging.Handler):
    """Writes each record to whatever sys.stderr is at the time (a case's buffer), as JAX's own handler,
    made at import, would have written it to the process's stderr."""

    def emit(self, record):
        sys.stderr.write(self.format(record) + "\n")


def run_case(script: str, flags: list[str], cwd: str) -> dict:
    """`python script *flags` in `cwd`, as __main__ of this process: {"status": its SystemExit's status (None
    where it ended without one), "stderr": str, "escaped": bool}."""
    stderr, status, escaped = io.StringIO(), None, False
    os.chdir(cwd)
    sys.argv = [str(ROOT / script), *flags]
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_path(str(ROOT / script), run_name="__main__")
        except SystemExit as exit:
            status = exit.code
        except BaseException:  # what a process would have died of, with its traceback
            traceback.print_exc()
            escaped = True
    return {"status": status, "stderr": stderr.getvalue(), "escaped": escaped}


if __name__ == "__main__":
    logging.getLogger("jax").addHandler(_CurrentStderr())
    logging.getLogger("jax").propagate = False  # each record once, in the case's stderr
    cases = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps([run_case(*case) for case in cases]))
