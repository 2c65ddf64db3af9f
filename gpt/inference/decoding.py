"""The engine's device side: the slots' state and four verbs, pure functions of pytrees run as jitted
programs over weights laid out for decoding (`gpt.inference.decoder`):

  prefill: a prompt, or the next piece of one, into a `Prefix` (its own cache), scoring the prompt's
    tokens (`PromptScores`) for the rows that ask;
  insert: prefixes run to their prompts' ends into slots, each with its first token (two programs:
    `choose_first`, one per row count, and `place`, one per prefix length);
  decode: steps for every live slot (JetStream's `generate`);
  free: slots that stop, their requests gone.

`gpt.inference.engine` decides what runs when. A prompt longer than the engine's prefill chunk runs a
chunk per round (`prefill` over the same Prefix, between decode calls) and is inserted after its last;
a short one runs whole over a fresh Prefix. Shapes: S slots, C cache slots per row, b rows per prefill,
P their (bucketed) prompt length or chunk, V vocabulary, K stop tokens per slot, J top logprobs, M decode
steps per call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from gpt.inference.drafters import CATCH_UP, Drafter
from gpt.inference.sampling import TOP_LOGPROBS, SamplingParams, choose
from gpt.inference.scoring import scored_positions, token_scores
from gpt.inference.speculation import count_standing
from gpt.model.backend import choices
from gpt.model.config import GPTConfig
from gpt.model.kv_cache import KVCache
from gpt.model.sharding import constrain
from gpt.model.transformer import Weights, forward, lm_head

NO_TOKEN = -1  # an Emitted entry where a row produced nothing

__all__ = ["NO_TOKEN", "Settings", "Slots", "Admission", "Prefix", "PromptScores", "Emitted",
           "init_slots", "init_prefix", "prefill", "insert", "choose_first", "place", "decode", "free",
           "decode_chunk_length", "compiled_choose_first", "compiled_place"]




@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Settings:
    """What a request asked for, one row per request ([R, ...] each: R slots, or an insert's rows).

    params: the sampling knobs. seed, stream: uint32; a request's draws use key(seed) folded with stream,
    then with the number of tokens chosen so far (`generate` gives row i of one call stream i).
    stop_tokens: int32 [R, K], ids that end the request (-2 pads). top_logprobs: bool, the request wants
    the top-J alternatives of each token.
    """

    params: SamplingParams
    seed: jax.Array
    stream: jax.Array
    stop_tokens: jax.Array
    top_logprobs: jax.Array

    @classmethod
    def empty(cls, rows: int, max_stop_tokens: int) -> Settings:
        return cls(params=SamplingParams.rows(rows), seed=jnp.zeros((rows,), jnp.uint32),
                   stream=jnp.zeros((rows,), jnp.uint32), stop_tokens=jnp.full((rows, max_stop_tokens), -2, jnp.int32),
                   top_logprobs=jnp.zeros((rows,), jnp.bool_))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """Everything the device keeps per slot between engine steps.

    Attributes:
      cache: the KV cache, one row per slot, each with its own length.
      last_token: int32 [S], the token to feed at the slot's next step.
      live: bool [S], the slot holds a request that is still generating.
      remaining: int32 [S], how many more tokens the request may emit.
      generated: int32 [S], tokens chosen so far (the position in the request's PRNG stream).
      seen: bool [S, V], tokens in the prompt or output (for the repetition penalty).
      settings: each slot's request's knobs.
      history: int32 [S, C], each slot's tokens at their positions (prompt, output, its last token at
        its cache's length), for a drafter that `keeps_history` (`gpt.inference.drafters`); None without.
      draft_cache: a draft model's own KV cache (its `cache_config`), its lengths how many of each slot's
        positions hold the draft's keys and values of the slot's real tokens; None without one.
    """

    cache: KVCache
    last_token: jax.Array
    live: jax.Array
    remaining: jax.Array
    generated: jax.Array
    seen: jax.Array
    settings: Settings
    history: jax.Array | None = None
    draft_cache: KVCache | None = None

    def laid_out(self) -> Slots:
        """These slots pinned to one layout under a mesh (a no-op without one): every per-slot array's rows over
        the data axes, the caches as `KVCache.laid_out`. Every program that returns slots ends with it: left to
        the compiler, a slot's arrays took the layouts of whatever computed them (a row's scalars over tensor,
        `seen` over fsdp), and each new layout compiled the next program again, mid-serve."""
        rows = lambda a: constrain(a, ("batch",) + (None,) * (a.ndim - 1))  # noqa: E731
        rest = jax.tree.map(rows, dataclasses.replace(self, cache=None, draft_cache=None))
        draft_cache = None if self.draft_cache is None else self.draft_cache.laid_out()
        return dataclasses.replace(rest, cache=self.cache.laid_out(), draft_cache=draft_cache)

    def select(self, rows_R: jax.Array) -> Slots:
        """Slots `rows_R` (int32 [R], distinct) alone: their rows of every array, over views of the caches."""
        rest = jax.tree.map(lambda a: a[rows_R], dataclasses.replace(self, cache=None, draft_cache=None))
        draft_cache = None if self.draft_cache is None else self.draft_cache.select(rows_R)
        return dataclasses.replace(rest, cache=self.cache.select(rows_R), draft_cache=draft_cache)

    def merge(self, rows_R: jax.Array, view: Slots) -> Slots:
        """These slots after `view` (`select(rows_R)`) has run."""
        put = lambda mine, theirs: mine.at[rows_R].set(theirs, unique_indices=True)  # noqa: E731
        caches = dict(cache=None, draft_cache=None)
        rest = jax.tree.map(put, dataclasses.replace(self, **caches), dataclasses.replace(view, **caches))
        draft_cache = None if self.draft_cache is None else self.draft_cache.merge(view.draft_cache)
        return dataclasses.replace(rest, cache=self.cache.merge(view.cache), draft_cache=draft_cache)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Admission:
    """b requests entering slots: the host's side of one `insert` ([b] each).

    slots: int32, where each goes (S or more for a row that enters no slot). max_tokens: int32, how many
    tokens each may emit. settings: what each asked for. prompt: int32 [b, C], each prompt right-padded to
    the slots' length, for their `history` (None when they keep none).
    """

    slots: jax.Array
    max_tokens: jax.Array
    settings: Settings
    prompt: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prefix:
    """The prompts of b requests, run so far: a cache of their own until they enter their slots.

    A prompt longer than a prefill chunk runs a chunk per engine round (`prefill` over the same Prefix),
    so that the live slots decode between its chunks rather than wait for all of it, and is inserted into
    its slot after its last. A short prompt runs whole over a fresh Prefix of its bucket's length.

    cache: b rows; each row's length is how many of its prompt's tokens have run. seen: bool [b, V], those
    tokens (for the repetition penalty). last_hidden: [b, D], the final hidden state after each row's
    latest real token (where its first token is chosen from).
    """

    cache: KVCache
    seen: jax.Array
    last_hidden: jax.Array


def init_prefix(config: GPTConfig, rows: int, length: int) -> Prefix:
    """An empty Prefix of `rows` rows and `length` cache slots (one page: a prompt's chunks attend to
    all of it at once)."""
    return Prefix(cache=KVCache.init(config, rows, length), seen=jnp.zeros((rows, config.vocab_size), jnp.bool_),
                  last_hidden=jnp.zeros((rows, config.n_embd), config.compute_dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptScores:
    """How likely each of a piece's prompt tokens was, given those before it ([b, P, ...] each).

    logprob: float32 [b, P], at position p the log-probability of the prompt's next token (the piece's
    `targets`[p]) after tokens <= p. top_ids, top_logprobs: [b, P, J], the J most likely next tokens
    there. Zeros unless a row asked (`score`), the alternatives unless a scored row wants them too.
    """

    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def score_prompt(weights: Weights, x_bPD: jax.Array, targets_bP: jax.Array, score_b: jax.Array,
                 top_b: jax.Array) -> PromptScores:
    """`PromptScores` from the final hidden states x_bPD of a piece: the LM head at every position, run
    only when some row is scored (`score_b`; bool [b]), the top J only when one of those wants them
    (`top_b`). A token's logprob and its top-J entry come from the same logits, so they are equal when
    it is the most likely (how lm-evaluation-harness tells a greedy continuation)."""
    b, P = targets_bP.shape
    J, wants_top = TOP_LOGPROBS, jnp.any(score_b & top_b)

    def scores():
        logprob, top_ids, top_logprobs = scored_positions(weights, x_bPD.reshape(b * P, -1),
                                                          targets_bP.reshape(b * P), wants_top)
        return PromptScores(logprob.reshape(b, P), top_ids.reshape(b, P, J), top_logprobs.reshape(b, P, J))

    nothing = lambda: PromptScores(jnp.zeros((b, P)), jnp.zeros((b, P, J), jnp.int32), jnp.zeros((b, P, J)))  # noqa: E731
    return jax.lax.cond(jnp.any(score_b), scores, nothing)


def prefill(config: GPTConfig, weights: Weights, prefix: Prefix | None, tokens_bP: jax.Array, lengths_b: jax.Array,
            targets_bP: jax.Array, score_b: jax.Array, top_b: jax.Array) -> tuple[Prefix, PromptScores]:
    """Run the next piece of each row's prompt into `prefix` (None: a fresh one of P positions, for a
    prompt that runs whole), at the row's next positions.

    tokens_bP: int32 [b, P], the pieces right-padded to their real lengths lengths_b (int32 [b]; 0 for a
    row with nothing left). Scored for the rows in score_b (bool [b]) against targets_bP (int32 [b, P],
    each token's successor in the prompt), with the top alternatives where top_b (bool [b]) asks.
    """
    b, P = tokens_bP.shape
    prefix = init_prefix(config, b, P) if prefix is None else prefix
    start_b, rows_b = prefix.cache.lengths, jnp.arange(b)
    x_bPD, cache = forward(config, weights, tokens_bP, prefix.cache.next_positions(P), prefix.cache)
    # The padding's keys and values lie past each row's length, where the next piece (or, in a slot,
    # the next token) writes before any query can see them.
    cache = dataclasses.replace(cache, lengths=start_b + lengths_b)
    real_bP = jnp.arange(P)[None, :] < lengths_b[:, None]
    seen_bV = prefix.seen.at[rows_b[:, None], tokens_bP].max(real_bP)
    last_bD = jnp.where((lengths_b > 0)[:, None], x_bPD[rows_b, jnp.maximum(lengths_b - 1, 0)], prefix.last_hidden)
    scores = score_prompt(weights, x_bPD, targets_bP, score_b, top_b)
    return Prefix(cache=cache, seen=seen_bV, last_hidden=last_bD), scores


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Emitted:
    """What steps produced, [M, R] each for M steps over R rows (slots, or an insert's rows).

    token: int32, NO_TOKEN where a row chose nothing; stopped: bool, the token is a stop token, which ends
    its row unemitted; logprob: float32, the token's log-probability under the model (before any
    sampling knob); top_ids, top_logprobs: [M, R, J], the J most likely tokens (zeros unless some row
    asked for them); live: bool [R], whether each row is still generating after the last step; count:
    int32 [R], how many entries each row holds (its first `count`; a step with a draft writes up to K + 1
    a row, so rows differ); drafted: int32 [R], each row's drafted tokens verified; reached, stood: int32
    [R, K] (K the call's drafted tokens a step, 0 without), at how many steps each row's guess i was
    verified with every guess before it standing, and at how many it stood (its acceptance, position by
    position: `gpt.inference.draft_policy`); steps: int32, the steps the call ran.
    """

    token: jax.Array
    stopped: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    live: jax.Array
    count: jax.Array
    drafted: jax.Array
    reached: jax.Array
    stood: jax.Array
    steps: jax.Array

    PER_ROW = ("live", "count", "drafted", "reached", "stood")  # [R, ...]; the others but steps are [M, R, ...]

    @classmethod
    def empty(cls, max_steps: int, live_R: jax.Array, draft_tokens: int = 0) -> Emitted:
        """Nothing emitted yet by `max_steps` steps over rows whose liveness is `live_R` [R], verifying
        `draft_tokens` a step."""
        M, R, J = max_steps, live_R.shape[0], TOP_LOGPROBS
        return cls(token=jnp.full((M, R), NO_TOKEN, jnp.int32), stopped=jnp.zeros((M, R), jnp.bool_),
                   logprob=jnp.zeros((M, R)),
                   top_ids=jnp.zeros((M, R, J), jnp.int32), top_logprobs=jnp.zeros((M, R, J)), live=live_R,
                   count=jnp.zeros((R,), jnp.int32), drafted=jnp.zeros((R,), jnp.int32),
                   reached=jnp.zeros((R, draft_tokens), jnp.int32), stood=jnp.zeros((R, draft_tokens), jnp.int32),
                   steps=jnp.int32(0))


def init_slots(config: GPTConfig, num_slots: int, cache_length: int, max_stop_tokens: int,
               history: bool = False, draft_config: GPTConfig | None = None, max_draft_tokens: int = 0) -> Slots:
    """Empty slots (all free) over a zeroed cache of `cache_length` positions per slot, paged on CPU so
    that a decode step reads only the pages its rows have reached (on a GPU, one page that cuDNN's
    attention reads under the mask), a local layer's a ring of its window and a step's verified positions
    (`max_draft_tokens` + 1: `KVCache.init`); with each slot's `history` when `history`, and a cache of the same
    positions of shape `draft_config` when one is given: what a drafter keeps (`gpt.inference.drafters`; its
    forwards write up to CATCH_UP positions a row)."""
    S = num_slots
    page_length = choices().kv_page_length
    return Slots(
        cache=KVCache.init(config, S, cache_length, page_length, writes=max_draft_tokens + 1),
        last_token=jnp.zeros((S,), jnp.int32), live=jnp.zeros((S,), jnp.bool_),
        remaining=jnp.zeros((S,), jnp.int32), generated=jnp.zeros((S,), jnp.int32),
        seen=jnp.zeros((S, config.vocab_size), jnp.bool_), settings=Settings.empty(S, max_stop_tokens),
        history=jnp.zeros((S, cache_length), jnp.int32) if history else None,
        draft_cache=None if draft_config is None else KVCache.init(draft_config, S, cache_length, page_length,
                                                                   writes=CATCH_UP),
    ).laid_out()


def _keys(settings: Settings, generated_R: jax.Array) -> jax.Array:
    """Each row's PRNG key for its next draw: a pure function of (seed, stream, position)."""
    def key(seed, stream, generated):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), generated)
    return jax.vmap(key)(settings.seed, settings.stream, generated_R)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Choice:
    token: jax.Array  # int32 [R], the chosen token (a live row's) or NO_TOKEN
    stopped: jax.Array  # bool [R], the token is a stop token
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    live: jax.Array  # bool [R] after this choice
    remaining: jax.Array
    seen: jax.Array


def _choose_next(weights: Weights, x_RD: jax.Array, live_R: jax.Array, remaining_R: jax.Array,
                 seen_RV: jax.Array, settings: Settings, generated_R: jax.Array) -> _Choice:
    """The LM head, a choice per row, and the bookkeeping of what it ends (`_account`)."""
    logits_RV = lm_head(weights, x_RD[:, None])[:, 0]
    token_R = choose(logits_RV, seen_RV, settings.params, _keys(settings, generated_R))
    scores = token_scores(logits_RV, token_R, jnp.any(settings.top_logprobs & live_R))
    return _account(token_R, scores, live_R, remaining_R, seen_RV, settings)


def _account(token_R: jax.Array, scores: tuple[jax.Array, jax.Array, jax.Array], live_R: jax.Array,
             remaining_R: jax.Array, seen_RV: jax.Array, settings: Settings) -> _Choice:
    """What choosing token_R (scored `scores`: `token_scores`' logprob [R] and top J [R, J] twice) does to
    the live rows: a stop token ends a row without being emitted; a row that emits its last allowed token
    ends after it."""
    logprob_R, top_ids_RJ, top_logprobs_RJ = scores
    R = token_R.shape[0]
    is_stop_R = jnp.any(token_R[:, None] == settings.stop_tokens, axis=-1)
    emitted_R = live_R & ~is_stop_R
    remaining_R = remaining_R - emitted_R
    seen_RV = seen_RV.at[jnp.arange(R), token_R].max(emitted_R)
    return _Choice(token=jnp.where(live_R, token_R, NO_TOKEN), stopped=live_R & is_stop_R, logprob=logprob_R,
                   top_ids=top_ids_RJ,
                   top_logprobs=top_logprobs_RJ, live=emitted_R & (remaining_R > 0), remaining=remaining_R,
                   seen=seen_RV)


def choose_first(weights: Weights, last_hidden_bD: jax.Array, seen_bV: jax.Array, admission: Admission) -> _Choice:
    """Each row's first token after its prompt (from a Prefix's `last_hidden` and `seen`), b rows.

    Apart from `place`, so that its program is one per row count b, whatever the prompt's length: the
    sampler is most of an insert's compile time, and a program per prompt bucket compiled it again for
    each (bench/RESULTS.md, "The suite: an insert's sampler compiled once")."""
    b = admission.slots.shape[0]
    # A row chooses its first token when it asked for any: whether it then enters a slot (it does not when
    # that token is its last) is `admission.slots`' business.
    return _choose_next(weights, last_hidden_bD, admission.max_tokens > 0, admission.max_tokens, seen_bV,
                        admission.settings, jnp.zeros((b,), jnp.int32))


def place(slots: Slots, cache: KVCache, admission: Admission, c: _Choice) -> tuple[Slots, Emitted]:
    """Move the rows of a Prefix's `cache` (run to their prompts' ends), with their first tokens `c`
    (`choose_first`), into their slots (`admission.slots`). Returns the new slots and an Emitted [1, b]."""
    b = admission.slots.shape[0]
    at = admission.slots
    put = lambda mine, theirs: mine.at[at].set(theirs.astype(mine.dtype), mode="drop")  # noqa: E731
    history = None
    if slots.history is not None:  # the prompt, then its first token at the cache's length
        prompt_bC = admission.prompt.at[jnp.arange(b), cache.lengths].set(c.token, mode="drop")
        history = put(slots.history, prompt_bC)
    draft_cache = slots.draft_cache
    if draft_cache is not None:  # the draft has run none of the new prompts: it catches up as it drafts
        draft_cache = dataclasses.replace(draft_cache, lengths=put(draft_cache.lengths, jnp.zeros((b,), jnp.int32)))
    slots = Slots(
        cache=slots.cache.insert(cache, at, cache.lengths),
        last_token=put(slots.last_token, jnp.maximum(c.token, 0)), live=put(slots.live, c.live),
        remaining=put(slots.remaining, c.remaining), generated=put(slots.generated, jnp.ones((b,), jnp.int32)),
        seen=put(slots.seen, c.seen), settings=jax.tree.map(put, slots.settings, admission.settings),
        history=history, draft_cache=draft_cache,
    ).laid_out()
    emitted = Emitted(token=c.token[None], stopped=c.stopped[None], logprob=c.logprob[None], top_ids=c.top_ids[None],
                      top_logprobs=c.top_logprobs[None], live=c.live, count=(c.token != NO_TOKEN).astype(jnp.int32),
                      drafted=jnp.zeros((b,), jnp.int32), reached=jnp.zeros((b, 0), jnp.int32),
                      stood=jnp.zeros((b, 0), jnp.int32), steps=jnp.int32(0))
    return slots, emitted


def insert(weights: Weights, slots: Slots, prefix: Prefix, admission: Admission) -> tuple[Slots, Emitted]:
    """Choose each row's first token after its prompt (`prefix`, run to the prompt's end) and move the rows
    into their slots (`admission.slots`): `choose_first`, then `place`, each a program of its own (the
    slots donated to the second). Returns the new slots and an Emitted [1, b]."""
    first = compiled_choose_first(weights, prefix.last_hidden, prefix.seen, admission)
    return compiled_place(slots, prefix.cache, admission, first)


def free(slots: Slots, free_S: jax.Array) -> Slots:
    """The slots with those in free_S (bool [S]) stopped: their requests went (cancelled, ended by a stop
    string the host saw, or their clients gone), so no decode runs them again until an `insert`."""
    return dataclasses.replace(slots, live=slots.live & ~free_S).laid_out()


def decode(config: GPTConfig, weights: Weights, slots: Slots, num_steps: jax.Array, stop_at_finish: jax.Array,
           max_steps: int, rows_R: jax.Array | None = None, draft_tokens: int = 0,
           drafter: Drafter | None = None) -> tuple[Slots, Emitted]:
    """Up to `num_steps` (<= max_steps, static) decode steps for every live slot, in one while_loop.

    The loop ends early when no slot is live, or, with `stop_at_finish`, once any slot finishes (so that
    the host can hand the freed slot to a waiting request). It checks that condition after every chunk of
    `decode_chunk_length(max_steps)` steps, which run unrolled: on a GPU a while loop's condition goes back
    to the host at each iteration (`gpt.model.backend`'s `decode_chunk`). So `num_steps` is rounded up to a
    whole chunk, and when one chunk is all of `max_steps` there is no loop. Within a chunk, a slot that
    finished (or a free one) runs on as a free slot does, emitting nothing.

    rows_R: int32 [R], distinct slots that hold every live one: the steps run over those R rows alone
    (on a CPU a step's cost grows with its rows: bench/RESULTS.md, "Decode calls over the live rows only";
    `gpt.inference.engine` picks R from the live count). None runs all S slots. Either way the result is [M, S].

    draft_tokens: K > 0 (static) verifies up to K drafted tokens a row a step (`_verify_step`), which so
    emits up to K + 1 tokens a row; M is then `emitted_entries(max_steps, K, C)`. `drafter` proposes them
    (`gpt.inference.drafters`; the slots keep what it needs: `init_slots`).
    """
    draft = (draft_tokens, drafter)
    if rows_R is None:
        slots, out = _decode_rows(config, weights, slots, num_steps, stop_at_finish, max_steps, *draft)
        return slots.laid_out(), out
    view, out_R = _decode_rows(config, weights, slots.select(rows_R), num_steps, stop_at_finish, max_steps, *draft)
    slots = slots.merge(rows_R, view)
    # The view's [M, R, ...] and [R] outputs into [M, S, ...] and [S]; the other slots emitted nothing.
    widen = lambda full, narrow: full.at[:, rows_R].set(narrow, unique_indices=True)  # noqa: E731
    widen_rows = lambda full, narrow: full.at[rows_R].set(narrow, unique_indices=True)  # noqa: E731
    empty = Emitted.empty(out_R.token.shape[0], slots.live, out_R.stood.shape[1])
    fields = {f.name: (widen_rows if f.name in Emitted.PER_ROW else widen)(getattr(empty, f.name),
                                                                            getattr(out_R, f.name))
              for f in dataclasses.fields(Emitted) if f.name != "steps"}
    return slots.laid_out(), Emitted(**fields, steps=out_R.steps)


def emitted_entries(max_steps: int, draft_tokens: int, cache_length: int) -> int:
    """M, the entries a row of a decode's Emitted holds: a step's each, or with a draft up to K + 1 a step,
    but never more than a slot's length (no request emits as many tokens in its life)."""
    return max_steps if draft_tokens == 0 else min(max_steps * (draft_tokens + 1), cache_length)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Progress:
    """A decode call's loop state: the slots, what they emitted, how many steps ran, and where each row's
    next entry goes (int32 [R])."""

    slots: Slots
    out: Emitted
    steps: jax.Array
    written: jax.Array


def _decode_rows(config: GPTConfig, weights: Weights, slots: Slots, num_steps: jax.Array, stop_at_finish: jax.Array,
                 max_steps: int, draft_tokens: int, drafter: Drafter | None) -> tuple[Slots, Emitted]:
    """`decode`'s loop over every row of `slots` (all of them, or a selection's)."""
    entries = emitted_entries(max_steps, draft_tokens, slots.cache.length)
    live_at_start = slots.live
    step = (functools.partial(_step, config, weights) if draft_tokens == 0
            else functools.partial(_verify_step, config, weights, draft_tokens, drafter))

    def keep_going(p: _Progress):
        finished = jnp.any(live_at_start & ~p.slots.live)
        return (p.steps < num_steps) & jnp.any(p.slots.live) & ~(stop_at_finish & finished)

    chunk = decode_chunk_length(max_steps)

    def steps(p: _Progress) -> _Progress:
        for _ in range(chunk):
            p = step(p)
        return p

    start = _Progress(slots, Emitted.empty(entries, slots.live, draft_tokens), jnp.int32(0),
                      jnp.zeros_like(slots.last_token))
    # One chunk is the whole call: no loop, nothing to read back between steps.
    p = steps(start) if chunk == max_steps else jax.lax.while_loop(keep_going, steps, start)
    return p.slots, dataclasses.replace(p.out, count=p.written, steps=p.steps)


def _record(out: Emitted, entry: jax.Array, c: _Choice) -> Emitted:
    """`out` with choice c written at entry `entry`: int32, one for every row, or [R], each row's own (past
    the end: nowhere)."""
    if entry.ndim == 0:
        put = lambda full, new: full.at[entry].set(new)  # noqa: E731
    else:
        rows_R = jnp.arange(entry.shape[0])
        put = lambda full, new: full.at[entry, rows_R].set(new, mode="drop", unique_indices=True)  # noqa: E731
    return dataclasses.replace(out, token=put(out.token, c.token), stopped=put(out.stopped, c.stopped),
                               logprob=put(out.logprob, c.logprob), top_ids=put(out.top_ids, c.top_ids),
                               top_logprobs=put(out.top_logprobs, c.top_logprobs), live=c.live)


def _remember(history_RC: jax.Array | None, positions_R: jax.Array, c: _Choice, turn_R: jax.Array) -> jax.Array | None:
    """The history with each row's emitted token (where `turn_R` and not a stop) at positions_R."""
    if history_RC is None:
        return None
    at_R = jnp.where(turn_R & ~c.stopped, positions_R, history_RC.shape[1])  # past the end: dropped
    return history_RC.at[jnp.arange(at_R.shape[0]), at_R].set(c.token, mode="drop")


def _step(config: GPTConfig, weights: Weights, p: _Progress) -> _Progress:
    """One plain decode step: every row's last token through the model, and a choice per live row."""
    slots, cache = p.slots, p.slots.cache
    # Free slots run too (one shape for every step), at position 0: a long-finished request's length
    # would make attention read as far as it had got.
    positions_S1 = jnp.where(slots.live, cache.lengths, 0)[:, None]
    x_S1D, new_cache = forward(config, weights, slots.last_token[:, None], positions_S1, cache)
    # Free slots run too (one shape for every step) but their lengths stay put.
    new_cache = dataclasses.replace(new_cache, lengths=jnp.where(slots.live, new_cache.lengths, cache.lengths))
    c = _choose_next(weights, x_S1D[:, 0], slots.live, slots.remaining, slots.seen, slots.settings, slots.generated)
    slots = dataclasses.replace(
        slots, cache=new_cache, last_token=jnp.where(c.live, c.token, slots.last_token),
        live=c.live, remaining=c.remaining, generated=slots.generated + slots.live, seen=c.seen,
        history=_remember(slots.history, cache.lengths + 1, c, slots.live))
    return _Progress(slots, _record(p.out, p.steps, c), p.steps + 1, p.written + p.slots.live)


def _verify_choices(logits_RTV: jax.Array, drafts_RK: jax.Array, count_R: jax.Array, slots: Slots):
    """The target's choice at each of a verification's T = K + 1 positions, as a plain step would make it
    there (the drafts before it seen as the row's own tokens, its PRNG position), all positions at once.
    Returns how many drafted tokens stand (int32 [R], `count_standing`), the token each position emits if it is
    reached (its draft where the drafts up to it stand, else the target's: int32 [R, T]), and that
    token's scores (`token_scores`' three, [R, T] and [R, T, J])."""
    R, T, V = logits_RTV.shape
    drafted_RTV = jax.nn.one_hot(drafts_RK, V, dtype=jnp.bool_)
    seen_RTV = slots.seen[:, None, :] | jnp.concatenate(
        [jnp.zeros((R, 1, V), jnp.bool_), jnp.cumsum(drafted_RTV, axis=1, dtype=jnp.int32) > 0], axis=1)
    per_position = lambda a: jnp.repeat(a, T, axis=0)  # noqa: E731  a row's value at each of its positions
    settings = jax.tree.map(per_position, slots.settings)
    generated_M = (slots.generated[:, None] + jnp.arange(T, dtype=jnp.int32)).reshape(R * T)
    logits_MV = logits_RTV.reshape(R * T, V)
    target_RT = choose(logits_MV, seen_RTV.reshape(R * T, V), settings.params, _keys(settings, generated_M)).reshape(R, T)
    stood_R = count_standing(target_RT[:, :-1], drafts_RK, count_R)
    at_T = jnp.arange(T)[None, :]
    drafts_RT = jnp.concatenate([drafts_RK, drafts_RK[:, :1]], axis=1)  # the last position has no draft
    token_RT = jnp.where(at_T < stood_R[:, None], drafts_RT, target_RT)
    scores = token_scores(logits_MV, token_RT.reshape(R * T), jnp.any(slots.settings.top_logprobs & slots.live))
    return stood_R, token_RT, jax.tree.map(lambda a: a.reshape(R, T, *a.shape[1:]), scores)


def _verify_step(config: GPTConfig, weights: Weights, K: int, drafter: Drafter, p: _Progress) -> _Progress:
    """One decode step with a draft: each row's last token and up to K tokens `drafter` guessed after it
    through the model at once, the target's own choice at each of those K + 1 positions (as a plain step
    would make it there, its PRNG position included), and the row advanced past the guesses that stand
    (`count_standing`) and the target's token after them. The keys and values of guesses that did not stand
    lie past the row's new length, where the next step writes before any query can see them.
    """
    slots = p.slots
    drafts_RK, count_R, drafted = drafter.propose(config, slots, K)
    # No draft past what the request may still emit: each position's output is then inside the cache. (A
    # step where no row has a draft runs all the same: a lax.cond between it and a plain step had XLA's CPU
    # copy the slots' cache each step, 10x a GPT-2 124M step.)
    count_R = jnp.where(slots.live, jnp.minimum(count_R, slots.remaining - 1), 0)
    verified = _verify(config, weights, drafts_RK, count_R, dataclasses.replace(p, slots=drafted))
    return dataclasses.replace(verified, slots=drafter.settle(slots, verified.slots, K))


def _verify(config: GPTConfig, weights: Weights, drafts_RK: jax.Array, count_R: jax.Array, p: _Progress) -> _Progress:
    """`_verify_step` once drafted: drafts_RK int32 [R, K], the first count_R of each row's."""
    slots, cache = p.slots, p.slots.cache
    (R, K), last_R = drafts_RK.shape, cache.lengths  # the last token's position
    tokens_RT = jnp.concatenate([slots.last_token[:, None], drafts_RK], axis=1)
    positions_RT = jnp.where(slots.live, last_R, 0)[:, None] + jnp.arange(K + 1, dtype=jnp.int32)
    x_RTD, new_cache = forward(config, weights, tokens_RT, positions_RT, cache)
    stood_R, token_RT, scores = _verify_choices(lm_head(weights, x_RTD), drafts_RK, count_R, slots)

    live_R, remaining_R, seen_RV, last_token_R, history = (slots.live, slots.remaining, slots.seen,
                                                           slots.last_token, slots.history)
    out, turns_R = p.out, jnp.zeros((R,), jnp.int32)
    for i in range(K + 1):  # the drafts that stood, then the target's token: each as a plain step takes it
        turn_R = live_R & (i <= stood_R)
        c = _account(token_RT[:, i], jax.tree.map(lambda a: a[:, i], scores), turn_R, remaining_R, seen_RV,
                     slots.settings)
        out = _record(out, jnp.where(turn_R, p.written + i, out.token.shape[0]), c)
        history = _remember(history, last_R + 1 + i, c, turn_R)
        last_token_R = jnp.where(turn_R & ~c.stopped, c.token, last_token_R)
        live_R, remaining_R, seen_RV = jnp.where(turn_R, c.live, live_R), c.remaining, c.seen
        turns_R += turn_R
    lengths_R = jnp.where(slots.live, last_R + turns_R, cache.lengths)
    slots = dataclasses.replace(
        slots, cache=dataclasses.replace(new_cache, lengths=lengths_R), last_token=last_token_R, live=live_R,
        remaining=remaining_R, generated=slots.generated + turns_R, seen=seen_RV, history=history)
    guess_K = jnp.arange(K)
    reached_RK = (guess_K[None, :] < count_R[:, None]) & (guess_K[None, :] <= stood_R[:, None])
    out = dataclasses.replace(out, live=live_R, drafted=out.drafted + count_R, reached=out.reached + reached_RK,
                              stood=out.stood + (guess_K[None, :] < stood_R[:, None]))
    return _Progress(slots, out, p.steps + 1, p.written + turns_R)


def decode_chunk_length(max_steps: int) -> int:
    """Decode steps a chunk runs unrolled: the backend's `decode_chunk`, or less, to divide `max_steps`."""
    return max(c for c in range(1, min(choices().decode_chunk, max_steps) + 1) if max_steps % c == 0)


# `insert`'s two programs (the slots donated: their caches are updated in place); the other verbs' are
# `gpt.inference.device_slots`'.
compiled_choose_first = jax.jit(choose_first)
compiled_place = jax.jit(place, donate_argnames="slots")
