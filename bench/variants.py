"""A benchmark's variants: named sets of levers, each lever a change to what is measured, so that one lent GPU
call measures every candidate beside the baseline.

A lever changes cells of the backend table's row (`gpt.model.backend`, through `GPT_BACKEND_CHOICES`), fields of
the model's config, or environment variables that JAX and XLA read as they start (`XLA_FLAGS`,
`JAX_OPTIMIZATION_LEVEL`): so each variant runs in a process of its own, started with `Levers.env(variant)`
(`run_worker`), which reports its row and what it ran with (`report`, `ran_with`).
A variant's name is `baseline` (no lever), a lever's name, several joined by "+", or `all` (the levers
`together` names: those that can be combined, and whose numbers are the baseline's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["Lever", "Levers", "run_worker", "report", "ran_with"]

ROOT = Path(__file__).resolve().parents[1]
RESULT = "RESULT "  # the line a worker prints its row on


@dataclasses.dataclass(frozen=True)
class Lever:
    """One change, which a variant turns on."""

    choices: dict = dataclasses.field(default_factory=dict)  # cells of the backend table's row
    config: dict = dataclasses.field(default_factory=dict)  # fields of the model's config
    env: dict = dataclasses.field(default_factory=dict)  # environment variables, read as JAX starts


@dataclasses.dataclass(frozen=True)
class Levers:
    """A benchmark's levers by name, and the ones `all` turns on."""

    known: dict[str, Lever]
    together: tuple[str, ...]

    def of(self, variant: str) -> list[Lever]:
        """The levers a variant's name turns on ("baseline": none); ValueError naming an unknown one."""
        if variant == "baseline":
            return []
        names = [name for part in variant.split("+") for name in (self.together if part == "all" else [part])]
        unknown = [name for name in names if name not in self.known]
        if unknown:
            raise ValueError(f"unknown lever {unknown[0]!r} in variant {variant!r}; levers: "
                             f"{', '.join(self.known)}, all")
        return [self.known[name] for name in dict.fromkeys(names)]

    def env(self, variant: str) -> dict[str, str]:
        """The environment a variant's worker starts with: its levers' variables (XLA_FLAGS appended to this
        process's) and the backend cells they change, as `GPT_BACKEND_CHOICES` (a later lever's value wins)."""
        from gpt.model.backend import OVERRIDE_ENV

        env, choices = {}, {}
        for lever in self.of(variant):
            choices.update(lever.choices)
            for name, value in lever.env.items():
                env[name] = (f"{env.get(name, os.environ.get(name, ''))} {value}".strip() if name == "XLA_FLAGS"
                             else value)
        return {**env, OVERRIDE_ENV: json.dumps(choices)} if choices else env

    def config(self, variant: str) -> dict:
        """The model config's fields that a variant's levers change."""
        return {name: value for lever in self.of(variant) for name, value in lever.config.items()}

    def check(self, variants) -> None:
        """SystemExit with one line, before any worker starts, for a variant that names an unknown lever."""
        try:
            for variant in variants:
                self.of(variant)
        except ValueError as error:
            raise SystemExit(f"{os.path.basename(sys.argv[0])}: {error}") from None


def run_worker(script: str, job: dict, env: dict, timeout_s: float, quiet_exit: int | None = None) -> dict | None:
    """`python script --worker JOB` with `env` over this process's (the repository first on PYTHONPATH): the row
    it `report`ed; None when it exits with `quiet_exit` (a benchmark's "does not fit"); RuntimeError with its
    stderr's tail on any other failure."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}
    done = subprocess.run([sys.executable, script, "--worker", json.dumps(job)], env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    if quiet_exit is not None and done.returncode == quiet_exit:
        return None
    rows = [line[len(RESULT):] for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode != 0 or not rows:
        raise RuntimeError(f"{job} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(rows[-1])


def report(row: dict) -> None:
    """A worker's row, as `run_worker` reads it."""
    print(RESULT + json.dumps(row), flush=True)


def ran_with() -> dict:
    """What a worker runs with, of what levers change: its backend row, and the XLA options it started with."""
    import jax

    from gpt.model.backend import choices

    return {**dataclasses.asdict(choices()), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "optimization_level": str(jax.config.jax_optimization_level)}
