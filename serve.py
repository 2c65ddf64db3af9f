"""Serve completions over the OpenAI API (POST /v1/completions); --help lists all flags."""

import os
import sys

if "--compile_only" in " ".join(sys.argv):  # compiles for devices it never runs on: no accelerator to look for
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import tyro  # noqa: E402

from gpt.errors import cli_main  # noqa: E402
from gpt.serve import ServeConfig, serve  # noqa: E402

if __name__ == "__main__":
    cli_main(serve)(tyro.cli(ServeConfig))
