"""Serve completions over the OpenAI API (POST /v1/completions); --help lists all flags."""

from gpt.process_start import start_command_line

start_command_line()  # before the imports: a Ctrl-C during them is one line, and JAX's platforms are chosen

import tyro  # noqa: E402

from gpt.errors import cli_main  # noqa: E402
from gpt.serve import ServeConfig, serve  # noqa: E402


@cli_main
def main() -> None:
    serve(tyro.cli(ServeConfig))  # inside cli_main: a flag's ConfigError as tyro builds the config is one line


if __name__ == "__main__":
    main()
