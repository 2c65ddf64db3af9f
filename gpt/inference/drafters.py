"""What guesses a decode step's next tokens: one type, `Drafter`, of three kinds, each with one way to
propose up to K tokens a row inside the jitted decode step (`gpt.inference.decoding`), which verifies them
(`gpt.inference.speculation`: the same tokens as decoding without a draft, whatever the guesses).

- `PromptLookup` ("ngram"): the tokens that followed the latest earlier occurrence of the row's last n
  tokens in its own history;
- `SelfDraft` ("int8"): the model's own weights in int8, greedily, over the model's own cache;
- `DraftModel` (a smaller GPT with the same vocabulary, or its Decoder): greedily, over a cache of its own.

A drafter is a pytree: its weights are the decode program's traced arguments, its kind and shape the
static part that picks the program. `make_drafter` makes one, once, where an engine is made; what the slots
keep for it (each row's tokens, a cache of its own) it says itself (`keeps_history`, `cache_config`).

Shapes: R rows, C positions of a row's history (and of its caches), K drafted tokens a step.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp

from gpt.errors import ConfigError
from gpt.inference.decoder import Decoder, int8_draft_weights
from gpt.inference.sampling import first_argmax
from gpt.inference.speculation import DRAFTS, not_a_draft
from gpt.model.config import GPTConfig
from gpt.model.kv_cache import KVCache
from gpt.model.transformer import GPT, Weights, forward, lm_head

if TYPE_CHECKING:  # the slots' type is decoding's, which runs drafters: named here, not imported
    from gpt.inference.decoding import Slots

__all__ = ["Drafter", "PromptLookup", "SelfDraft", "DraftModel", "make_drafter", "ngram_drafts", "MAX_NGRAM",
           "CATCH_UP"]

MAX_NGRAM = 3  # the longest suffix prompt lookup looks for; shorter ones are tried when it is not found
CATCH_UP = 32  # positions a row a draft model runs at once of those it has not run (a new prompt's): the most any
# of its forwards writes (its first guess runs 2), so its cache's local layers keep rings of their window + 31


class Drafter:
    """Proposes up to K tokens a row for a decode step to verify (inside jit).

    Attributes:
      keeps_history: the slots keep each row's tokens at their positions (`Slots.history`) for it.
      catches_up: it runs a new prompt's tokens in its first call after the prompt enters (a cost of the
        request, which `DraftPolicy` does not charge to K).
    """

    keeps_history: ClassVar[bool] = False
    catches_up: ClassVar[bool] = False

    @property
    def cache_config(self) -> GPTConfig | None:
        """The shape of a KV cache of its own that the slots keep beside the model's (`Slots.draft_cache`),
        or None."""
        return None

    def propose(self, config: GPTConfig, slots: Slots, draft_tokens: int) -> tuple[jax.Array, jax.Array, Slots]:
        """K = `draft_tokens` guesses a row after each row's last token, for the model of shape `config`.
        Returns (drafts int32 [R, K], how many of each row's to verify int32 [R], the slots with whatever
        the guessing wrote)."""
        raise NotImplementedError

    def settle(self, before: Slots, verified: Slots, draft_tokens: int) -> Slots:
        """The slots after a verification (`verified`) of guesses proposed from `before`: what the drafter
        keeps of its own brought in line with the guesses that stood."""
        return verified


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLookup(Drafter):
    """Each row's guesses from its own history (`ngram_drafts`): free to make, right where text repeats."""

    keeps_history: ClassVar[bool] = True

    def propose(self, config, slots, draft_tokens):
        drafts_RK, count_R = ngram_drafts(slots.history, slots.cache.lengths, draft_tokens)
        return drafts_RK, count_R, slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SelfDraft(Drafter):
    """The model's own weights in int8 (`int8_draft_weights`), guessing greedily over the model's cache: it
    writes the guesses' keys and values where the verification then writes the model's."""

    weights: Weights

    def propose(self, config, slots, draft_tokens):
        cache = slots.cache
        start_R = jnp.where(slots.live, cache.lengths, 0)
        drafts_RK, written = _greedy(config, self.weights, cache, slots.last_token[:, None], start_R[:, None],
                                     draft_tokens)
        slots = dataclasses.replace(slots, cache=dataclasses.replace(written, lengths=cache.lengths))
        return drafts_RK, jnp.full_like(slots.last_token, draft_tokens), slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftModel(Drafter):
    """A smaller GPT (of shape `config`, with the model's vocabulary) guessing greedily over its own cache,
    whose lengths say how many of each row's positions it has run. It first runs the row's tokens it has
    not (`_catch_up`, from the row's history, up to the one before the last); its first guessing forward
    then runs that one and the last token, so that a step after which every guess stood, which leaves one
    position unrun, needs no catch-up."""

    keeps_history: ClassVar[bool] = True
    catches_up: ClassVar[bool] = True
    config: GPTConfig = dataclasses.field(metadata=dict(static=True))
    weights: Weights

    @property
    def cache_config(self) -> GPTConfig:
        return self.config

    def propose(self, config, slots, draft_tokens):
        lengths_R, live_R = slots.cache.lengths, slots.live
        cache = _catch_up(self.config, self.weights, slots.draft_cache, slots.history,
                          jnp.where(live_R, lengths_R - 1, 0))
        last_R = jnp.where(live_R, lengths_R, 1)  # the last token's position (>= 1: a prompt has a token)
        before_R = jnp.take_along_axis(slots.history, (last_R - 1)[:, None], axis=1)[:, 0]
        tokens_R2 = jnp.stack([before_R, slots.last_token], axis=1)
        drafts_RK, cache = _greedy(self.config, self.weights, cache, tokens_R2,
                                   last_R[:, None] + jnp.arange(-1, 1, dtype=jnp.int32), draft_tokens)
        return drafts_RK, jnp.full_like(slots.last_token, draft_tokens), dataclasses.replace(slots, draft_cache=cache)

    def settle(self, before, verified, draft_tokens):
        # It ran the last token and its guesses at positions L .. L + K - 1; those up to the first guess that
        # did not stand hold the real tokens' keys and values (the new length, at most L + K).
        ran_R = jnp.minimum(verified.cache.lengths, before.cache.lengths + draft_tokens)
        cache = verified.draft_cache
        lengths_R = jnp.where(before.live, ran_R, cache.lengths)
        return dataclasses.replace(verified, draft_cache=dataclasses.replace(cache, lengths=lengths_R))


def make_drafter(draft, target: Decoder, cache_length: int) -> Drafter | None:
    """The drafter `draft` names, for decoding with `target` over rows of `cache_length` positions: None
    (or "none") for none; "ngram" (`PromptLookup`); "int8" (`SelfDraft` of the target's weights:
    ConfigError for a target in int8 already); a smaller GPT, laid out as the target is, or its Decoder
    (`DraftModel`; ConfigError when it cannot draft for the target: `check_draft_model`); or a Drafter made
    for this target before, as it is."""
    if draft is None or isinstance(draft, str) and draft == "none":
        return None
    if isinstance(draft, Drafter):
        if draft.cache_config is not None:
            check_draft_model(draft.cache_config, target.config, cache_length)
        return draft
    if not (draft in DRAFTS if isinstance(draft, str) else isinstance(draft, (GPT, Decoder))):
        raise not_a_draft(draft)
    if draft == "ngram":
        return PromptLookup()
    with target.on_mesh():
        if draft == "int8":
            return SelfDraft(int8_draft_weights(target))
        check_draft_model(draft.config, target.config, cache_length)
        quantize = None if isinstance(draft, Decoder) else target.quantize
        decoder = Decoder.of(draft, quantize, target.mesh)
        return DraftModel(decoder.config, decoder.weights)


def check_draft_model(draft_config: GPTConfig, config: GPTConfig, cache_length: int) -> None:
    """ConfigError when a draft model (its GPTConfig, `draft_config`) cannot draft for a model of `config`
    over `cache_length` positions a row: another vocabulary (its ids would mean other tokens), or a
    context shorter than the rows it must follow."""
    if draft_config.vocab_size != config.vocab_size:
        raise ConfigError(f"the draft's vocabulary of {draft_config.vocab_size} tokens differs from the model's "
                          f"{config.vocab_size}: a draft must share the model's tokenizer")
    if draft_config.block_size < cache_length:
        raise ConfigError(f"the draft's context of {draft_config.block_size} positions is shorter than the "
                          f"{cache_length} positions a row may hold (cache_length)")


def ngram_drafts(history_RC: jax.Array, last_R: jax.Array, draft_tokens: int) -> tuple[jax.Array, jax.Array]:
    """Up to K = `draft_tokens` tokens per row from its own history (prompt lookup).

    history_RC: int32 [R, C], each row's tokens so far at their positions (prompt, then output); last_R:
    int32 [R], the position of each row's latest token. For n = MAX_NGRAM down to 1, the row's last n
    tokens are looked for earlier in its history; at the latest earlier place they occur (the first n
    that has one), the tokens after them are the draft, repeated from there when they reach the latest
    token (a loop of that period).

    Returns (drafts int32 [R, K], count int32 [R]): the draft's tokens (past `count`, anything) and how
    many there are (K, or 0 when no suffix recurs).
    """
    R, C = history_RC.shape
    start_C = jnp.arange(C, dtype=jnp.int32)
    found_R = jnp.zeros((R,), jnp.bool_)
    after_R = jnp.zeros((R,), jnp.int32)  # where the draft starts: the position after the match
    for n in range(MAX_NGRAM, 0, -1):
        # A match at start j: history[j + m] == history[last - n + 1 + m] for m < n, and it ends before the
        # suffix itself does (j + n - 1 < last).
        match_RC = (start_C[None, :] + n - 1 < last_R[:, None]) & (last_R[:, None] >= n - 1)
        for m in range(n):
            wanted_R = jnp.take_along_axis(history_RC, jnp.maximum(last_R - n + 1 + m, 0)[:, None], axis=1)
            shifted_RC = jnp.roll(history_RC, -m, axis=1)  # shifted[j] = history[j + m] (wrapped: never a match)
            match_RC &= shifted_RC == wanted_R
        latest_R = jnp.max(jnp.where(match_RC, start_C[None, :], -1), axis=1)
        take_R = ~found_R & (latest_R >= 0)
        after_R = jnp.where(take_R, latest_R + n, after_R)
        found_R |= take_R
    # Where the tokens after the match run out (they reach the latest token), the text is taken to repeat
    # with that period: "a b c a b" drafts "c a b c ...".
    period_R = jnp.maximum(last_R - after_R + 1, 1)
    positions_RK = after_R[:, None] + jnp.arange(draft_tokens, dtype=jnp.int32)[None, :] % period_R[:, None]
    drafts_RK = jnp.take_along_axis(history_RC, jnp.minimum(positions_RK, C - 1), axis=1)
    return drafts_RK, jnp.where(found_R, draft_tokens, 0)


def _catch_up(config: GPTConfig, weights: Weights, cache: KVCache, history_RC: jax.Array,
              target_R: jax.Array) -> KVCache:
    """The draft's cache with each row run up to position target_R (lengths >= target_R), CATCH_UP
    positions a row at a time from its history; a row that is not behind writes nowhere (past the end)."""
    C = history_RC.shape[1]
    chunk_T = jnp.arange(CATCH_UP, dtype=jnp.int32)

    def behind(cache: KVCache) -> jax.Array:
        return cache.lengths < target_R

    def run(cache: KVCache) -> KVCache:
        behind_R, ran_R = behind(cache), cache.lengths
        positions_RT = jnp.where(behind_R[:, None], ran_R[:, None], C) + chunk_T
        tokens_RT = jnp.take_along_axis(history_RC, jnp.minimum(positions_RT, C - 1), axis=1)
        cache = forward(config, weights, tokens_RT, positions_RT, cache)[1]
        ran_R = jnp.where(behind_R, jnp.minimum(ran_R + CATCH_UP, target_R), ran_R)
        return dataclasses.replace(cache, lengths=ran_R)

    return jax.lax.while_loop(lambda cache: jnp.any(behind(cache)), run, cache)


def _greedy(config: GPTConfig, weights: Weights, cache: KVCache, tokens_RT: jax.Array, positions_RT: jax.Array,
            draft_tokens: int) -> tuple[jax.Array, KVCache]:
    """K greedy tokens a row after tokens_RT (int32 [R, T], run at positions_RT over `cache`), each guess
    run at the next position for the one after it. Returns (int32 [R, K], the cache with their keys and
    values)."""
    next_R, drafts = positions_RT[:, -1] + 1, []
    for i in range(draft_tokens):
        x_RTD, cache = forward(config, weights, tokens_RT, positions_RT, cache)
        token_R = first_argmax(lm_head(weights, x_RTD[:, -1:])[:, 0])
        drafts.append(token_R)
        tokens_RT, positions_RT = token_R[:, None], (next_R + i)[:, None]
    return jnp.stack(drafts, axis=1), cache
