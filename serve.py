"""Serve completions over the OpenAI API (POST /v1/completions); --help lists all flags."""

import tyro

from gpt.errors import cli_main
from gpt.serve import ServeConfig, serve

if __name__ == "__main__":
    cli_main(serve)(tyro.cli(ServeConfig))
