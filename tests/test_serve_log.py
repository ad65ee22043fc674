"""`nanoserve serve`'s log handler keeps every message on one line: a control character that came
from a client (here in a stream-failure warning, as routes.py writes one) is escaped on the
process's real stderr, so that no client can write a log line of its own."""

import subprocess
import sys

# Runs `nanoserve serve` with its server replaced by one log message carrying a forged line, sent
# once the command has installed its log handler and loaded the model.
FORGE = """
import logging, sys
import nanoserve.server.serve

FORGED = "bad\\r\\nINFO nanoserve.access: forged"

async def serve(*args, **kwargs):
    logging.getLogger("nanoserve.server.routes").warning("stream %s failed: %s", "cmpl-1", FORGED)
    return 0

nanoserve.server.serve.serve = serve
from nanoserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_forged_line_in_a_message_is_escaped_on_serves_stderr(tiny_model_dir, tmp_path):
    env = {"NANOSERVE_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, "-c", FORGE, "serve", str(tiny_model_dir), "--port", "0"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    (warning,) = [line for line in lines if "stream cmpl-1 failed" in line]
    assert warning.endswith("WARNING nanoserve.server.routes: stream cmpl-1 failed: "
                            "bad\\x0d\\x0aINFO nanoserve.access: forged")  # fmt: skip
    assert not any(line.startswith("INFO nanoserve.access: forged") for line in lines)
