"""One field of a config.json read and checked: a positive integer or number, a flag, a list of
token ids, with a default where it is absent; a ValueError naming the key (and its section) where
it is out of range. Imports nothing of nanoserve, and no torch.
"""

from __future__ import annotations

from typing import Any


def positive_int(d: dict[str, Any], key: str, default: int | None = None) -> int:
    """d[key] (or `default` where it is absent or null) as an integer > 0."""
    value = value_of(d, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be an integer > 0, got {value!r}")
    return value


def positive_number(
    d: dict[str, Any], key: str, default: float | None = None, section: str = ""
) -> float:
    value = value_of(d, key, default, section)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{section}{key} must be a number > 0, got {value!r}")
    return float(value)


def value_of(d: dict[str, Any], key: str, default: Any, section: str = "") -> Any:
    value = d.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"{section}{key} is missing")
        return default
    return value


def flag(d: dict[str, Any], key: str, default: bool) -> bool:
    value = d.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def as_ids(value: Any) -> list[int]:
    """An eos_token_id: null, one id, or a list of them."""
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {value!r}")
    return ids
