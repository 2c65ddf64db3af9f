"""Training recipes: named sets of architecture and optimizer choices, applied over any model shape.

`gpt2` is GPT-2's own (learned positions, GELU, biases, the head tied to the embedding, AdamW with a
cosine decay): the defaults, and what GPT-2 checkpoints load into. `modern` is the small-model recipe of
the GPT-2 speedrun (modded-nanogpt), in the pieces that carry over to any scale and device: rotary
positions, QK-norm, a relu(x)^2 MLP, no biases, an untied head, Muon for the blocks' matrices, and a
warmup-stable-decay schedule. Each piece is one `GPTConfig` or `TrainConfig` field, which a flag can
switch alone (`--model.no-qk-norm`, `--optimizer`, ...).

    python train.py --recipe modern                 # the `small` shape, the modern recipe
    python train.py --preset gpt2 --recipe modern   # GPT-2 124M's shape, the modern recipe
"""

from __future__ import annotations

import dataclasses

from gpt.errors import ConfigError
from gpt.train.trainer import TrainConfig

__all__ = ["Recipe", "RECIPES", "with_recipe"]


@dataclasses.dataclass(frozen=True)
class Recipe:
    """The fields a recipe sets: `model` of GPTConfig, `training` of TrainConfig's flags (the optimizer's
    among them)."""

    model: dict
    training: dict


RECIPES: dict[str, Recipe] = {
    "gpt2": Recipe(model={}, training={}),
    "modern": Recipe(
        model=dict(position="rope", qk_norm=True, activation="relu2", tied_head=False, bias=False),
        training=dict(optimizer="muon", schedule="wsd", decay_fraction=0.3, lr=3e-3, muon_lr=0.02),
    ),
}


def with_recipe(config: TrainConfig, name: str) -> TrainConfig:
    """`config` with recipe `name`'s fields set (its model shape and every other field kept)."""
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)}")
    recipe = RECIPES[name]
    return config.replace(model=config.model.replace(**recipe.model), **recipe.training)
