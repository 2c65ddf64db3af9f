"""Export a training run's checkpoint as a Hugging Face GPT-2 directory.

    python -m gpt.export --out_dir out --hf_dir exported/
"""

from __future__ import annotations

if __name__ == "__main__":  # as a command line: before the imports (`gpt.process_start`)
    from gpt.process_start import start_command_line

    start_command_line()

import dataclasses

import tyro

from gpt.errors import cli_main
from gpt.model import gpt2
from gpt.train.checkpoint import load_model


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    out_dir: str = "out"
    """The training run's out_dir."""
    hf_dir: str = "exported"
    """Where to write config.json + model.safetensors (loadable by GPT2LMHeadModel.from_pretrained): a new or
    empty directory, or a previous export, which is replaced whole."""
    step: int | None = None
    """The checkpoint step (default: the latest)."""


@cli_main
def main(config: ExportConfig) -> None:
    path = gpt2.save(load_model(config.out_dir, config.step), config.hf_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main(tyro.cli(ExportConfig))
