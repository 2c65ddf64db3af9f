"""`serve.py --compile_only TOPOLOGY`: an engine's largest programs, its prefill of a whole chunk and its decode
over every slot (with its drafter's guesses verified, under a draft), compiled from shapes alone for a TPU
topology on any machine, and what each needs of a device (`gpt.program_report`). The weights, a draft's, the
slots and their cache are laid out by the programs that lay them out for the engine, compiled too, so that their
shardings are the ones the engine would hold.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx
from jax.sharding import Mesh

from gpt.hardware import chip_of
from gpt.inference.decoder import check_int8_draft, decoding_weights
from gpt.inference.device_slots import FIT_ADVICE, compiled_init_slots, lower_largest, slots_over
from gpt.inference.drafters import Drafter, DraftModel, PromptLookup, SelfDraft, check_draft_model
from gpt.inference.engine_settings import EngineSettings
from gpt.model.config import GPTConfig
from gpt.model.sharding import abstract, data_parallel_size, param_shardings
from gpt.model.transformer import GPT, flops_per_token
from gpt.program_report import ProgramReport, compile_within_memory, sharded_bytes

__all__ = ["compile_engine", "FIT_ADVICE"]



def _abstract_outputs(jitted, *args, **kwargs):
    """The outputs of `jitted(*args)` as `jax.ShapeDtypeStruct`s with the shardings its compiled program gives
    them (nothing runs)."""
    compiled = jitted.lower(*args, **kwargs).compile()
    return abstract(compiled.out_info, compiled.output_shardings)


def _abstract_weights(config: GPTConfig, quantize: str, mesh: Mesh):
    """The decoding layout of a GPT of `config` on `mesh` (`decoding_weights`), as shapes with shardings."""
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    params = abstract(nnx.to_pure_dict(state), param_shardings(model, mesh))

    def lay_out(params):
        abstract = nnx.merge(graphdef, nnx.State(params))
        return decoding_weights(abstract, quantize)

    return _abstract_outputs(jax.jit(lay_out), params)


def _abstract_drafter(draft: str, draft_config: GPTConfig | None, config: GPTConfig, quantize: str,
                      mesh: Mesh) -> Drafter | str:
    """The drafter `gpt.inference.drafters.make_drafter` makes of `draft` ("ngram", "int8", or a model of shape
    `draft_config`), its weights as shapes with shardings; "none" as it is."""
    if draft == "ngram":
        return PromptLookup()
    if draft == "int8":  # `int8_draft_weights` is the int8 decoding layout of the model's own weights
        check_int8_draft(quantize)
        return SelfDraft(_abstract_weights(config, "int8", mesh))
    if draft_config is None:
        return draft
    return DraftModel(draft_config, _abstract_weights(draft_config, quantize, mesh))


def compile_engine(config: GPTConfig, settings: EngineSettings, quantize: str, mesh: Mesh,
                   setting: str = "--compile_only", draft_config: GPTConfig | None = None) -> list[ProgramReport]:
    """Reports on the prefill of `settings.prefill_chunk` tokens (or the whole cache, if shorter) for a prefill's
    rows, and on one decode call over every slot, for a model of `config` served over `mesh` (of any devices: a
    TPU topology's). Under a draft (`settings.draft`: "ngram", "int8", or a model, whose shape `draft_config`
    gives), the decode verifies `settings.draft_tokens` guesses a row a step, as the engine's largest does.
    ConfigError naming `setting` for a program the compiler finds too large for the chip."""
    devices = list(mesh.devices.flat)
    chip = chip_of(devices[0].device_kind)
    with jax.set_mesh(mesh):
        drafter = _abstract_drafter(settings.draft, draft_config, config, quantize, mesh)
        settings = dataclasses.replace(settings, draft=drafter).checked(config)
        if draft_config is not None:
            check_draft_model(draft_config, config, settings.cache_length)
        drafter = drafter if settings.draft_tokens else None
        weights = _abstract_weights(config, quantize, mesh)
        rows = data_parallel_size(mesh)
        slots_count = slots_over(settings.slots, rows)  # the engine's own rounding
        slots = _abstract_outputs(compiled_init_slots, config, slots_count, settings.cache_length,
                                  settings.max_stop_tokens, drafter is not None and drafter.keeps_history,
                                  None if drafter is None else drafter.cache_config, settings.draft_tokens)
        piece = min(settings.prefill_chunk, settings.cache_length)
        lowered = lower_largest(config, weights, slots, rows, piece, settings.steps_per_call, settings.draft_tokens,
                                drafter)
        prefill, decode = (compile_within_memory(program, name, devices[0].device_kind, setting, FIT_ADVICE)
                           for program, name in zip(lowered, ("prefill", "decode")))
    held = {"weights": sharded_bytes(weights), "slots and their cache": sharded_bytes(slots)}
    if drafter is not None and sharded_bytes(drafter):
        held["draft weights"] = sharded_bytes(drafter)
    forward = lambda length: flops_per_token(config, length) / 3  # noqa: E731 (no backward)
    # A decode step verifies K guesses and the last token: K + 1 positions a row, up to K + 1 tokens.
    decoded = slots_count * settings.steps_per_call * (settings.draft_tokens + 1)
    verifying = f", {settings.draft_tokens} guesses of {type(drafter).__name__} a step" if drafter else ""
    # What no call avoids moving: the weights read once (a prefill), and a decode's every step reading them and
    # the cache its FLOPs attend over (its slots', at their full length).
    return [ProgramReport.of(f"prefill of {rows} x {piece} tokens", prefill, devices, {"weights": held["weights"]},
                             rows * piece, forward(piece) * rows * piece, chip, floor_bytes=held["weights"]),
            ProgramReport.of(f"decode of {slots_count} slots x {settings.steps_per_call} step(s){verifying}", decode,
                             devices, held, decoded, forward(settings.cache_length) * decoded, chip,
                             floor_bytes=settings.steps_per_call * sum(held.values()))]
