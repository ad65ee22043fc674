"""Test and benchmark helpers: a live server on an ephemeral port with raw-socket clients
(harness.py) and the solo-versus-crowd acceptance test (crowd.py). They need the test extra
(`pip install nanoserve[test]`: httpx); the rest of nanoserve never imports them."""

try:
    import httpx  # noqa: F401
except ImportError as e:
    raise ImportError(
        "nanoserve.testing needs httpx, from the test extra: pip install 'nanoserve[test]'"
    ) from e
