"""`train.py --compile_only TOPOLOGY`: the run's real step (its model, optimizer, mesh, dropout, accumulation)
compiled from shapes alone for a TPU topology on any machine, and what the compiled program needs of each device
(`gpt.program_report`). Nothing is read but a checkpoint's config.json, nothing written, no device allocated.
"""

from __future__ import annotations

import jax

from gpt.hardware import chip_of, parse_topology
from gpt.model.sharding import replicated
from gpt.model.transformer import model_summary, num_params
from gpt.program_report import ProgramReport, compile_within_memory, compiling_line, sharded_bytes
from gpt.train.step import abstract_train_state, flops_per_token, make_train_step
from gpt.train.trainer import FIT_ADVICE, TrainConfig, batch_shape, initial_checkpoint, mesh_and_model

__all__ = ["compile_train_step", "FIT_ADVICE"]


def compile_train_step(config: TrainConfig, log=print) -> ProgramReport:
    """Compile `config`'s train step for the topology `config.compile_only` names and report on it.

    Raises ConfigError for a bad topology, a mesh or batch that does not divide, a model the TPU compiler finds
    too large for the chip's memory, or a missing libtpu.
    """
    devices = parse_topology(config.compile_only).devices()
    config, model_config, mesh = mesh_and_model(config, devices, log, initial_checkpoint(config.init_from))
    tokens = config.grad_accum * config.batch_size * config.block_size
    accumulated = f" x {config.grad_accum} accumulated" if config.grad_accum > 1 else ""
    log(compiling_line(f"--compile_only {config.compile_only}",
                       f"the train step of {model_summary(model_config)}: {config.batch_size} sequences x "
                       f"{config.block_size:,} tokens{accumulated} ({tokens:,} tokens a step), weights "
                       f"{model_config.param_dtype}, compute {model_config.dtype}", devices, dict(mesh.shape)))
    graphdef, params, opt_state, shardings = abstract_train_state(model_config, config.optim, mesh)
    step = make_train_step(graphdef, config.optim, dropout=model_config.dropout > 0, mesh=mesh, shardings=shardings,
                           label_smoothing=config.label_smoothing)
    batch = batch_shape(config, mesh)  # the run's own
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=replicated(mesh))
    compiled = compile_within_memory(step.lower(params, opt_state, batch, key), "train step",
                                     devices[0].device_kind, f"--compile_only {config.compile_only}",
                                     f"try {FIT_ADVICE}")
    held = {"parameters": sharded_bytes(params), "optimizer state": sharded_bytes(opt_state)}
    # What no step avoids moving: each parameter and optimizer moment read and written once (a gradient need not
    # leave the chip where the update is fused into the backward pass).
    return ProgramReport.of("train step", compiled, devices, held, tokens,
                            flops_per_token(model_config, config.block_size) * tokens, chip_of(devices[0].device_kind),
                            floor_bytes=2 * sum(held.values()), trained_params=num_params(model_config))
