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


def test_the_set_up_commands_install_torchs_cpu_build_and_ci_runs_them_as_written():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    install, test = re.search(r"## Set up and test\n\n```bash\n(.*?)\n```", readme, re.S).group(1).splitlines()
    words = shlex.split(install)
    assert words[:2] == ["pip", "install"] and test == "pytest"
    assert "torch==2.13.0" in words and words[words.index("-e") + 1] == ".[test]"
    # On an ordinary Linux machine, PyPI's torch is a multi-GB CUDA build: the CPU build's index is in the command.
    assert words[words.index("--extra-index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    ci = [shlex.split(line) for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("pip install")]
    assert [[word for word in line if word != "-q"] for line in ci][:1] == [words]  # CI's first install is the README's
    assert re.search(r"^pytest$", (ROOT / ".ci" / "run").read_text(), re.M)
