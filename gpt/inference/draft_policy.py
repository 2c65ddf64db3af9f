"""How many drafted tokens a decode call verifies a step: K from a ladder (0, plain steps, up to the engine's
`draft_tokens`), whichever is expected to emit the most tokens a second for the slots the call runs.

A step that verifies K drafted tokens runs the model over K + 1 positions a row and emits the guesses that
stand plus one. Two things decide which K pays, and they change at different speeds:

- What a step costs, per decode width and K: at a few rows a step is bound by reading the weights, so extra
  positions cost little; at many rows it is bound by its arithmetic, and a draft model's guesses cost a
  forward each. That depends on the machine and the model, so it is measured, not guessed: each (width, K)
  keeps the seconds per step of the calls that ran it (an exponential average). A K not yet measured at a
  width is priced between its measured neighbours on the ladder (a straight line: the dearer guess).
- How often each slot's guesses stand, which depends on its text: for each guess position i, the chance
  a_i that guess i stands when the ones before it did, from the slot's own recent steps (older steps weigh
  less), drawn toward the engine's recent rate at i where the slot has seen little (a new request starts
  from it). Kept per position because guesses stand in runs (a copied stretch lets every guess stand, a
  new thought none), which no single rate describes. A step at K then emits 1 + a_1 + a_1 a_2 + ... +
  a_1...a_K tokens of that slot, expected.

Each call runs the K with the most expected tokens per second over its slots (at batch 1, that slot's own
K); until a width has measured both plain steps and the largest K it runs those (the draft first: it is
what was asked for), and every `probe_every`-th call at a width it runs the K measured longest ago, so that
costs stay current and a slot whose draft stopped paying is seen when it pays again. Every K gives the same
tokens (`gpt.inference.speculation`), so the choice changes only the speed.

No JAX here: the engine times its calls and reports them (`record`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["DraftPolicy", "ladder"]


def ladder(draft_tokens: int) -> tuple[int, ...]:
    """The Ks a decode call may verify: 0 (plain steps), then draft_tokens halved until 1, ascending
    (4: 0, 1, 2, 4; 6: 0, 1, 3, 6). Each is a compiled decode program per width."""
    ks = {0}
    while draft_tokens > 0:
        ks.add(draft_tokens)
        draft_tokens //= 2
    return tuple(sorted(ks))


@dataclasses.dataclass
class _Cost:
    seconds_per_step: float | None = None  # None until a call past the first (which compiles) is seen
    calls: int = 0
    measured_at: int = -1  # the width's call count when last measured


class DraftPolicy:
    """Chooses each decode call's K (`choose`) from the costs and acceptance `record`ed; counts the drafted
    tokens (`tokens_drafted`) and those that stood (`drafts_accepted`), running totals.

    Args:
      draft_tokens: the largest K (the engine's `draft_tokens`); the others are its `ladder`.
      num_slots: the engine's slots, whose acceptance is kept apart.
      probe_every: run the K measured longest ago once every this many calls at a width (>= 2).
      smoothing: the weight of a new measurement in a cost's average (0 < smoothing <= 1).
      memory: the weight a slot's past keeps in its acceptance at each step it drafts (0 <= memory < 1).
    """

    PRIOR_WEIGHT = 2.0  # a slot's chance at a guess position counts the engine's recent rate as this many steps

    def __init__(self, draft_tokens: int, num_slots: int, probe_every: int = 32, smoothing: float = 0.25,
                 memory: float = 0.9):
        if probe_every < 2 or not 0 < smoothing <= 1 or not 0 <= memory < 1:
            raise ValueError(f"probe_every must be >= 2, smoothing in (0, 1] and memory in [0, 1), got "
                             f"{probe_every}, {smoothing}, {memory}")
        self.ladder, self.probe_every, self.smoothing, self.memory = ladder(draft_tokens), probe_every, smoothing, memory
        self._costs: dict[tuple[int, int], _Cost] = {}
        self._calls: dict[int, int] = {}
        # At each guess position: the steps that verified it with every guess before it standing, and those at
        # which it stood, decayed; per slot [S, K], and over every slot [K].
        self._reached, self._stood = np.zeros((num_slots, self.ladder[-1])), np.zeros((num_slots, self.ladder[-1]))
        self._all_reached, self._all_stood = np.zeros(self.ladder[-1]), np.zeros(self.ladder[-1])
        self._entered = False  # a request entered since the last call
        self.tokens_drafted = self.drafts_accepted = 0

    def enter(self, slots: Sequence[int | None]) -> None:
        """New requests took `slots` (None: none): their chances start from the engine's recent rates, and
        the next call is not timed (a draft model runs their prompts there: a cost of the request, not of K)."""
        for slot in slots:
            if slot is not None:
                self._reached[slot], self._stood[slot] = 0.0, 0.0
                self._entered = True

    def chances(self, slot: int) -> np.ndarray:
        """float [K]: for each guess position i, the chance that `slot`'s guess i stands when the ones before
        it did (its estimate; see the module docstring)."""
        engine_wide = (self._all_stood + 1) / (self._all_reached + 2)
        return (self._stood[slot] + self.PRIOR_WEIGHT * engine_wide) / (self._reached[slot] + self.PRIOR_WEIGHT)

    def expected_tokens(self, slots: Sequence[int], k: int) -> float:
        """Tokens a step verifying k guesses is expected to emit over `slots`: 1 + a_1 + a_1 a_2 + ... each."""
        return sum(1 + float(np.cumprod(self.chances(s)[:k]).sum()) for s in slots)

    def choose(self, width: int, slots: Sequence[int]) -> int:
        """K for the next decode call over `width` rows that runs `slots` (0: plain steps); see the module
        docstring."""
        calls = self._calls[width] = self._calls.get(width, 0) + 1
        largest = self.ladder[-1]
        for k in (largest, 0):
            if self.seconds_per_step(width, k) is None:
                return k
        if calls % self.probe_every == 0:
            return min(self.ladder, key=lambda k: self._costs.get((width, k), _Cost()).measured_at)
        return max(self.ladder, key=lambda k: self.expected_tokens(slots, k) / self._priced(width, k))

    def record(self, width: int, k: int, seconds: float, steps: int, drafted: np.ndarray, reached: np.ndarray,
               stood: np.ndarray) -> None:
        """A call over `width` rows verifying k guesses a step took `seconds` for `steps` steps; drafted: int
        [S], each slot's verified guesses; reached, stood: int [S, k], at how many steps each slot's guess i
        was verified with every guess before it standing, and stood (`Emitted`'s). A way's first call at a
        width is not timed (it compiles), nor one that ran no step, nor the first after a request entered."""
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
        cost = self._costs.setdefault((width, k), _Cost())
        cost.calls += 1
        entered, self._entered = self._entered, False
        if cost.calls == 1 or steps <= 0 or entered:
            return
        measured = seconds / steps
        cost.seconds_per_step = measured if cost.seconds_per_step is None else (
            (1 - self.smoothing) * cost.seconds_per_step + self.smoothing * measured)
        cost.measured_at = self._calls.get(width, 0)

    def seconds_per_step(self, width: int, k: int) -> float | None:
        """The average cost of a step verifying k guesses at `width` rows; None until measured."""
        return self._costs.get((width, k), _Cost()).seconds_per_step

    def _priced(self, width: int, k: int) -> float:
        """k's measured cost a step at `width`, or, unmeasured, the straight line between the nearest measured
        Ks below and above it on the ladder (plain steps and the largest K are measured before any is priced)."""
        measured = {j: self.seconds_per_step(width, j) for j in self.ladder}
        if measured[k] is not None:
            return measured[k]
        below = max(j for j in self.ladder if j < k and measured[j] is not None)
        above = min(j for j in self.ladder if j > k and measured[j] is not None)
        return measured[below] + (measured[above] - measured[below]) * (k - below) / (above - below)
