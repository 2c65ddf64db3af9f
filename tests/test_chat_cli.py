"""`sample.py --chat` driven as a user drives it, in a pseudo-terminal: a greedy reply equal to transformers' that
ends at the model's end of turn, a second turn over the history, Ctrl-C stopping a reply without ending the
conversation, /reset and /exit; a model without a chat template refused in one line."""

import os
import pty
import re
import signal
import subprocess
import sys
import time

import pytest

from gpt.inference.text_stream import TextStream
from gpt.tokenizer_json import TokenizerJson

from bounds import bound
from chat_templates import CONVERSATION, STEPS, greedy, make_chat_model
from training import ROOT


class Terminal:
    """A process on a pseudo-terminal: what it wrote so far, lines typed to it, signals sent to it."""

    def __init__(self, command: list[str], cwd):
        self.master, slave = pty.openpty()
        env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
        self.process = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave, cwd=cwd, env=env,
                                        start_new_session=True)
        os.close(slave)
        self.seen = ""

    def wait_for(self, pattern: str, seconds: float = 120) -> str:
        """Read until `pattern` (a regular expression) appears in what came after the last match; that text."""
        deadline = time.monotonic() + bound(seconds)
        while not re.search(pattern, self.seen):
            assert time.monotonic() < deadline, f"no {pattern!r} in {self.seen[-2000:]!r}"
            try:
                self.seen += os.read(self.master, 4096).decode("utf-8", errors="replace")
            except OSError:  # the process ended: its terminal is gone
                assert re.search(pattern, self.seen), f"no {pattern!r} in {self.seen[-2000:]!r}"
        end = re.search(pattern, self.seen).end()
        text, self.seen = self.seen[:end], self.seen[end:]
        return text

    def type(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> int:
        try:
            return self.process.wait(timeout=bound(60))
        finally:
            self.process.kill()
            os.close(self.master)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, prose_text):
    return make_chat_model(tmp_path_factory.mktemp("chat-cli"), prose_text[:100_000])


@pytest.mark.slow
def test_a_conversation_in_a_terminal(chat_model, tmp_path):
    model, directory, ids, reply, end = chat_model
    tokenizer = TokenizerJson(directory)
    system, question = CONVERSATION[0]["content"], CONVERSATION[1]["content"]
    terminal = Terminal([sys.executable, str(ROOT / "sample.py"), "--chat", "--init_from", str(directory),
                         "--temperature", "0", "--system", system, "--max_new_tokens", str(STEPS)], tmp_path)
    try:
        terminal.wait_for(r"/reset starts over.*\n> ")  # each line typed once its prompt is there
        terminal.type(question)
        time.sleep(0.5)  # the reply's first call is compiling
        terminal.process.send_signal(signal.SIGINT)
        assert terminal.wait_for(r"\[stopped\]\r?\n") and terminal.process.poll() is None  # the session goes on
        terminal.wait_for("> ")
        terminal.type(question)  # the stopped turn stays in the history: this reply follows it
        terminal.wait_for("> ")
        terminal.type("/reset")
        terminal.wait_for(r"\(a new conversation\)\r?\n> ")
        terminal.type(question)
        answer = terminal.wait_for("> ").replace("\r\n", "\n")
        stream = TextStream((), tokenizer)
        for token in reply:
            stream.push(token)
        assert answer == f"{question}\n{stream.finish()}\n> "  # transformers' greedy reply, then the end of turn,
        assert greedy(model, ids, STEPS, eos=[end]) == reply + [end]  # where transformers stops too
        terminal.type("/exit")
        assert terminal.close() == 0
    finally:
        terminal.process.kill()


def test_a_model_without_a_chat_template_is_refused_before_it_loads(tmp_path):
    from gpt.errors import ConfigError
    from gpt.model import gpt2
    from gpt.sample import SampleConfig, talk

    from serving import decisive_model

    gpt2.save(decisive_model(), tmp_path / "gpt2")
    with pytest.raises(ConfigError, match="has no chat template .* sample.py without --chat"):
        talk(SampleConfig(init_from=str(tmp_path / "gpt2"), chat=True), read=lambda _: "/exit")
