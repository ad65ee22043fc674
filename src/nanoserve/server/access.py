"""The access log: one line per request (client, request line, status, tokens, seconds), and the
log format that keeps every line one line: control characters that came from a client (a path, a
field name) are escaped, so no client can write a log line of its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

access_log = logging.getLogger("nanoserve.access")

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators.
_CONTROLS = [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]
_ESCAPES = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" for c in _CONTROLS}


def printable(text: str) -> str:
    """`text` on one line: control characters as `\\xNN` escapes."""
    return text.translate(_ESCAPES)


class PrintableFormatter(logging.Formatter):
    """Escapes control characters in each message (a traceback after it keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return printable(super().formatMessage(record))


@dataclass
class AccessRecord:
    """One request's line in the access log, filled in as the request goes."""

    started: float
    client: str
    request_line: str  # the method and the path as sent (percent-encoded), with its query
    tokens_in: int | None = None
    tokens_out: int | None = None

    def write(self, status: int | str) -> None:
        tokens = f"in={_count(self.tokens_in)} out={_count(self.tokens_out)}"
        seconds = time.monotonic() - self.started
        access_log.info('%s "%s" %s %s %.3fs', self.client, printable(self.request_line),
                        status, tokens, seconds)  # fmt: skip


def _count(n: int | None) -> str:
    return "-" if n is None else str(n)
