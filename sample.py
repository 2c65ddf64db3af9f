"""Sample from a trained model or GPT-2 weights, or talk with an instruct model (--chat); --help lists all flags."""

from gpt.process_start import start_command_line

start_command_line()  # before the imports: a Ctrl-C during them is one line, and JAX's platforms are chosen

import tyro  # noqa: E402

from gpt.compilation_cache import enable_compilation_cache  # noqa: E402
from gpt.errors import cli_main  # noqa: E402
from gpt.sample import SampleConfig, sample, talk  # noqa: E402


@cli_main
def main() -> None:
    config = tyro.cli(SampleConfig)  # inside cli_main: a flag's ConfigError as tyro builds the config is one line
    enable_compilation_cache(config.compile_cache)
    talk(config) if config.chat else sample(config)


if __name__ == "__main__":
    main()
