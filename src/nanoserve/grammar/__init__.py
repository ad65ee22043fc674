"""Structured-output constraints before the engine sees them: their sizes checked by name
(limits.py), then a compile in a child process (checker.py), where a crash, a stack overflow or
a compile past its time limit costs only the request that sent it. Imports neither torch nor
anything else of nanoserve, so that the child starts in a fraction of a second."""
