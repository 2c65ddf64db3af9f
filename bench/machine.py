"""The machine a benchmark ran on, named in every result header (figures compare only within one CPU)."""

from __future__ import annotations

import platform


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux) with its family and model numbers, which tell apart
    generations sold under one name ("AMD EPYC" is Zen 4 as family 25 and Zen 5 as family 26); else what
    `platform` knows (often just "x86_64")."""
    try:
        with open("/proc/cpuinfo") as info:
            fields = {}
            for line in info:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
                if not line.strip():
                    break  # the first processor's fields are enough
        name = fields["model name"]
        if "cpu family" in fields and "model" in fields:
            name += f" (family {fields['cpu family']}, model {fields['model']})"
        return name
    except (OSError, KeyError):
        return platform.processor() or platform.machine()
