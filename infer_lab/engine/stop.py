"""Stop strings, matched at a cost proportional to the new text, not to the text or the stops.

A step adds a few characters to a sequence's text. A stop string can only be *completed* by them
if it ends inside the new characters, so :class:`StopMatcher` looks at each new character as the
possible last character of a stop string and walks backwards through a trie of the reversed stop
strings: the walk stops at the first character no stop string continues with, so it costs at most
the longest stop string per new character (usually one or two steps), however many stop strings
there are and however long the text has grown.
"""

from __future__ import annotations

from collections.abc import Iterable

_END = ""  # trie key marking "a stop string ends here" (no character is the empty string)


class StopMatcher:
    """The stop strings of one request, as a trie of their reversed characters."""

    def __init__(self, stops: Iterable[str]) -> None:
        self.trie: dict = {}
        for stop in stops:
            node = self.trie
            for ch in reversed(stop):
                node = node.setdefault(ch, {})
            node[_END] = stop
        self.work = 0  # trie steps taken so far (what the tests count instead of timing)

    def find(self, text: str, searched: int) -> tuple[int, str] | None:
        """The earliest ``(start, stop)`` among stop strings that end at or after ``searched``.

        Matches ending before ``searched`` were looked for when that text was new. Among matches
        that start at the same place the smaller string wins, so the result does not depend on
        the order the stop strings were given in.
        """
        best: tuple[int, str] | None = None
        trie, work = self.trie, 0
        for end in range(max(searched, 0), len(text)):
            node, j = trie, end
            while j >= 0:
                child = node.get(text[j])
                if child is None:
                    break
                node = child
                work += 1
                stop = node.get(_END)
                if stop is not None and (best is None or (j, stop) < best):
                    best = (j, stop)
                j -= 1
        self.work += work
        return best
