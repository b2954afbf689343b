"""What a push uploads: the files of finished artifacts, checked complete before anything leaves the machine.

A folder artifact (GPTQ, bnb, …) must carry its quantization_config and a quantkit.json whose every listed file
is present with the recorded sha256; a GGUF file must parse to its last tensor.  One folder goes to the repo's
root (where `from_pretrained(repo)` looks); several folders each go under their own name; GGUF files go to the
root under their file names (what llama.cpp's `--hf-file` names)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..backends import backend_for_artifact
from ..errors import QuantkitError, SourceError, UsageError


@dataclass(frozen=True)
class ArtifactFile:
    local: Path
    path_in_repo: str
    sha256: str | None = None   # what quantkit.json recorded, checked when the file is hashed for upload


def artifact_files(artifacts: list[Path]) -> list[ArtifactFile]:
    """Every file the artifacts consist of, with its place in the repo; refuses anything incomplete."""
    if not artifacts:
        raise UsageError("nothing to push: name at least one artifact (a quantized folder or a .gguf file)")
    files: list[ArtifactFile] = []
    for artifact, place in placement([Path(a) for a in artifacts]).items():
        recorded = _check_complete(artifact)
        if artifact.is_file():   # a GGUF file, or the first part of a split one (then every part)
            parts = recorded.get("split_parts") or [artifact.name]
            files += [ArtifactFile(artifact.with_name(name), name) for name in parts]
            continue
        prefix = f"{place}/" if place else ""
        for p in sorted(artifact.rglob("*")):
            rel = p.relative_to(artifact).as_posix()
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(artifact).parts):
                files.append(ArtifactFile(p, prefix + rel, recorded.get(rel)))
    seen: dict[str, Path] = {}
    for f in files:
        if f.path_in_repo in seen:
            raise UsageError(f"{f.local} and {seen[f.path_in_repo]} would both be {f.path_in_repo} in the repo; "
                             f"push them to different repos or rename one")
        seen[f.path_in_repo] = f.local
    return files


def placement(artifacts: list[Path]) -> dict[Path, str]:
    """Each artifact's path in the repo ("" for a folder at the root)."""
    folders = [a for a in artifacts if a.is_dir()]
    return {a: a.name if a.is_file() or len(folders) > 1 else "" for a in artifacts}


def _check_complete(artifact: Path) -> dict[str, str]:
    """The sha256 quantkit.json records per file (a folder); for a GGUF file that parses to its end, {} or
    its split parts' names."""
    if not artifact.exists():
        raise SourceError(f"{artifact}: no such artifact")
    if artifact.name.startswith(".partial-"):
        raise SourceError(f"{artifact}: an unfinished artifact (a run was interrupted); convert again")
    backend = backend_for_artifact(artifact)
    if backend is None:
        what = "config.json has no quantization_config" if (artifact / "config.json").is_file() else \
            "not a quantized folder or a GGUF file"
        raise SourceError(f"{artifact}: {what}; push only artifacts quantkit convert wrote")
    if artifact.is_file():
        try:
            info = backend.describe_artifact(artifact)
        except QuantkitError as e:
            raise SourceError(f"{artifact}: unreadable ({e.message}); convert again") from None
        except (ValueError, OSError) as e:
            raise SourceError(f"{artifact}: unreadable or truncated ({e}); convert again") from None
        return {"split_parts": info.get("split_parts")} if info.get("split_parts") else {}
    record = artifact / "quantkit.json"
    if not record.is_file():
        raise SourceError(f"{artifact}: no quantkit.json, so its files cannot be checked; convert again")
    try:
        recorded = json.loads(record.read_text()).get("files", {})
    except (ValueError, AttributeError):
        raise SourceError(f"{record}: not valid JSON; convert again") from None
    for name in recorded:
        if not (artifact / name).is_file():
            raise SourceError(f"{artifact}: {name} is missing (quantkit.json lists it); convert again")
    return recorded


def check_digest(f: ArtifactFile, sha256: str) -> None:
    if f.sha256 is not None and f.sha256 != sha256:
        raise SourceError(f"{f.local}: does not match its sha256 in quantkit.json (changed or damaged since it "
                          f"was written); convert again")
