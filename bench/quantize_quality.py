"""What int8, int4 and bf16 weights cost in quality: logits, KL divergence, greedy agreement, validation loss.

    python bench/quantize_quality.py --out_dir out        # the default run's trained model (after python train.py)
    python bench/quantize_quality.py                      # GPT-2 124M's and SmolLM2-135M's shapes, random weights
    python bench/quantize_quality.py --out_dir out --int4-variants --skip-random   # int4's choices, measured

For each model and each of int8, int4 and bf16 (weights laid out by `gpt.inference.decoder.decoding_weights`), and
llama.cpp's Q4_0 of the same block matrices (gguf-py's round trip, float activations, the embedding and head int8
as int4's: the bound int4 is held to), against float32: the largest absolute logit difference and the mean KL(float32 || quantized) over the positions
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
from gpt.inference.decoder import Decoder, decoding_weights
from gpt.inference.sampling import GREEDY
from gpt.model import int4
from gpt.model.layouts import OutputMajor
from gpt.model.transformer import forward, lm_head

from machine import cpu_name


@jax.jit
def _stats(logits_ref, logits, targets):
    log_p, log_q = jax.nn.log_softmax(logits_ref), jax.nn.log_softmax(logits)
    kl = (jnp.exp(log_p) * (log_p - log_q)).sum(-1).mean()
    nll = lambda lp: -jnp.take_along_axis(lp, targets[..., None], -1).mean()  # noqa: E731
    return jnp.abs(logits - logits_ref).max(), kl, nll(log_p), nll(log_q)


def round_trip_reference(model, round_trip, head_too: bool = False) -> Decoder:
    """The model's float32 decoding weights with every block matrix [K, D] replaced by `round_trip` of it (float32
    [K, D] -> float32 [K, D]), and the embedding and head int8 as `decoding_weights(model, "int4")` keeps them (the
    head round-tripped too where `head_too`): a quantization's weights, with float activations."""
    import dataclasses

    trip = lambda m: OutputMajor(jnp.asarray(round_trip(np.asarray(m.matrix_KD, np.float32))))  # noqa: E731
    floats, int8 = decoding_weights(model), decoding_weights(model, "int8")
    layers = tuple({name: trip(a) if isinstance(a, OutputMajor) else a for name, a in layer.items()}
                   for layer in floats.layers)
    head = trip(floats.head) if head_too else int8.head
    weights = dataclasses.replace(floats, layers=layers, embedding=int8.embedding, head=head)
    return Decoder(model.config, weights, "none", None)


def llama_cpp_round_trip(kind: str):
    """A matrix's round trip through llama.cpp's own quantizer (gguf-py) of type `kind` ("Q4_0", "Q4_1")."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kind = GGMLQuantizationType[kind]
    return lambda m: dequantize(quantize(m, kind), kind)


def int4_round_trip(block: int):
    """A matrix's round trip through int4's rounding (`gpt.model.int4.quantize`) with a scale every `block` inputs."""
    def trip(m):
        K, D = m.shape
        padded = np.pad(m, ((0, 0), (0, -D % block)))
        levels, block_scale, output_scale = (np.asarray(a) for a in int4.quantize(jnp.asarray(padded), block))
        scales = block_scale.astype(np.float32) * output_scale[:, None]
        return (levels.reshape(K, -1, block) * scales[..., None]).reshape(K, -1)[:, :D]
    return trip


def references(model, variants: bool) -> list[tuple[str, Decoder]]:
    """llama.cpp's Q4_0 of the same weights (the bound int4 is held to), and with `variants` the choices int4's layout
    made, each with float activations: its rounding as it is, at 64 inputs a scale, llama.cpp's Q4_1 (a zero point a
    block of 32), and the head in int4 too."""
    rows = [("Q4_0 (llama.cpp's)", round_trip_reference(model, llama_cpp_round_trip("Q4_0")))]
    if variants:
        rows += [("int4's rounding, float activations", round_trip_reference(model, int4_round_trip(int4.BLOCK))),
                 ("int4's rounding at 64 inputs a scale", round_trip_reference(model, int4_round_trip(64))),
                 ("Q4_1 (llama.cpp's: a zero point)", round_trip_reference(model, llama_cpp_round_trip("Q4_1"))),
                 ("int4's rounding, the head int4 too",
                  round_trip_reference(model, int4_round_trip(int4.BLOCK), head_too=True))]
    return rows


def measure(model, batches: list[np.ndarray], prompts, name: str, has_loss: bool, variants: bool = False) -> list[str]:
    config = model.config
    run = jax.jit(lambda w, t: lm_head(w, forward(config, w, t, jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape))[0]))
    steps = min(256, config.block_size - max(map(len, prompts)))  # the default run's context is 256
    greedy = generate(model, prompts, steps, sampling=GREEDY)
    weights = decoding_weights(model)
    rows = []
    decoders = [(quantize, Decoder.of(model, quantize)) for quantize in ("int8", "int4", "bf16")]
    for layout, decoder in [*decoders, *references(model, variants)]:
        stats = np.array([[float(s) for s in _stats(run(weights, jnp.asarray(b[:, :-1])),
                                                    run(decoder.weights, jnp.asarray(b[:, :-1])), jnp.asarray(b[:, 1:]))]
                          for b in batches])
        diff, (kl, loss_ref, loss) = stats[:, 0].max(), stats[:, 1:].mean(0)
        got = generate(decoder, prompts, steps, sampling=GREEDY)
        agree = np.mean([a == b for want, have in zip(greedy, got) for a, b in zip(want, have)])
        first = min(next((i for i, (a, b) in enumerate(zip(w, h)) if a != b), steps) for w, h in zip(greedy, got))
        loss_text = (f"{loss_ref:.5f} -> {loss:.5f} ({loss - loss_ref:+.5f}, {(loss - loss_ref) / loss_ref:+.2%})"
                     if has_loss else "-")
        rows.append(f"| {name} | {layout} | {diff:.3f} | {kl:.2e} | {agree:.1%} of {steps} x 4 (first difference at step {first}) | {loss_text} |")
    return rows


def random_models():
    """(name, GPT) of GPT-2 124M's and SmolLM2-135M's shapes with random weights, made by transformers."""
    import torch
    import transformers

    from gpt.loading import load

    torch.manual_seed(0)
    for name, model in [("GPT-2 shapes, random weights", transformers.GPT2LMHeadModel(transformers.GPT2Config())),
                        ("SmolLM2-135M shapes, random weights", transformers.LlamaForCausalLM(transformers.LlamaConfig(
                            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                            tie_word_embeddings=True)))]:
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            yield name, load(tmp)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default=None, help="a training out_dir (with data/) to measure too")
    parser.add_argument("--batches", type=int, default=4, help="validation windows of 256 tokens, 8 each")
    parser.add_argument("--int4-variants", action="store_true",
                        help="also the choices int4's layout made, with float activations: its rounding at 64 inputs "
                             "a scale, llama.cpp's Q4_1 (a zero point), the head in int4")
    parser.add_argument("--skip-random", action="store_true", help="the trained model (--out_dir) alone")
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
        for row in measure(model, windows, prompts, f"default run ({args.out_dir})", True, args.int4_variants):
            print(row, flush=True)

    for name, model in [] if args.skip_random else random_models():
        windows = [rng.integers(0, 49152, (2, 257))]
        prompts = rng.integers(0, 49152, (4, 16)).tolist()
        for row in measure(model, windows, prompts, name, False, args.int4_variants):
            print(row, flush=True)


if __name__ == "__main__":
    main()
