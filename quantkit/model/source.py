"""Turn what the user typed into a local checkpoint folder.

Accepted: a local folder, `org/name` or `org/name@revision` on the Hugging Face
Hub, and `demo:<name>` for the offline demo models.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import DependencyError, NetworkError, SourceError, is_network_failure
from .checkpoint import Checkpoint

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+)(?:@(?P<rev>[\w.\-/]+))?$")
# Only what quantkit reads: never the pytorch .bin weights or other formats a repo may also hold.
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json"]


def cache_dir() -> Path:
    """quantkit's own cache: $QUANTKIT_CACHE, else $XDG_CACHE_HOME/quantkit, else ~/.cache/quantkit."""
    if os.environ.get("QUANTKIT_CACHE"):
        return Path(os.environ["QUANTKIT_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "quantkit"


def open_model(spec: str | os.PathLike) -> Checkpoint:
    """Resolve a model spec and open it (config, adapter, lazy weights)."""
    spec_s = str(spec)
    if spec_s.startswith("demo:"):
        from .demo import demo_checkpoint
        return Checkpoint(demo_checkpoint(spec_s[len("demo:"):]), name=spec_s)
    path = Path(spec_s).expanduser()
    m = HUB_ID.match(spec_s)
    if m and not path.exists():
        folder, revision = download_from_hub(m["repo"], m["rev"])
        return Checkpoint(folder, name=m["repo"], revision=revision)
    return Checkpoint(path)


def hub_endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT") or None


def resolve_hub_revision(repo_id: str, revision: str | None) -> str:
    """The commit `revision` (default: main) of a Hub model points at now, without downloading anything."""
    from huggingface_hub import HfApi
    from huggingface_hub import errors as hf_errors
    try:
        return HfApi(endpoint=hub_endpoint()).model_info(repo_id, revision=revision).sha
    except hf_errors.RevisionNotFoundError:
        raise SourceError(f"{repo_id}: revision {revision!r} not found on the Hub") from None
    except hf_errors.RepositoryNotFoundError:
        raise SourceError(f"{repo_id}: not found on the Hub (or private: set HF_TOKEN)") from None
    except Exception as e:  # noqa: BLE001 - huggingface_hub's HTTP client raises its own (httpx) network errors
        if not (isinstance(e, (OSError, hf_errors.HfHubHTTPError)) or is_network_failure(e)):
            raise
        raise NetworkError(f"{repo_id}: cannot reach the Hub to resolve its revision ({_cause(e)})") from None


def download_from_hub(repo_id: str, revision: str | None) -> tuple[Path, str]:
    """snapshot_download of the files quantkit needs; returns (folder, resolved commit)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub import errors as hf_errors
    except ImportError as e:
        raise DependencyError("huggingface_hub is needed for Hub models: pip install huggingface_hub") from e
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS,
                                   endpoint=hub_endpoint())
    except hf_errors.RevisionNotFoundError:
        raise SourceError(f"{repo_id}: revision {revision!r} not found on the Hub") from None
    except hf_errors.GatedRepoError:
        raise SourceError(f"{repo_id}: gated on the Hub; accept its terms and set HF_TOKEN") from None
    except hf_errors.RepositoryNotFoundError:
        raise SourceError(f"{repo_id}: not found on the Hub (or private: set HF_TOKEN)") from None
    except hf_errors.LocalEntryNotFoundError as e:
        raise NetworkError(f"{repo_id}: cannot reach the Hugging Face Hub and the model is not in the local "
                           f"cache ({_cause(e)}); check the network, or pass a local folder (none is named {repo_id!r})") from None
    except (OSError, hf_errors.HfHubHTTPError) as e:
        raise NetworkError(f"{repo_id}: download from the Hub failed ({_cause(e)})") from None
    folder = Path(folder)
    return folder, folder.name  # snapshot folders are named after the resolved commit


def _cause(e: BaseException) -> str:
    """The innermost reason, on one line (huggingface_hub wraps connection errors several times)."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    return (str(e).splitlines() or [type(e).__name__])[0][:200]

