"""Sample from a trained model or GPT-2 weights; --help lists all flags."""

import tyro

from gpt.sample import SampleConfig, sample

if __name__ == "__main__":
    sample(tyro.cli(SampleConfig))
