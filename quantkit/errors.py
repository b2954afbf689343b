"""One error hierarchy for every user-facing failure.

Each class carries the process exit code the CLI uses, so scripts can tell the
kinds of failure apart without parsing messages.  Messages are one line and say
what to do about the problem.
"""
from __future__ import annotations


class QuantkitError(Exception):
    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(QuantkitError):
    """A bad option, format name, spec string or recipe."""
    exit_code = 2


class SourceError(QuantkitError):
    """The model cannot be found or read (missing folder, no weights, corrupt file)."""
    exit_code = 3


class UnsupportedArchitectureError(QuantkitError):
    exit_code = 4


class NetworkError(QuantkitError):
    """The Hub (or another remote) could not be reached."""
    exit_code = 5


class DataError(QuantkitError):
    """Calibration or evaluation data is missing, unreadable or too short."""
    exit_code = 6


class OutputError(QuantkitError):
    """The artifact could not be written (folder not writable, disk full)."""
    exit_code = 7


class DependencyError(QuantkitError):
    """An optional package needed for this job is not installed."""
    exit_code = 8


class QuantizationError(QuantkitError):
    """The numbers went wrong: non-finite weights, a Hessian that cannot be factored, ..."""
    exit_code = 9


class Terminated(BaseException):
    """SIGTERM, raised where the process was so that it unwinds as for Ctrl-C (exit 143); a BaseException like
    KeyboardInterrupt, so that no `except Exception` swallows it."""


class Interrupted(BaseException):
    """Ctrl-C (SIGINT) as the console script raises it (exit 130): not a KeyboardInterrupt, which typer turns into
    a silent exit before the run can say what it left behind."""


INTERRUPTS = (KeyboardInterrupt, Terminated, Interrupted)


def is_network_failure(e: BaseException) -> bool:
    """A timeout, reset or refused connection, whichever HTTP client raised it (httpx and its forks name their
    classes TimeoutException / NetworkError / RemoteProtocolError / TransportError; the standard library's are
    ConnectionError / TimeoutError), without importing the client huggingface_hub happens to use."""
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"TimeoutException", "NetworkError", "RemoteProtocolError", "TransportError",
                         "ConnectionError", "TimeoutError"})


class ResourceError(QuantkitError):
    """The machine cannot hold the job: too little free disk, RAM or GPU memory for what the plan needs."""
    exit_code = 10
