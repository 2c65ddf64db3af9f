"""Every command line the README and docs/ show still parses: the flags of train.py, sample.py, serve.py,
`python -m gpt.eval`, `python -m gpt.export` and `python -m gpt.data` as their parsers read them (nothing
loads or runs), so a renamed, moved or nested flag that breaks a documented command fails here."""

import re
import shlex

import pytest
import tyro

from gpt.cli import parse_train_config
from gpt.data.prepare import PrepareConfig
from gpt.eval import EvalConfig
from gpt.export import ExportConfig
from gpt.sample import SampleConfig
from gpt.serve import ServeConfig

from training import ROOT

PARSERS = {
    "train.py": parse_train_config,
    "sample.py": lambda argv: tyro.cli(SampleConfig, args=argv),
    "serve.py": lambda argv: tyro.cli(ServeConfig, args=argv),
    "-m gpt.eval": lambda argv: tyro.cli(EvalConfig, args=argv),
    "-m gpt.export": lambda argv: tyro.cli(ExportConfig, args=argv),
    "-m gpt.data": lambda argv: tyro.cli(PrepareConfig, args=argv),
}
COMMAND = re.compile(r"python (train\.py|sample\.py|serve\.py|-m gpt\.eval|-m gpt\.export|-m gpt\.data)((?: [^#`|&]*)?)")


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(where, program, flags) of each command line in the README and docs/*.md, in a code block or inline
    code; a line that elides its flags ("...") or asks for --help is not a command to parse."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in COMMAND.finditer(line):
                flags = match.group(2).strip()
                if "..." in flags or "--help" in flags:
                    continue
                found.append((f"{path.name}:{number}", match.group(1), shlex.split(flags)))
    return found


COMMANDS = documented_commands()


def test_the_documents_show_commands_of_every_program():
    assert {program for _, program, _ in COMMANDS} == set(PARSERS)  # the pattern still finds them


@pytest.mark.parametrize("where, program, flags", COMMANDS, ids=[f"{w}" for w, _, _ in COMMANDS])
def test_a_documented_command_line_parses(where, program, flags):
    PARSERS[program](flags)
