"""`python -m gpt.data --data PATHS --out_dir DIR`: prepare a corpus as train.py would (`gpt.data.prepare`)."""

from gpt.process_start import start_command_line

start_command_line()  # before the imports: a Ctrl-C during them is one line, and JAX's platforms are chosen

import tyro  # noqa: E402

from gpt.data.prepare import PrepareConfig, main  # noqa: E402
from gpt.errors import cli_main  # noqa: E402

cli_main(main)(tyro.cli(PrepareConfig))
