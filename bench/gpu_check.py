"""Numerical checks for a GPU run; prints each and exits 1 if any fails.

    python bench/gpu_check.py            # GPT-2 124M shapes, random weights
    python bench/gpu_check.py --smoke    # tiny shapes (runs anywhere: on a CPU the device is the host)

- attention: `gpt.model.attention.fused_causal`, as the model calls it on a GPU (cuDNN's fused kernel
  at bfloat16) against the plain softmax(q k^T / sqrt(H)) v in float32 at the highest matmul precision, on the
  same bfloat16 operands, forward and gradients;
- logits: the model in float32 on the device against the same weights on the CPU (the reference), and
  in bfloat16 on the device against float32 on the device, no further apart than the CPU's own bfloat16
  logits are from its float32 ones, times BFLOAT16_MODEL_MARGIN;
- a train step: its loss and gradient norm in float32 on the device against the CPU.

The CPU's side runs in a process of its own (`JAX_PLATFORMS=cpu`, this script with `--cpu_reference`),
given the weights and inputs in an .npz, and prints its time apart. On an H200 (JAX 0.11.2) the float32
forward at the highest precision took 83 s to compile on the GPU, its bfloat16 forward 4 s, the CPU's side
11-14 s; XLA's GEMM autotuning is switched off here (`--xla_gpu_autotune_level=0`, unless XLA_FLAGS sets the
level): the checks need no fastest kernel, and the group times printed say whether that was the cost.

Error is the normwise relative error ||got - want|| / ||want|| (2-norm over the whole array); the largest
element's error, max |got - want| / max |want|, is printed beside it. Bounds on the first: 1e-4 in float32
(well under 1e-3; the float32 matmuls run at the highest precision here), 1e-2 for one attention on
bfloat16 operands (whose rounding is 2**-9 ~ 2e-3 per operation). The whole model in bfloat16 rounds its
residual stream at each of its 2 x 12 additions: at GPT-2's shapes (random weights, batch 2 x 1024) its
logits differ from float32 by 1.10e-2 on a 2-core AMD EPYC, 1.15e-2 with XLA's excess precision off
(`--xla_allow_excess_precision=false`, each operation's bfloat16 result rounded: the H200's figure), so
that check's bound is the CPU's own figure on the same weights, times BFLOAT16_MODEL_MARGIN: a GPU that
computes the same function lands near 1x; a wrong kernel lands far off.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if "xla_gpu_autotune_level" not in os.environ.get("XLA_FLAGS", ""):  # see the docstring; before jax loads
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_autotune_level=0".strip()

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from flax import nnx

from gpt.model.attention import fused_causal
from gpt.model.config import GPTConfig
from gpt.model.sharding import make_mesh
from gpt.model.transformer import GPT
from gpt.train.optimizer import OptimizerConfig
from gpt.train.step import init_train_state, make_train_step

FLOAT32_BOUND, BFLOAT16_BOUND = 1e-4, 1e-2
BFLOAT16_MODEL_MARGIN = 1.25


@dataclasses.dataclass(frozen=True)
class Check:
    smoke: bool = False
    batch: int = 2
    block_size: int = 1024
    cpu_reference: str | None = None
    """(Internal) a directory holding in.npz: compute the CPU's side into out.npz there, and exit."""


def relative_error(got, want) -> float:
    """||got - want|| / ||want||."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def largest_error(got, want) -> float:
    """max |got - want| / max |want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def plain_attention(q, k, v):
    """float32 causal softmax attention at the highest precision: [B, T, N, H] -> [B, T, N, H]."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    scores = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") / np.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", weights, v, precision="highest")


def attention_checks(check: Check) -> list[tuple]:
    B, T, N, H = check.batch, check.block_size, 12, 64
    q, k, v = (jax.random.normal(key, (B, T, N, H), jnp.bfloat16) for key in jax.random.split(jax.random.key(0), 3))
    def summed(attention):
        return lambda q, k, v: (attention(q, k, v).astype(jnp.float32) * jnp.cos(jnp.arange(H))).sum()

    got = jax.jit(fused_causal)(q, k, v)  # as the model calls it: cuDNN's kernel where it takes the call
    want = jax.jit(plain_attention)(q, k, v)
    grads_got = jax.jit(jax.grad(summed(fused_causal), argnums=(0, 1, 2)))(q, k, v)
    grads_want = jax.jit(jax.grad(summed(plain_attention), argnums=(0, 1, 2)))(q, k, v)
    name = f"attention ({'cudnn' if jax.default_backend() == 'gpu' else 'xla'}, bfloat16 operands)"
    return [(f"{name}, forward", got, want, BFLOAT16_BOUND)] + [
        (f"{name}, d{x}", g, w, BFLOAT16_BOUND) for x, g, w in zip("qkv", grads_got, grads_want)]


def model_config(check: Check, dtype: str) -> GPTConfig:
    if check.smoke:
        return GPTConfig.preset("small", n_layer=2, n_head=2, n_embd=64, block_size=check.block_size, vocab_size=512,
                                dtype=dtype)
    return GPTConfig.preset("gpt2", dtype=dtype)


def weights_and_inputs(check: Check) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """The float32 model's weights (its state's leaves, in order), a batch of tokens [B, T] for the logits
    and one of [1, B, T + 1] for a train step."""
    config = model_config(check, "float32")
    model = GPT(config, rngs=nnx.Rngs(0))
    weights = [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model))]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (check.batch, check.block_size), dtype=np.int32)
    batch = rng.integers(0, config.vocab_size, (1, check.batch, check.block_size + 1), dtype=np.int32)
    return weights, tokens, batch


def model_state(check: Check, dtype: str, weights: list[np.ndarray]):
    """(graphdef, state) of the model in `dtype`, holding `weights` (no initialization run)."""
    config = model_config(check, dtype)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))))
    return graphdef, jax.tree.unflatten(jax.tree.structure(abstract), weights)


def logits(check: Check, weights, tokens, device, dtype: str) -> np.ndarray:
    graphdef, state = model_state(check, dtype, weights)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    with jax.default_matmul_precision("highest"):
        return np.asarray(forward(jax.device_put(state, device), jax.device_put(tokens, device)), np.float32)


def train_step(check: Check, weights, batch, device) -> tuple[float, float]:
    """One float32 train step on `device` alone: (loss, gradient norm)."""
    graphdef, state = model_state(check, "float32", weights)
    optimizer = OptimizerConfig(max_steps=100)
    mesh = make_mesh(devices=[device])
    graphdef, params, opt_state, shardings = init_train_state(nnx.merge(graphdef, state), optimizer, mesh)
    step = make_train_step(graphdef, optimizer, dropout=False, mesh=mesh, shardings=shardings)
    with jax.default_matmul_precision("highest"):
        _, _, metrics = step(params, opt_state, jax.device_put(batch, device), jax.random.key(0))
    return float(metrics["loss"]), float(metrics["grad_norm"])


def cpu_side(check: Check) -> None:
    """The --cpu_reference process: the logits (float32 and bfloat16) and a float32 train step on the CPU,
    from in.npz into out.npz."""
    directory = Path(check.cpu_reference)
    given = np.load(directory / "in.npz")
    weights = [given[f"w{i}"] for i in range(sum(name.startswith("w") for name in given.files))]
    cpu = jax.devices("cpu")[0]
    loss, norm = train_step(check, weights, given["batch"], cpu)
    np.savez(directory / "out.npz", logits=logits(check, weights, given["tokens"], cpu, "float32"),
             logits_bfloat16=logits(check, weights, given["tokens"], cpu, "bfloat16"), loss=loss, grad_norm=norm)


def cpu_reference(check: Check, weights, tokens, batch) -> dict[str, np.ndarray]:
    """The CPU's logits (float32 and bfloat16), loss and gradient norm, computed in a process of its own."""
    with tempfile.TemporaryDirectory() as directory:
        np.savez(Path(directory) / "in.npz", tokens=tokens, batch=batch, **{f"w{i}": w for i, w in enumerate(weights)})
        flags = ["--batch", str(check.batch), "--block_size", str(check.block_size)] + ["--smoke"] * check.smoke
        subprocess.run([sys.executable, __file__, *flags, "--cpu_reference", directory], check=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
        with np.load(Path(directory) / "out.npz") as out:
            return {name: out[name] for name in out.files}


def logits_checks(check: Check, weights, tokens, reference) -> list[tuple]:
    device = jax.devices()[0]
    on_device = logits(check, weights, tokens, device, "float32")
    in_bf16 = logits(check, weights, tokens, device, "bfloat16")
    cpu_bf16_error = relative_error(reference["logits_bfloat16"], reference["logits"])
    print(f"# the CPU's bfloat16 logits differ from its float32 ones by {cpu_bf16_error:.2e}", flush=True)
    return [(f"logits float32, {device.platform} vs cpu", on_device, reference["logits"], FLOAT32_BOUND),
            (f"logits bfloat16 vs float32 on {device.platform} ({BFLOAT16_MODEL_MARGIN}x the CPU's)", in_bf16,
             on_device, BFLOAT16_MODEL_MARGIN * cpu_bf16_error)]


def step_checks(check: Check, weights, batch, reference) -> list[tuple]:
    device = jax.devices()[0]
    loss, norm = train_step(check, weights, batch, device)
    return [(f"train step loss float32, {device.platform} vs cpu", loss, float(reference["loss"]), FLOAT32_BOUND),
            (f"train step grad norm float32, {device.platform} vs cpu", norm, float(reference["grad_norm"]),
             FLOAT32_BOUND)]


def run_group(name: str, checks, failed: list[str]) -> None:
    """Runs one group of checks, prints its time and a row per check, and notes the ones that fail."""
    start = time.perf_counter()
    results = checks()
    print(f"# {name}: {time.perf_counter() - start:.1f} s", flush=True)
    for check_name, got, want, bound in results:
        error = relative_error(got, want)
        print(f"| {check_name} | {error:.2e} | {bound:.2e} | {'yes' if error <= bound else 'NO'} | "
              f"{largest_error(got, want):.2e} |", flush=True)
        if not error <= bound:
            failed.append(check_name)


def main(check: Check) -> int:
    print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}; batch {check.batch} x block {check.block_size}")
    print("| check | relative error | bound | ok | largest element's error |\n| --- | --- | --- | --- | --- |")
    failed = []
    run_group("attention_checks", lambda: attention_checks(check), failed)
    weights, tokens, batch = weights_and_inputs(check)
    start = time.perf_counter()
    reference = cpu_reference(check, weights, tokens, batch)
    print(f"# the CPU's side, in a process of its own: {time.perf_counter() - start:.1f} s", flush=True)
    run_group("logits_checks", lambda: logits_checks(check, weights, tokens, reference), failed)
    run_group("step_checks", lambda: step_checks(check, weights, batch, reference), failed)
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    arguments = tyro.cli(Check)
    if arguments.smoke:  # tiny shapes: the model's in model_config, the block here
        arguments = dataclasses.replace(arguments, block_size=64)
    if arguments.cpu_reference is not None:
        sys.exit(cpu_side(arguments))
    sys.exit(main(arguments))
