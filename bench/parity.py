"""Max |logit difference| between gpt.model.gpt2.load and transformers' GPT2LMHeadModel on random weights.

    python bench/parity.py

Prints one row per shape; the README's parity table comes from this.
"""

import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

from gpt.model import gpt2

SHAPES = {
    "gpt2 (124M)": dict(),
    "gpt2-medium (355M)": dict(n_embd=1024, n_layer=24, n_head=16),
    "small odd (V=997, D=60, 5 heads)": dict(vocab_size=997, n_positions=48, n_embd=60, n_layer=3, n_head=5),
}


def main():
    print("| shape | tokens | max abs diff (float32) | max abs logit |")
    print("| --- | --- | --- | --- |")
    for name, fields in SHAPES.items():
        torch.manual_seed(0)
        reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(**fields)).eval()
        with tempfile.TemporaryDirectory() as tmp:
            reference.save_pretrained(Path(tmp))
            model = gpt2.load(tmp)
        seq = min(128, reference.config.n_positions)
        tokens = np.random.default_rng(0).integers(0, reference.config.vocab_size, (4, seq)).astype(np.int32)
        with torch.no_grad():
            theirs = reference(torch.as_tensor(tokens)).logits.numpy()
        ours = np.asarray(model(tokens))
        print(f"| {name} | 4 x {seq} | {np.abs(ours - theirs).max():.2e} | {np.abs(theirs).max():.2f} |")


if __name__ == "__main__":
    main()
