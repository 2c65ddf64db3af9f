"""Sample from a trained model or GPT-2 weights; --help lists all flags."""

import tyro

from gpt.compilation_cache import enable_compilation_cache
from gpt.errors import cli_main
from gpt.sample import SampleConfig, sample

if __name__ == "__main__":
    config = tyro.cli(SampleConfig)
    enable_compilation_cache(config.compile_cache)
    cli_main(sample)(config)
