"""The stop-string automaton against a plain search: the same first match and the same held-back
tail, whatever the strings and however the text arrives in pieces."""

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.stop_strings import StopStrings

ALPHABET = "abcé "  # few letters: stop strings overlap, share prefixes and nest
words = st.text(ALPHABET, min_size=1, max_size=5)


def first_match(text: str, stops: list[str]) -> tuple[int, str] | None:
    """Where the first stop string ends (the longest of those ending there), by brute force."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def longest_open_prefix(text: str, stops: list[str]) -> int:
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(
    stops=st.lists(words, min_size=1, max_size=8),
    pieces=st.lists(st.text(ALPHABET, max_size=6), max_size=8),
)
def test_the_automaton_finds_what_a_plain_search_finds(stops, pieces):
    matcher = StopStrings(stops)
    text, found = "", None
    for piece in pieces:
        result = matcher.feed(piece)
        if result is not None:
            found = (len(text) + result[0], result[1])
            text += piece[: result[0]]
            break
        text += piece
        assert matcher.held == longest_open_prefix(text, stops)
    full = "".join(pieces)
    assert found == first_match(full, stops)


def test_thousands_of_strings_sharing_prefixes():
    stops = [f"stop{i:05d}" for i in range(20_000)]
    matcher = StopStrings(stops)
    assert matcher.feed("nothing to see here, stop1 stop12" * 20) is None
    assert matcher.held == len("stop12")
    assert matcher.feed("345 ...") == (3, "stop12345")
