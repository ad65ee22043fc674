"""The HTTP server: the Trio bridge to the engine (bridge.py), the Quart-Trio app and its OpenAI
routes (app.py, routes.py, protocol/, responses.py, errors.py), Prometheus metrics, and the
Hypercorn runner with its signal handling (serve.py)."""
