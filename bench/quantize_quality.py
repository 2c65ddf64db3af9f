"""What int8 and bf16 weights cost in quality: logits, KL divergence, greedy agreement, validation loss.

    python bench/quantize_quality.py --out_dir out        # the default run's trained model (after python train.py)
    python bench/quantize_quality.py                      # GPT-2 124M shapes, random weights only

For each model and each of int8 and bf16 (weights laid out by `gpt.inference.decoder.decoding_weights`), against
float32: the largest absolute logit difference and the mean KL(float32 || quantized) over the positions
of --batches validation windows (or random tokens for the random model), the share of 256 greedy tokens
that agree position by position (4 prompts), and the validation loss of each (trained model only).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gpt.generate import generate
from gpt.inference.decoder import decoding_weights
from gpt.inference.sampling import GREEDY
from gpt.model.transformer import forward, lm_head

from machine import cpu_name


@jax.jit
def _stats(logits_ref, logits, targets):
    log_p, log_q = jax.nn.log_softmax(logits_ref), jax.nn.log_softmax(logits)
    kl = (jnp.exp(log_p) * (log_p - log_q)).sum(-1).mean()
    nll = lambda lp: -jnp.take_along_axis(lp, targets[..., None], -1).mean()  # noqa: E731
    return jnp.abs(logits - logits_ref).max(), kl, nll(log_p), nll(log_q)


def measure(model, batches: list[np.ndarray], prompts, name: str, has_loss: bool) -> list[str]:
    config = model.config
    run = jax.jit(lambda w, t: lm_head(w, forward(config, w, t, jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape))[0]))
    steps = min(256, config.block_size - max(map(len, prompts)))  # the default run's context is 256
    greedy = generate(model, prompts, steps, sampling=GREEDY)
    rows = []
    for quantize in ("int8", "bf16"):
        weights, quantized = decoding_weights(model), decoding_weights(model, quantize)
        stats = np.array([[float(s) for s in _stats(run(weights, jnp.asarray(b[:, :-1])),
                                                    run(quantized, jnp.asarray(b[:, :-1])), jnp.asarray(b[:, 1:]))]
                          for b in batches])
        diff, (kl, loss_ref, loss) = stats[:, 0].max(), stats[:, 1:].mean(0)
        got = generate(model, prompts, steps, sampling=GREEDY, quantize=quantize)
        agree = np.mean([a == b for want, have in zip(greedy, got) for a, b in zip(want, have)])
        first = min(next((i for i, (a, b) in enumerate(zip(w, h)) if a != b), steps) for w, h in zip(greedy, got))
        loss_text = f"{loss_ref:.5f} -> {loss:.5f} ({loss - loss_ref:+.5f})" if has_loss else "-"
        rows.append(f"| {name} | {quantize} | {diff:.3f} | {kl:.2e} | {agree:.1%} of {steps} x 4 (first difference at step {first}) | {loss_text} |")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default=None, help="a training out_dir (with data/) to measure too")
    parser.add_argument("--batches", type=int, default=4, help="validation windows of 256 tokens, 8 each")
    args = parser.parse_args()

    print(f"# {cpu_name()}, {jax.devices()[0].device_kind}, jax {jax.__version__}, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| model | weights | max abs logit diff | mean KL(f32 || q) | greedy tokens that agree | validation loss f32 -> q |")
    print("| --- | --- | --- | --- | --- | --- |")
    rng = np.random.default_rng(0)
    if args.out_dir:
        from gpt.data.loader import Batches
        from gpt.tokenizer import get_tokenizer
        from gpt.train.checkpoint import load_model

        model = load_model(args.out_dir)
        val = Batches.of_split(Path(args.out_dir) / "data", "val", 256, 8, seed=0)
        windows = [val[i] for i in range(args.batches)]
        prompts = get_tokenizer().encode_batch(["def main(", "import os\n", "class Reader:", "    return self."])
        for row in measure(model, windows, prompts, f"default run ({args.out_dir})", True):
            print(row, flush=True)

    import torch
    import transformers

    from gpt.model import gpt2

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        transformers.GPT2LMHeadModel(transformers.GPT2Config()).save_pretrained(tmp)
        model = gpt2.load(tmp)
    windows = [rng.integers(0, 50256, (2, 257))]
    prompts = rng.integers(0, 50256, (4, 16)).tolist()
    for row in measure(model, windows, prompts, "GPT-2 shapes, random weights", False):
        print(row, flush=True)


if __name__ == "__main__":
    main()
