"""Talking to the Hub through huggingface_hub: a timeout on every request, retries with backoff for what is
transient, and one line naming the fix for what is not.

huggingface_hub retries its upload calls itself but not the metadata calls or the commit, and its HTTP client
waits forever by default; a push from CI must neither hang nor fail on one 503.  The token is passed to the
client and never printed: every message that leaves this module has it scrubbed."""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from ..errors import NetworkError, UsageError, is_network_failure

T = TypeVar("T")
TRANSIENT_STATUS = (408, 429, 500, 502, 503, 504)


def env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name) or default)
    except ValueError:
        raise UsageError(f"{name}={os.environ[name]!r}: expected a number") from None


class Hub:
    """One repo's conversation with the Hub (endpoint from HF_ENDPOINT, token from the argument, HF_TOKEN or
    the huggingface_hub login)."""

    def __init__(self, repo: str, token: str | None = None):
        from huggingface_hub import HfApi, get_token
        check_repo_id(repo)
        self.repo = repo
        self.token = token or get_token()
        if not self.token:
            raise NetworkError("no Hugging Face token: pass --token, set HF_TOKEN, or run `hf auth login` "
                               "(a token with write access to the repo)")
        self.retries = int(env_float("QUANTKIT_HUB_RETRIES", 5))
        self.backoff = env_float("QUANTKIT_HUB_BACKOFF", 1.0)
        _use_timeouts(env_float("QUANTKIT_HUB_TIMEOUT", 60.0))
        if not sys.stderr.isatty():   # huggingface_hub's upload bars, kept for a person watching a terminal
            from huggingface_hub.utils import disable_progress_bars
            disable_progress_bars()
        self.api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=self.token)

    def call(self, what: str, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs), retried while the failure is transient; other failures become one line."""
        for attempt in range(self.retries + 1):
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - sorted below; anything unknown is re-raised
                if not is_transient(e) or attempt == self.retries:
                    raise self.error(what, e) from None
                time.sleep(min(30.0, self.backoff * 2 ** attempt))
        raise AssertionError("unreachable")

    def error(self, what: str, e: Exception) -> Exception:
        """The one-line error for a failed request (the token scrubbed)."""
        from huggingface_hub.errors import HfHubHTTPError, RevisionNotFoundError
        status = status_of(e)
        where = f"{self.repo}: {what}"
        if isinstance(e, RevisionNotFoundError):
            message = f"{where}: revision not found on the Hub"
        elif status == 401:
            message = (f"{where}: the Hub refused the token (401): pass a valid token with --token or HF_TOKEN, "
                       f"or run `hf auth login`")
        elif status == 403:
            message = (f"{where}: the token may not write to {self.repo} (403): use a token with write access to "
                       f"{self.repo.split('/')[0]} (a fine-grained token needs 'write' on its repos)")
        elif status == 402 or "quota" in str(e).lower() or "storage limit" in str(e).lower():
            message = f"{where}: the Hub's storage quota is used up ({status}); free space or upgrade the account"
        elif status == 404:
            message = f"{where}: not found on the Hub (404); check the repo id and that the token can see it"
        elif status == 412:
            message = f"{where}: the branch moved while pushing (412); nothing was committed; push again"
        elif isinstance(e, HfHubHTTPError) or is_transient(e):
            reason = f"HTTP {status}" if status else type(e).__name__
            tries = f" after {self.retries + 1} tries" if is_transient(e) else ""
            message = f"{where}: the Hub did not complete the request{tries} ({reason}: {first_line(e)})"
        elif isinstance(e, OSError):
            message = f"{where}: cannot reach the Hub ({first_line(e)}); check the network and HF_ENDPOINT"
        else:
            return e
        return NetworkError(message.replace(self.token, "***"))


def check_repo_id(repo: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(repo)
    except HFValidationError:
        raise UsageError(f"repo id {repo!r} is not valid (ORG/NAME: letters, digits, '-', '_', '.', "
                         f"at most 96 characters)") from None
    if "/" not in repo:
        raise UsageError(f"repo id {repo!r}: name the owner too (ORG/NAME or USER/NAME)")


def status_of(e: BaseException) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def is_transient(e: BaseException) -> bool:
    """A status the Hub answers when it is busy or down, or a network failure (timeout, reset, refused)."""
    return status_of(e) in TRANSIENT_STATUS or is_network_failure(e)


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _use_timeouts(read_seconds: float) -> None:
    """Make huggingface_hub's HTTP client give up on a silent server (its default waits forever)."""
    import huggingface_hub
    from huggingface_hub.utils import _http  # the default factory: the client huggingface_hub would build
    base = _http.default_client_factory

    def factory():
        client = base()
        client.timeout = type(client.timeout)(read_seconds, connect=min(read_seconds, 10.0))
        return client
    huggingface_hub.set_client_factory(factory)
