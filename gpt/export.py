"""Export a training run's checkpoint as a Hugging Face directory: GPT-2's format for a model of GPT-2's shape,
Llama's or Qwen's for one of theirs.

    python -m gpt.export --out_dir out --hf_dir exported/
"""

from __future__ import annotations

if __name__ == "__main__":  # as a command line: before the imports (`gpt.process_start`)
    from gpt.process_start import start_command_line

    start_command_line()

import dataclasses

import tyro

from gpt.errors import ConfigError, cli_main
from gpt.model import gpt2, llama
from gpt.model.config import GPTConfig
from gpt.run_tokenizer import hf_files
from gpt.train.checkpoint import load_model


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    out_dir: str = "out"
    """The training run's out_dir."""
    hf_dir: str = "exported"
    """Where to write config.json + model.safetensors (loadable by transformers' AutoModelForCausalLM) and the run's
    tokenizer (by AutoTokenizer): a new or empty directory, or a previous export, which is replaced whole."""
    step: int | None = None
    """The checkpoint step (default: the latest)."""


@cli_main
def main(config: ExportConfig) -> None:
    model = load_model(config.out_dir, config.step)
    tokenizer_files = hf_files(config.out_dir, model.config.block_size)
    print(f"wrote {format_of(model.config).save(model, config.hf_dir, tokenizer_files)}")


def format_of(config: GPTConfig):
    """The module (`gpt2` or `llama`) whose Hugging Face format holds a model of `config`; ConfigError naming
    what neither can hold."""
    refusals = []
    for module, check in ((gpt2, gpt2.config_to_hf), (llama, llama.family_of)):
        try:
            check(config)
            return module
        except ConfigError as error:
            refusals.append(str(error))
    raise ConfigError(f"{'; '.join(refusals)}; it can still be sampled, served and evaluated from its training "
                      f"run's out_dir")


if __name__ == "__main__":
    main(tyro.cli(ExportConfig))
