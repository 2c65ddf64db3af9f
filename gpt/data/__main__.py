"""`python -m gpt.data --data PATHS --out_dir DIR`: prepare a corpus as train.py would (`gpt.data.prepare`)."""

import tyro

from gpt.data.prepare import PrepareConfig, main
from gpt.errors import cli_main

cli_main(main)(tyro.cli(PrepareConfig))
