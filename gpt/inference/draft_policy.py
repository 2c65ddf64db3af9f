"""How many drafted tokens a decode call verifies a step: K from a ladder (0, plain steps, up to the engine's
most, `max_draft_tokens`), whichever is expected to emit the most tokens a second for the slots the call runs.

A step that verifies K drafted tokens runs the model over K + 1 positions a row and emits the guesses that
stand plus one. Two things decide which K pays, and they change at different speeds:

- What a step costs, per decode width and K: at a few rows a step is bound by reading the weights, so extra
  positions cost little; at many rows it is bound by its arithmetic, and a draft model's guesses cost a
  forward each. That depends on the machine and the model, so it is measured, not guessed: each (width, K)
  keeps the seconds per step of its recent calls, and their median is its cost (one slow call, a pause of
  the host, must not make the best K look dear: no call would then run it to say otherwise). A K not yet
  measured at a
  width is priced between its measured neighbours on the ladder (a straight line: the dearer guess).
- How often each slot's guesses stand, which depends on its text: for each guess position i, the chance
  a_i that guess i stands when the ones before it did, from the slot's own recent steps (older steps weigh
  less). Kept per position because guesses stand in runs (a copied stretch lets every guess stand, a new
  thought none), which no single rate describes. Where a slot has seen little at i, a_i leans on the
  engine's recent rate there (a new request starts from it), and where the engine has seen little either,
  that leans on its rate at i - 1: a position that calls at a smaller K never reach is taken to go as the
  one before it, not as a coin toss, so that a K is not passed over for want of news of it. A step at K then
  emits 1 + a_1 + a_1 a_2 + ... + a_1...a_K tokens of that slot, expected.

Each call runs the K with the most expected tokens per second over its slots (at batch 1, that slot's own K);
until a width has measured both plain steps and the largest K it runs those (the draft first: it is what was
asked for), and every `probe_every`-th call at a width it runs the K measured longest ago, so that costs stay
current and a slot whose draft stopped paying is seen when it pays again. The choice is per call: an engine
that runs a whole decode in one call (`generate` without streaming) runs it at the largest K. Every K gives
the same tokens (`gpt.inference.speculation`), so the choice changes only the speed.

Measured in bench/RESULTS.md, "Each call's K chosen for its slots, against a fixed K": within the run-to-run
spread of the best fixed K where guesses stand, and 0.90x-1.02x of plain decoding where they seldom do (a
fixed K: 0.33x-0.59x).

No JAX here: the engine times its calls and reports them (`record`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["DraftPolicy", "ladder"]


def ladder(max_draft_tokens: int) -> tuple[int, ...]:
    """The Ks a decode call may verify: 0 (plain steps), then max_draft_tokens halved until 1, ascending
    (4: 0, 1, 2, 4; 6: 0, 1, 3, 6). Each is a compiled decode program per width, all of them compiled at
    warm-up: the Ks between plain steps and the largest are the ones chosen where guesses stand only
    sometimes (sampled prompt lookup ran K = 1 on 96% of its calls, the int8 draft K = 2 on 31%: bench/
    RESULTS.md, "Each call's K chosen for its slots"), and one compiled mid-serve would stall every stream."""
    ks = {0}
    while max_draft_tokens > 0:
        ks.add(max_draft_tokens)
        max_draft_tokens //= 2
    return tuple(sorted(ks))


@dataclasses.dataclass
class _Cost:
    recent: collections.deque  # seconds per step of the latest calls that compiled nothing
    median: float | None = None  # theirs: the cost
    measured_at: int = -1  # the width's call count when last measured


class DraftPolicy:
    """Chooses each decode call's K (`choose`) from the costs and acceptance `record`ed; counts the drafted
    tokens (`tokens_drafted`) and those that stood (`drafts_accepted`), running totals.

    Args:
      max_draft_tokens: the largest K (the engine's settings' `draft_tokens`); the others are its `ladder`.
      num_slots: the engine's slots, whose acceptance is kept apart.
      probe_every: run the K measured longest ago once every this many calls at a width (>= 2).
      window: the calls a cost is the median of (>= 1).
      memory: the weight a slot's past keeps in its acceptance at each step it drafts (0 <= memory < 1).
      catches_up: the draft runs a new request's prompt in the first call after it enters (a draft model),
        which is then not timed: a cost of the request, not of K.
    """

    PRIOR_WEIGHT = 2.0  # a slot's chance at a guess position counts the engine's recent rate as this many steps

    def __init__(self, max_draft_tokens: int, num_slots: int, probe_every: int = 64, window: int = 15,
                 memory: float = 0.9, catches_up: bool = False):
        if probe_every < 2 or window < 1 or not 0 <= memory < 1:
            raise ValueError(f"probe_every must be >= 2, window >= 1 and memory in [0, 1), got "
                             f"{probe_every}, {window}, {memory}")
        self.ladder, self.probe_every, self.window, self.memory = ladder(max_draft_tokens), probe_every, window, memory
        self._costs: dict[tuple[int, int], _Cost] = {}
        self._calls: dict[int, int] = {}
        # At each guess position: the steps that verified it with every guess before it standing, and those at
        # which it stood, decayed; per slot [S, K], and over every slot [K].
        self._reached, self._stood = np.zeros((num_slots, self.ladder[-1])), np.zeros((num_slots, self.ladder[-1]))
        self._all_reached, self._all_stood = np.zeros(self.ladder[-1]), np.zeros(self.ladder[-1])
        self.catches_up, self._entered = catches_up, False  # and whether a request entered since the last call
        self.tokens_drafted = self.drafts_accepted = 0

    def enter(self, slots: Sequence[int | None]) -> None:
        """New requests took `slots` (None: none): their chances start from the engine's recent rates, and
        when the draft `catches_up`, the next call is not timed."""
        for slot in slots:
            if slot is not None:
                self._reached[slot], self._stood[slot] = 0.0, 0.0
                self._entered = self.catches_up

    def chances(self, slots: Sequence[int]) -> np.ndarray:
        """float [len(slots), K]: for each guess position i, the chance that a slot's guess i stands when the
        ones before it did (its estimate; see the module docstring)."""
        slots, w = list(slots), self.PRIOR_WEIGHT
        stood_RK, reached_RK = self._stood[slots], self._reached[slots]
        engine_wide_K = np.empty(stood_RK.shape[1])
        before = 0.5  # the engine's chance at the position before (at the first, a coin toss)
        for i in range(len(engine_wide_K)):
            before = engine_wide_K[i] = (self._all_stood[i] + w * before) / (self._all_reached[i] + w)
        return (stood_RK + w * engine_wide_K) / (reached_RK + w)

    def expected_tokens(self, slots: Sequence[int]) -> np.ndarray:
        """float [len(ladder)]: the tokens a step at each K of the ladder is expected to emit over `slots`:
        1 + a_1 + a_1 a_2 + ... + a_1...a_K each."""
        after_RK = np.cumsum(np.cumprod(self.chances(slots), axis=1), axis=1)  # guesses standing, K = 1, 2, ...
        return np.asarray([len(slots) + (after_RK[:, k - 1].sum() if k else 0.0) for k in self.ladder])

    def choose(self, width: int, slots: Sequence[int]) -> int:
        """K for the next decode call over `width` rows that runs `slots` (0: plain steps); see the module
        docstring."""
        calls = self._calls[width] = self._calls.get(width, 0) + 1
        largest = self.ladder[-1]
        for k in (largest, 0):
            if self.seconds_per_step(width, k) is None:
                return k
        if calls % self.probe_every == 0:
            return min(self.ladder, key=lambda k: self._cost(width, k).measured_at)
        per_second = self.expected_tokens(slots) / self._prices(width)
        return self.ladder[int(np.argmax(per_second))]

    def record(self, width: int, k: int, seconds: float, steps: int, drafted: np.ndarray, reached: np.ndarray,
               stood: np.ndarray, compiled: bool = False) -> None:
        """A call over `width` rows verifying k guesses a step took `seconds` for `steps` steps; drafted: int
        [S], each slot's verified guesses; reached, stood: int [S, k], at how many steps each slot's guess i
        was verified with every guess before it standing, and stood (`Emitted`'s). A call that `compiled` a
        program is not timed, nor one that ran no step, nor (`catches_up`) the first after a request entered."""
        drafted, reached, stood = (np.asarray(a, np.float64) for a in (drafted, reached, stood))
        self.tokens_drafted += int(drafted.sum())
        self.drafts_accepted += int(stood.sum())
        # A slot without a guess says nothing of its chances, nor a call at k of positions past k: those keep
        # what was seen of them (they would otherwise fade to the prior, and K stay small for want of news).
        ran = drafted > 0
        if ran.any():
            kept = self.memory ** max(steps, 1)  # the past's weight after this call's steps
            self._reached[ran, :k] = kept * self._reached[ran, :k] + reached[ran]
            self._stood[ran, :k] = kept * self._stood[ran, :k] + stood[ran]
            self._all_reached[:k] = kept * self._all_reached[:k] + reached.sum(axis=0)
            self._all_stood[:k] = kept * self._all_stood[:k] + stood.sum(axis=0)
        cost = self._costs[width, k] = self._cost(width, k)
        entered, self._entered = self._entered, False
        if compiled or steps <= 0 or entered:
            return
        cost.recent.append(seconds / steps)
        cost.median = float(np.median(cost.recent))
        cost.measured_at = self._calls.get(width, 0)

    def seconds_per_step(self, width: int, k: int) -> float | None:
        """The cost of a step verifying k guesses at `width` rows (the median of its recent calls'); None until
        measured."""
        return self._cost(width, k).median

    def _cost(self, width: int, k: int) -> _Cost:
        return self._costs.get((width, k)) or _Cost(collections.deque(maxlen=self.window))

    def _prices(self, width: int) -> np.ndarray:
        """float [len(ladder)]: each K's measured cost a step at `width`, or, unmeasured, the straight line
        between the nearest measured Ks below and above it (plain steps and the largest K are measured before
        any is priced)."""
        known = [(k, cost) for k in self.ladder if (cost := self.seconds_per_step(width, k)) is not None]
        return np.interp(self.ladder, [k for k, _ in known], [cost for _, cost in known])
