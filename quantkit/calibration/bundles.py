"""Calibration bundles: named, pinned calibration sets (a folder with manifest.yaml and usually its text), used
as ``bundle:NAME`` or by the folder's path.  The text's sha256 must match the manifest's, so a bundle means
the same tokens on every machine; its name and hash go into the provenance.  Search path for NAME:
$QUANTKIT_BUNDLES (``:``-separated folders), then the project's top-level ``calibration/``."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import yaml

from ..errors import DataError, UsageError

PROJECT_BUNDLES = Path(__file__).resolve().parents[2] / "calibration"


def is_bundle(text: str) -> bool:
    return text.startswith("bundle:") or (Path(text).expanduser() / "manifest.yaml").is_file()


def bundle_folder(text: str) -> Path:
    if not text.startswith("bundle:"):
        return Path(text).expanduser()
    name = text[len("bundle:"):]
    roots = [Path(p) for p in os.environ.get("QUANTKIT_BUNDLES", "").split(":") if p] + [PROJECT_BUNDLES]
    for root in roots:
        if (root / name / "manifest.yaml").is_file():
            return root / name
    known = sorted(p.parent.name for root in roots if root.is_dir() for p in root.glob("*/manifest.yaml"))
    raise UsageError(f"calibration bundle {name!r} not found; known: {', '.join(known) or 'none'} "
                     f"(folders in $QUANTKIT_BUNDLES or {PROJECT_BUNDLES})")


def read_manifest(text: str) -> tuple[dict, Path]:
    """(manifest, folder) of a bundle source string."""
    folder = bundle_folder(text)
    try:
        manifest = yaml.safe_load((folder / "manifest.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise DataError(f"{folder / 'manifest.yaml'}: unreadable bundle manifest ({e})") from None
    if not isinstance(manifest, dict) or not (manifest.get("file") or manifest.get("hub")):
        raise DataError(f"{folder / 'manifest.yaml'}: a bundle manifest names its `file` (with `sha256`) or a `hub` dataset")
    return manifest, folder


def bundle_source(text: str) -> tuple[str, dict]:
    """The plain source string the bundle stands for (its file, or hf:…) and the provenance to record; the
    file's sha256 is checked against the manifest."""
    manifest, folder = read_manifest(text)
    info = {"bundle": manifest.get("name") or folder.name, "license": manifest.get("license"),
            "manifest_sha256": hashlib.sha256((folder / "manifest.yaml").read_bytes()).hexdigest()}
    if manifest.get("file"):
        path = folder / manifest["file"]
        if not path.is_file():
            raise DataError(f"{folder}: the bundle's file {manifest['file']} is missing")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if manifest.get("sha256") and digest != manifest["sha256"]:
            raise DataError(f"{path}: sha256 {digest[:12]}… is not the manifest's {str(manifest['sha256'])[:12]}…; "
                            f"the bundle's text changed")
        return str(path), info
    hub = manifest["hub"]
    parts = [f"{hub['dataset']}" + (f"@{hub['revision']}" if hub.get("revision") else ""), hub.get("config") or "",
             hub["split"]] + ([hub["column"]] if hub.get("column") else [])
    return "hf:" + ":".join(parts), info
