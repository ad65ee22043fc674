"""Stop strings found in a growing text at a cost proportional to the text added, however many
strings there are: an Aho-Corasick automaton over them, built once per request. Owns the
automaton's state for one request's text.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class StopStrings:
    """`feed(text)` reads more text and returns where the first stop string ends in it, if one
    does; `held` is how many characters at the end of the text read so far may still become a
    stop string (a stream holds them back). Of the strings ending at the same character, the
    longest wins (it starts first)."""

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._next: list[dict[str, int]] = [{}]  # the trie's edges, state 0 is the root
        self._depth = [0]  # the length of the prefix each state stands for
        self._ends: list[str | None] = [None]  # the longest stop string ending at a state
        for stop in self.stops:
            self._add(stop)
        self._fail = self._link()
        self._state = 0

    @property
    def held(self) -> int:
        return self._depth[self._state]

    def feed(self, text: str) -> tuple[int, str] | None:
        """Read `text`; on a match, (index in `text` just past the stop string, the string)."""
        for i, char in enumerate(text):
            state = self._state
            while state and char not in self._next[state]:
                state = self._fail[state]
            self._state = self._next[state].get(char, 0)
            stop = self._ends[self._state]
            if stop is not None:
                return i + 1, stop
        return None

    def _add(self, stop: str) -> None:
        state = 0
        for char in stop:
            if char not in self._next[state]:
                self._next[state][char] = len(self._next)
                self._next.append({})
                self._depth.append(self._depth[state] + 1)
                self._ends.append(None)
            state = self._next[state][char]
        self._ends[state] = stop

    def _link(self) -> list[int]:
        """Failure links, breadth first: each state's longest proper suffix that is a state."""
        fail = [0] * len(self._next)
        queue = deque(self._next[0].values())
        while queue:
            state = queue.popleft()
            for char, child in self._next[state].items():
                queue.append(child)
                back = fail[state]
                while back and char not in self._next[back]:
                    back = fail[back]
                fail[child] = self._next[back].get(char, 0)
                if self._ends[child] is None:
                    self._ends[child] = self._ends[fail[child]]
        return fail
