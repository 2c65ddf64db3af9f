"""What the speculative-decoding tests share: the prompts they decode, the target and drafts they name, and
those two as module fixtures (`model`, `smaller`: a test module imports them by name)."""

import pytest
from flax import nnx

from gpt import GPT, GPTConfig

from serving import decisive_model

PROMPTS = [  # ragged: a pattern the model may copy, text that does not repeat, a short loop
    [7, 3, 9, 1, 4, 7, 3, 9, 1, 4, 7, 3], list(range(30, 61)), [5, 6, 5, 6, 5], [200],
]


def smaller_draft() -> GPT:
    """A draft model: a GPT of another depth and width with the vocabulary and context of
    `serving.decisive_model(vocab_size=256)`."""
    return GPT(GPTConfig.preset("tiny", vocab_size=256, block_size=128, n_layer=1, n_embd=16, n_head=2),
               rngs=nnx.Rngs(9))


def the_draft(name, model, smaller):
    """A parameter's draft: a kind by name, "itself" (the model as its own draft model) or "smaller"."""
    return dict(itself=model, smaller=smaller).get(name, name)


@pytest.fixture(scope="module")
def model():
    """The target: `serving.decisive_model` over a vocabulary of 256."""
    return decisive_model(vocab_size=256)


@pytest.fixture(scope="module")
def smaller():
    return smaller_draft()
