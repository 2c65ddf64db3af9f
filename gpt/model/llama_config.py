"""The config.json of a Llama-shaped family (`gpt.model.families`: Llama, Mistral, Qwen2, Qwen3, Gemma 3) read
into a `GPTConfig`, and written back.

What every model of a family has (its activation, norms, biases, QK-norm, Gemma's sandwich norms) is the
registry's (`Family.holds`); the rest is read here: the sizes, the rotary settings (one base, Llama 3's
scaling; Gemma's local and global bases), which layers are local (`Family.windows`) and Gemma's query scale.
A field this reader does not implement is a one-line ConfigError naming it, never a silent approximation.
"""

from __future__ import annotations

from gpt.errors import ConfigError
from gpt.model.config import GPTConfig
from gpt.model.config_json import MAX_CONTEXT, flag, integer, mapping, number
from gpt.model.families import Family, OneOf, Test, by_model_type, holding

__all__ = ["config_from_hf", "config_to_hf"]

_LAYER_TYPES = {"full_attention": "g", "sliding_attention": "l"}  # transformers' `layer_types`, as `layer_kinds`
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu"}  # transformers' names, as `GPTConfig.activation`


def config_from_hf(hf: dict, **overrides) -> GPTConfig:
    """A GPTConfig from a Llama-shaped family's `config.json`; ConfigError naming the first field it cannot hold."""
    family = by_model_type(hf)
    if family.reader != "llama":
        raise ConfigError(f"config.json: model_type {family.model_type!r} is {family.title}'s, not a Llama-shaped "
                          f"family's")
    _refuse_unsupported(family, hf)
    heads, width = integer(hf, "num_attention_heads"), integer(hf, "hidden_size")
    head_dim = integer(hf, "head_dim", width // heads) if hf.get("head_dim") is not None else width // heads
    fixed = {field: value for field, value in family.holds.items() if not isinstance(value, (OneOf, Test))}
    fields = dict(
        fixed, **_rope(family, hf), **_windows(family, hf),
        vocab_size=integer(hf, "vocab_size"), block_size=integer(hf, "max_position_embeddings", 2048, MAX_CONTEXT),
        n_layer=integer(hf, "num_hidden_layers"), n_head=heads, n_kv_head=integer(hf, "num_key_value_heads", heads),
        n_embd=width, mlp_width=integer(hf, "intermediate_size"), layer_norm_epsilon=number(hf, "rms_norm_eps", 1e-6),
        tied_head=flag(hf, "tie_word_embeddings", family.tied_by_default),
        head_size=None if head_dim * heads == width else head_dim,
    )
    if "query_scale" not in fixed:  # Gemma's scores are q . k / sqrt(query_pre_attn_scalar)
        scalar = number(hf, "query_pre_attn_scalar", 0.0)
        fields["query_scale"] = scalar ** -0.5 if scalar else None
    return GPTConfig(**{**fields, **overrides})


def _refuse_unsupported(family: Family, hf: dict) -> None:
    """ConfigError naming the first field of `hf` whose value this reader does not implement."""
    activation = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh" if family.holds[
        "activation"] == "gelu" else "silu"))
    wanted = next(name for name, ours in _ACTIVATIONS.items() if ours == family.holds["activation"])
    unsupported = {  # field: (its value, the values this reader reads, what another value would be)
        "hidden_act": (activation, (wanted,), f"an activation other than {family.title}'s"),
        "mlp_bias": (hf.get("mlp_bias", False), (False,), "biases in the MLP"),
        "attention_bias": (hf.get("attention_bias", False), (False,), "biases on the attention's projections"),
        "final_logit_softcapping": (hf.get("final_logit_softcapping"), (None,), "soft-capped logits"),
        "attn_logit_softcapping": (hf.get("attn_logit_softcapping"), (None,), "soft-capped attention scores"),
        "use_bidirectional_attention": (hf.get("use_bidirectional_attention") or False, (False,),
                                        "attention that sees later positions"),
    }
    for field, (value, supported, what) in unsupported.items():
        if value not in supported:
            raise ConfigError(f"config.json: {field}={value!r} ({what}) is not supported; this loader reads "
                              f"{field}={' or '.join(map(repr, supported))}")


def _rope(family: Family, hf: dict) -> dict:
    """The rotary fields of a config.json: its base (top-level rope_theta and rope_scaling, the hub's files; or
    one rope_parameters, transformers 5's) and Llama 3's scaling; Gemma's a base for global layers and one for
    local layers (rope_parameters by layer type, or rope_theta and rope_local_base_freq)."""
    parameters = mapping(hf, "rope_parameters")
    by_layer_type = "full_attention" in parameters
    default_theta, local_theta = family.rope_bases
    rope = {**(mapping(parameters, "full_attention") if by_layer_type else parameters),
            **mapping(hf, "rope_scaling")}  # a scaling wins
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    supported = family.rope_types
    if rope_type not in supported:
        raise ConfigError(f"config.json: rope_type={rope_type!r} (a rotary frequency scaling other than Llama 3's) "
                          f"is not supported; this loader reads rope_type={' or '.join(map(repr, supported))}")
    fields = dict(rope_theta=number(rope, "rope_theta", number(hf, "rope_theta", default_theta)))
    if local_theta is not None:  # the local layers' base, of their own
        local = mapping(parameters, "sliding_attention") if by_layer_type else {}
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"config.json: the local layers' rope_type={local['rope_type']!r} is not supported")
        fields["rope_local_theta"] = number(local, "rope_theta", number(hf, "rope_local_base_freq", local_theta))
    if rope_type == "llama3":
        required = {name: rope.get(name) for name in ("factor", "low_freq_factor", "high_freq_factor",
                                                      "original_max_position_embeddings")}
        if None in required.values():
            raise ConfigError(f"config.json: Llama 3's rotary scaling needs "
                              f"{', '.join(name for name, value in required.items() if value is None)}")
        fields.update(rope_scaling=number(rope, "factor", 1.0), rope_scaling_low=number(rope, "low_freq_factor", 1.0),
                      rope_scaling_high=number(rope, "high_freq_factor", 4.0),
                      rope_scaling_context=integer(rope, "original_max_position_embeddings", high=MAX_CONTEXT))
    return fields


def _windows(family: Family, hf: dict) -> dict:
    """The `layer_kinds` and `sliding_window` of a config.json (`Family.windows`): Mistral's window on every layer
    (none where `sliding_window` is null); on the layers `layer_types` names (transformers 5 writes them), else
    Qwen's from `max_window_layers` on where `use_sliding_window`, Gemma's five local layers to one global
    (`sliding_window_pattern`); none for Llama."""
    layers = integer(hf, "num_hidden_layers")
    window = integer(hf, "sliding_window", high=MAX_CONTEXT) if hf.get("sliding_window") is not None else None
    if family.windows == "every layer":
        kinds = "l" if window is not None else ""
    elif family.windows == "layer types":
        types = hf.get("layer_types")
        if not types and family.window_pattern is not None:
            pattern = integer(hf, "sliding_window_pattern", family.window_pattern)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        elif not types:
            first = integer(hf, "max_window_layers", 28, low=0)
            types = ["sliding_attention" if flag(hf, "use_sliding_window", False) and i >= first
                     else "full_attention" for i in range(layers)]
        unknown = sorted(set(map(str, types)) - set(_LAYER_TYPES)) if isinstance(types, list) else [types]
        if unknown or len(types) != layers:
            raise ConfigError(f"config.json: layer_types must list {layers} of {', '.join(_LAYER_TYPES)}, got "
                              f"{unknown or len(types)}")
        kinds = "".join(_LAYER_TYPES[t] for t in types)
    else:
        kinds = ""
    kinds = "l" if set(kinds) == {"l"} else "" if "l" not in kinds else kinds
    if kinds and window is None:
        raise ConfigError("config.json: some layers use a sliding window, but sliding_window is null")
    return dict(layer_kinds=kinds, sliding_window=window if kinds else None)


def config_to_hf(config: GPTConfig) -> dict:
    """The Hugging Face `config.json` of a Llama-shaped GPT (`config_from_hf` undone), in the format of the first
    Llama-shaped family that holds it (`gpt.model.families.holding`)."""
    family = holding(config, reader="llama")
    hf = {
        "architectures": [family.architecture], "model_type": family.model_type, "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd, "intermediate_size": config.mlp_dim, "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head, "num_key_value_heads": config.kv_heads, "head_dim": config.head_dim,
        "max_position_embeddings": config.block_size, "rms_norm_eps": config.layer_norm_epsilon,
        "tie_word_embeddings": config.tied_head, "attention_bias": False, "torch_dtype": "float32",
        **_rope_to_hf(family, config), **_windows_to_hf(family, config),
    }
    hf[family.activation_field] = next(name for name, ours in _ACTIVATIONS.items() if ours == config.activation)
    if "query_scale" in family.holds:
        hf.update(mlp_bias=False)
    else:  # Gemma's scores are q . k / sqrt(query_pre_attn_scalar)
        scalar = config.head_dim if config.query_scale is None else config.query_scale ** -2
        hf.update(final_logit_softcapping=None, attn_logit_softcapping=None,
                  query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar)
    return hf


def _rope_to_hf(family: Family, config: GPTConfig) -> dict:
    """`_rope` undone."""
    if family.rope_bases[1] is not None:  # a base for the local layers of their own
        local = config.rope_local_theta or config.rope_theta
        return {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": config.rope_theta},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": local}},
                "rope_theta": config.rope_theta, "rope_local_base_freq": local}
    scaling = None if config.rope_scaling == 1.0 else dict(
        rope_type="llama3", factor=config.rope_scaling, low_freq_factor=config.rope_scaling_low,
        high_freq_factor=config.rope_scaling_high, original_max_position_embeddings=config.rope_scaling_context)
    return {"rope_theta": config.rope_theta, "rope_scaling": scaling}


def _windows_to_hf(family: Family, config: GPTConfig) -> dict:
    """`_windows` undone: the fields of a config.json that say which layers are local, and their window."""
    if family.windows == "every layer":
        return {"sliding_window": config.sliding_window}
    if family.windows == "none":
        return {}
    kinds = [config.layer_kind(layer) for layer in range(config.n_layer)]
    types = {letter: name for name, letter in _LAYER_TYPES.items()}
    fields = {"sliding_window": config.sliding_window, "layer_types": [types[kind] for kind in kinds]}
    if family.window_pattern is None:  # Qwen's rule, beside layer_types
        fields.update(use_sliding_window="l" in kinds,
                      max_window_layers=kinds.index("l") if "l" in kinds else config.n_layer)
    return fields
