"""When a decode call verifies a draft and when it runs plain steps: whichever has cost less per token, as
measured on this engine, at this many rows.

A step that verifies K drafted tokens runs the model over K + 1 positions a row. At a few rows a step is
bound by reading the weights, so the extra positions cost little and every draft token that stands is
nearly free; at many rows the step becomes bound by its arithmetic, the extra positions cost what they
compute, and a draft that seldom stands makes decoding slower. Where that turns depends on the machine,
the model and the text, so it is measured, not guessed: for each decode width the policy keeps the
seconds per emitted token of each way (an exponential average of the calls that ran it), runs the cheaper
one, and every `probe_every` calls the other, so that a change in the text or the load is seen. Either
way gives the same tokens (`gpt.inference.speculation`), so the choice changes only the speed.

No JAX here: the engine times its calls and reports them (`record`).
"""

from __future__ import annotations

import dataclasses

__all__ = ["DraftPolicy"]


@dataclasses.dataclass
class _Cost:
    seconds_per_token: float | None = None  # None until a call past the first (which compiles) is seen
    calls: int = 0


class DraftPolicy:
    """Chooses, per decode call, whether it verifies a draft (`use_draft`), from the costs `record`ed;
    counts the drafted tokens (`tokens_drafted`) and those that stood (`drafts_accepted`), running totals.

    Args:
      probe_every: run the way that costs more once every this many calls at a width (>= 2).
      smoothing: the weight of a new measurement in the average (0 < smoothing <= 1).
    """

    def __init__(self, probe_every: int = 16, smoothing: float = 0.25):
        if probe_every < 2 or not 0 < smoothing <= 1:
            raise ValueError(f"probe_every must be >= 2 and smoothing in (0, 1], got {probe_every}, {smoothing}")
        self.probe_every, self.smoothing = probe_every, smoothing
        self._costs: dict[tuple[int, bool], _Cost] = {}
        self._calls: dict[int, int] = {}
        self.tokens_drafted = self.drafts_accepted = 0

    def use_draft(self, width: int) -> bool:
        """Whether the next decode call over `width` rows verifies a draft: the draft until both ways are
        measured there (it is what was asked for), then the cheaper way, and the other every probe_every-th
        call."""
        calls = self._calls[width] = self._calls.get(width, 0) + 1
        draft, plain = (self._costs.get((width, way), _Cost()).seconds_per_token for way in (True, False))
        if draft is None:
            return True
        if plain is None:
            return False
        cheaper = draft <= plain
        return cheaper if calls % self.probe_every else not cheaper

    def record(self, width: int, draft: bool, seconds: float, tokens: int, drafted: int = 0, accepted: int = 0) -> None:
        """A call over `width` rows (verifying a draft or not) took `seconds`, emitted `tokens` tokens and
        verified `drafted` drafted tokens, `accepted` of which stood. Each way's first call at a width is
        not timed: it compiles. Nor is a call that emitted nothing (it says nothing about a token's cost)."""
        self.tokens_drafted, self.drafts_accepted = self.tokens_drafted + drafted, self.drafts_accepted + accepted
        cost = self._costs.setdefault((width, draft), _Cost())
        cost.calls += 1
        if cost.calls == 1 or tokens <= 0:
            return
        measured = seconds / tokens
        cost.seconds_per_token = measured if cost.seconds_per_token is None else (
            (1 - self.smoothing) * cost.seconds_per_token + self.smoothing * measured)

    def seconds_per_token(self, width: int, draft: bool) -> float | None:
        """The average cost of a token by one way at `width` rows; None until measured."""
        return self._costs.get((width, draft), _Cost()).seconds_per_token
