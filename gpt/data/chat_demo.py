"""The embedded conversation corpus for the chat demo (`--data stdlib-chat`): questions about the running Python's
standard library answered from its own docstrings, made offline from what every machine has.

    {"messages": [{"role": "user", "content": "What does json.dumps do?"},
                  {"role": "assistant", "content": "Serialize ``obj`` to a JSON formatted ``str``."}]}

Each public function and class of the top-level `.py` modules with a docstring gives one conversation: the question
(in one of a few phrasings), the docstring's first paragraph as the answer (at most `_ANSWER_CHARS`); every third
one opens with a system message, every fourth asks a follow-up about a second name of the same module. The
sources are parsed (`ast`), never imported. The file is written once per Python version under the user's cache
directory (`$XDG_CACHE_HOME/gpt`, else `~/.cache/gpt`), whole or not at all.
"""

from __future__ import annotations

import ast
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

__all__ = ["NAME", "demo_path", "conversations"]

NAME = "stdlib-chat"
"""What `--data` names the corpus by."""
_ANSWER_CHARS = 300
_QUESTIONS = ("What does {name} do?", "Explain {name}.", "What is {name} for?", "Tell me about {name}.")
_SYSTEM = "You answer questions about Python's standard library in one or two sentences."


def _documented(path: Path) -> Iterator[tuple[str, str]]:
    """(module.name, the first paragraph of its docstring) for each public top-level function and class."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            doc = ast.get_docstring(node)
            answer = " ".join(doc.split("\n\n")[0].split()) if doc else ""
            if 20 <= len(answer) <= _ANSWER_CHARS and not answer.startswith(node.name + "("):
                yield f"{path.stem}.{node.name}", answer


def conversations(stdlib: Path) -> Iterator[dict]:
    """The corpus's records, in a fixed order (the modules' and their names')."""
    count = 0
    for path in sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_")):
        pairs = list(_documented(path))
        for i, (name, answer) in enumerate(pairs):
            messages = [{"role": "system", "content": _SYSTEM}] if count % 3 == 0 else []
            messages += [{"role": "user", "content": _QUESTIONS[count % len(_QUESTIONS)].format(name=name)},
                         {"role": "assistant", "content": answer}]
            if count % 4 == 3 and i + 1 < len(pairs):
                other, other_answer = pairs[i + 1]
                messages += [{"role": "user", "content": f"And {other}?"},
                             {"role": "assistant", "content": other_answer}]
            count += 1
            yield {"messages": messages}


def demo_path() -> Path:
    """The corpus's file, written on first use."""
    import sysconfig

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt"
    path = cache / f"{NAME}-{sys.version_info.major}.{sys.version_info.minor}.jsonl"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        with open(partial, "w", encoding="utf-8") as file:
            for record in conversations(Path(sysconfig.get_paths()["stdlib"])):
                file.write(json.dumps(record, ensure_ascii=False) + "\n")
        partial.replace(path)
    return path
