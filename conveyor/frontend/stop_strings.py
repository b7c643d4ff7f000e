"""Incremental stop-string matching: an Aho-Corasick automaton over a request's stop strings.

Generated text arrives a few characters per step; each character is consumed once, so a
step costs O(new characters) whatever the number and length of the stop strings (the
automaton is built once per distinct set of stop strings and cached). The automaton's state
is the longest suffix of the text that is still a prefix of some stop string: its length is
exactly what a stream must hold back, because those characters may yet become a stop string.

A match stops the text at the first position where any stop string is complete (the longest
one if several end there), which does not depend on how the text was split into tokens.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache


class StopAutomaton:
    def __init__(self, stops: tuple[str, ...]):
        assert all(stops), "stop strings must be non-empty"
        self.stops = stops
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        terminal: list[int] = [-1]           # index of the stop string spelled by the state, or -1
        for i, s in enumerate(stops):
            state = 0
            for ch in s:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[state][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    terminal.append(-1)
                state = nxt
            terminal[state] = i
        self.fail = [0] * len(self.goto)
        # match[state]: the longest stop string that is a suffix of the state's text, or -1
        self.match = list(terminal)
        queue = deque(self.goto[0].values())
        while queue:
            state = queue.popleft()
            if self.match[state] < 0:
                self.match[state] = self.match[self.fail[state]]
            for ch, nxt in self.goto[state].items():
                f = self.fail[state]
                while f and ch not in self.goto[f]:
                    f = self.fail[f]
                self.fail[nxt] = self.goto[f].get(ch, 0)
                queue.append(nxt)

    def advance(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)


@lru_cache(maxsize=256)
def compile_stops(stops: tuple[str, ...]) -> StopAutomaton:
    return StopAutomaton(stops)


class StopScanner:
    """One sequence's position in the automaton of its stop strings."""

    __slots__ = ("automaton", "state")

    def __init__(self, stops: list[str] | tuple[str, ...]):
        self.automaton = compile_stops(tuple(stops))
        self.state = 0

    def feed(self, text: str) -> tuple[int, str] | None:
        """Consume text; on the first completed stop string return (its end offset in `text`, it)."""
        a, state = self.automaton, self.state
        for i, ch in enumerate(text):
            state = a.advance(state, ch)
            hit = a.match[state]
            if hit >= 0:
                self.state = state
                return i + 1, a.stops[hit]
        self.state = state
        return None

    @property
    def held(self) -> int:
        """Characters at the end of the text that may still grow into a stop string."""
        return self.automaton.depth[self.state]
