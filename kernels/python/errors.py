"""The kernels' own exception, shared by the API and the backends."""


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here (not built, not installed, or wrong device)."""
