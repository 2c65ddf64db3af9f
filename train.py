"""Train a GPT. `python train.py` trains a small model on the embedded default corpus; --help lists all flags."""

import tyro

from gpt.generate import generate_text
from gpt.train import TrainConfig, train


def main(config: TrainConfig) -> None:
    summary = train(config)
    if config.sample_tokens and summary["stop_reason"] == "finished":
        prompt = "def "
        text = generate_text(summary["model"], [prompt], config.sample_tokens, temperature=0.8, top_k=200)[0]
        print(f"\nval loss {summary['val_loss']:.3f}; a sample:\n{prompt}{text}")


if __name__ == "__main__":
    main(tyro.cli(TrainConfig))
