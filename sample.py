"""Sample from a trained model or GPT-2 weights; --help lists all flags."""

import tyro

from gpt.errors import cli_main
from gpt.sample import SampleConfig, sample

if __name__ == "__main__":
    cli_main(sample)(tyro.cli(SampleConfig))
