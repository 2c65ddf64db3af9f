"""The Hugging Face model families this project reads and writes, one registry entry each.

An entry says how a config.json names the family (`model_type`, its `architectures` class), which module
reads and writes its files (`reader`: `gpt.model.gpt2` for GPT-2's Conv1D format, `gpt.model.llama` for
the Llama-shaped ones), which `GPTConfig` values its format holds (`holds`: an export picks the first
family that holds a model), how its config.json says which layers are local (`windows`), and the few
facts of its weights that differ from Llama's (`renamed`). Adding a Llama-shaped family
is one entry here (docs/design.md, "Adding a model family").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

from gpt.errors import ConfigError
from gpt.model.config import GPTConfig

__all__ = ["Family", "OneOf", "Test", "FAMILIES", "by_model_type", "holding", "titles"]

# A GPTConfig field's values a format holds: one value, or a test of the value (with what it says to a user).
Holds = dict[str, object]


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face model family.

    Attributes:
      model_type: config.json's `model_type`.
      architecture: config.json's `architectures` entry (transformers' class for its causal LM).
      title: its name as its makers write it ("Qwen2").
      reader: the module that reads and writes its files: "gpt2" or "llama" (`gpt.model.pretrained`).
      holds: the `GPTConfig` values its format holds, field by field: a value, or `OneOf`/`Test` (fields
        not named: any value, the shape's sizes written to config.json).
      windows: how its config.json says which layers are local: "none" (no sliding windows), "every layer"
        (Mistral's `sliding_window`, on every layer or none), "layer types" (transformers' `layer_types`, or
        Qwen's `max_window_layers`, or Gemma's pattern of five local layers to one global).
      renamed: block weights whose Hugging Face names are not Llama's (`gpt.model.llama`), by our name.
      tied_by_default: a config.json without `tie_word_embeddings` ties the head to the embedding.
      rope_bases: the rotary bases a config.json that names none has: the global layers', and the local layers'
        where they have one of their own (Gemma's; None: the local layers share the global base).
      rope_types: the rotary scalings its format may name (`rope_type`).
      window_pattern: where `layer_types` is absent, one global layer after every `window_pattern - 1` local
        ones (Gemma's `sliding_window_pattern`, this its default); None: Qwen's `max_window_layers` rule.
      activation_field: the config.json field naming the activation (Gemma's `hidden_activation`).
    """

    model_type: str
    architecture: str
    title: str
    reader: Literal["gpt2", "llama"]
    holds: Holds
    windows: Literal["none", "every layer", "layer types"] = "none"
    renamed: dict[str, str] = dataclasses.field(default_factory=dict)
    tied_by_default: bool = False
    rope_bases: tuple[float, float | None] = (10_000.0, None)
    rope_types: tuple[str, ...] = ("default", "llama3")
    window_pattern: int | None = None
    activation_field: str = "hidden_act"

    def refusals(self, config: GPTConfig) -> list[str]:
        """What of `config` this family's format cannot hold, a phrase a field ([] where it holds all)."""
        refused = []
        for field, allowed in self.holds.items():
            value = getattr(config, field)
            if isinstance(allowed, Test):
                if not allowed.check(value, config):
                    refused.append(f"{field}={value!r} ({allowed.says})")
            elif value not in (allowed.values if isinstance(allowed, OneOf) else (allowed,)):
                wanted = " or ".join(map(repr, allowed.values)) if isinstance(allowed, OneOf) else repr(allowed)
                refused.append(f"{field}={value!r} ({self.title} has {wanted})")
        return refused


@dataclasses.dataclass(frozen=True)
class OneOf:
    values: tuple


@dataclasses.dataclass(frozen=True)
class Test:
    check: Callable[[object, GPTConfig], bool]
    says: str  # what the family has, for a refusal


_GLOBAL_OR_LOCAL = Test(lambda kinds, _: set(kinds) <= {"g", "l"}, "its layers are global or local")
_ONE_KEY_HEAD_A_QUERY_HEAD = Test(lambda _, config: config.kv_heads == config.n_head, "a key head per query head")
_MLP_A_MULTIPLE = Test(lambda width, config: width is None or width % config.n_embd == 0,
                       "an MLP width a multiple of the model's")  # its n_inner is read back as a ratio
_NO_GEMMA = dict(sandwich_norm=False, scale_embeddings=False, query_scale=None, norm_plus_one=False)
_LLAMA = dict(position="rope", norm="rmsnorm", gated_mlp=True, activation="silu", bias=False, rope_local_theta=None,
              **_NO_GEMMA)

FAMILIES = (  # in the order an export tries them
    Family("gpt2", "GPT2LMHeadModel", "GPT-2", "gpt2", dict(
        position="learned", bias=True, qk_norm=False, activation="gelu", tied_head=True, norm="layernorm",
        gated_mlp=False, head_size=None, n_kv_head=_ONE_KEY_HEAD_A_QUERY_HEAD, mlp_width=_MLP_A_MULTIPLE,
        layer_kinds="", **_NO_GEMMA)),
    Family("llama", "LlamaForCausalLM", "Llama", "llama", dict(
        **_LLAMA, qkv_bias=False, qk_norm=False, layer_kinds="")),
    Family("mistral", "MistralForCausalLM", "Mistral", "llama", dict(
        **_LLAMA, qkv_bias=False, qk_norm=False, layer_kinds=OneOf(("", "l"))), windows="every layer"),
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2", "llama", dict(
        **_LLAMA, qkv_bias=True, qk_norm=False, layer_kinds=_GLOBAL_OR_LOCAL), windows="layer types"),
    Family("qwen3", "Qwen3ForCausalLM", "Qwen3", "llama", dict(
        **_LLAMA, qkv_bias=False, qk_norm=True, layer_kinds=_GLOBAL_OR_LOCAL), windows="layer types"),
    Family("gemma3_text", "Gemma3ForCausalLM", "Gemma 3", "llama", dict(
        position="rope", norm="rmsnorm", gated_mlp=True, activation="gelu", bias=False, qkv_bias=False,
        qk_norm=True, sandwich_norm=True, scale_embeddings=True, norm_plus_one=True, layer_kinds=_GLOBAL_OR_LOCAL,
        rope_scaling=1.0),
        windows="layer types",
        renamed={"ln2_scale": "model.layers.{}.pre_feedforward_layernorm.weight",
                 "attn_out_norm_scale": "model.layers.{}.post_attention_layernorm.weight",
                 "mlp_out_norm_scale": "model.layers.{}.post_feedforward_layernorm.weight"},
        tied_by_default=True, rope_bases=(1_000_000.0, 10_000.0), rope_types=("default",), window_pattern=6,
        activation_field="hidden_activation"),
)
_BY_MODEL_TYPE = {family.model_type: family for family in FAMILIES}


def titles() -> str:
    """Every family's title, for a sentence: "GPT-2, Llama, ..., Gemma 3"."""
    return ", ".join(family.title for family in FAMILIES)


def by_model_type(hf: dict, where: str = "config.json") -> Family:
    """The family of a config.json: by its model_type, or by its architectures entry where it has no model_type;
    ConfigError naming the families there are where it is none of them (and saying so of a multimodal
    checkpoint, such as Gemma 3's, whose text model's config is a part of it)."""
    model_type, architectures = hf.get("model_type"), hf.get("architectures")
    if isinstance(model_type, str) and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    for family in FAMILIES:
        if model_type is None and isinstance(architectures, list) and family.architecture in architectures:
            return family
    multimodal = " (a multimodal checkpoint: its text model's own config is text_config)" if isinstance(
        hf.get("text_config"), dict) else ""
    raise ConfigError(f"{where}: model_type {model_type!r}{multimodal} is not a family this project reads; it reads "
                      f"{', '.join(repr(f.model_type) for f in FAMILIES)} ({titles()})")


def holding(config: GPTConfig, reader: str | None = None) -> Family:
    """The first family (of those `reader` reads, or of all) whose format holds a model of `config`; ConfigError
    naming what each cannot hold."""
    refusals = []
    for family in (f for f in FAMILIES if reader in (None, f.reader)):
        refused = family.refusals(config)
        if not refused:
            return family
        refusals.append(f"{family.title}: {', '.join(refused)}")
    raise ConfigError(f"no Hugging Face format this project writes holds this model ({'; '.join(refusals)}); it "
                      f"can still be sampled, served and evaluated from its training run's out_dir")
