"""``hf:`` calibration sources: a split of a Hugging Face dataset, through the optional `datasets` package.

The split is downloaded (or found in the `datasets` cache, so a second run, or a run with
HF_HUB_OFFLINE=1 after a first one, needs no network) through ``datasets.load_dataset_builder`` +
``download_and_prepare`` + ``as_dataset``, the steps of ``datasets.load_dataset``, because the builder
knows the dataset's resolved commit: for a Hub dataset ``builder.hash`` is that commit's sha.  When it is not
a commit sha, ``huggingface_hub.HfApi().dataset_info`` is asked (skipped offline); the provenance records
``revision: null`` when neither answers.  The whole split is downloaded; a slice such as ``train[:20000]``
limits what is read and tokenized, not what is downloaded.
"""
from __future__ import annotations

import os
import re

from ..errors import DataError, DependencyError, NetworkError
from ..progress import Progress, null_progress
from .spec import CalibrationSource

_SHA = re.compile(r"^[0-9a-f]{40}$")
_TRUE = ("1", "true", "yes", "on")


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in _TRUE for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _cause(e: BaseException, network: bool = False) -> str:
    """The innermost reason, on one line (for a network failure in offline mode, that mode)."""
    if network and _offline():
        return "HF_HUB_OFFLINE is set"
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return ((str(e).splitlines() or [type(e).__name__])[0] or type(e).__name__)[:200]


def _is_network_error(e: BaseException) -> bool:
    names = {"OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectError", "TimeoutException",
             "ConnectTimeout", "ReadTimeout", "ConnectionError"}
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ConnectionError) or type(e).__name__ in names:
            return True
        e = e.__cause__ or e.__context__
    return False


def import_datasets():
    try:
        import datasets
    except ImportError:
        raise DependencyError("hf: calibration sources need the datasets package: pip install 'quantkit[datasets]'") from None
    return datasets


def resolve_revision(dataset: str, builder_hash, requested: str | None) -> str | None:
    """The dataset's commit sha: the builder's hash when it is one, else the Hub's answer (online only)."""
    if isinstance(builder_hash, str) and _SHA.match(builder_hash):
        return builder_hash
    if _offline():
        return None
    try:
        from huggingface_hub import HfApi
        return HfApi().dataset_info(dataset, revision=requested, timeout=20).sha
    except Exception:  # provenance is best effort here; the data itself was loaded
        return None


def load_split(source: CalibrationSource):
    """(the dataset split, builder hash) for an hf: source; the seam tests replace to load a local file."""
    datasets = import_datasets()
    builder = datasets.load_dataset_builder(source.dataset, source.config, revision=source.revision)
    builder.download_and_prepare()
    return builder.as_dataset(split=source.split), getattr(builder, "hash", None)


def read_hf_documents(source: CalibrationSource, column: str,
                      progress: Progress = null_progress) -> tuple[list[str], dict]:
    """The documents in `column` of the split, in stored order, and the provenance."""
    datasets = import_datasets()
    where = f"hf:{source.dataset}"
    task = progress.task(f"loading {where}", total=None)
    try:
        ds, builder_hash = load_split(source)
    except (DependencyError, DataError, NetworkError):
        raise
    except Exception as e:
        if _is_network_error(e):
            raise NetworkError(f"{where}: cannot reach the Hugging Face Hub and the dataset is not in the local "
                               f"cache ({_cause(e, network=True)}); check the network, or calibrate on a local .txt/.jsonl/.parquet "
                               f"file or with --calib self") from None
        kind = type(e).__name__
        if kind in ("DatasetNotFoundError", "RepositoryNotFoundError", "FileNotFoundError", "EmptyDatasetError",
                    "DataFilesNotFoundError"):
            raise DataError(f"{where}: dataset not found on the Hub or empty ({_cause(e)})") from None
        if isinstance(e, (ValueError, KeyError)):  # unknown config / split, bad slice
            raise DataError(f"{where}: {str(e).splitlines()[0] if str(e) else _cause(e)}") from None
        raise DataError(f"{where}: cannot load ({kind}: {_cause(e)})") from None
    finally:
        task.done()
    if isinstance(ds, dict) or not hasattr(ds, "column_names"):
        raise DataError(f"{where}: split {source.split!r} did not give one dataset split")
    columns = list(ds.column_names)
    if column not in columns:
        raise DataError(f"{where}: no column {column!r} in split {source.split!r} (columns: {', '.join(columns)}); "
                        f"name one as hf:NAME:CONFIG:SPLIT:COLUMN or with --calib-column")
    try:  # one arrow column (respects a slice/selection), not a python loop over rows
        values = ds.with_format("arrow")[column].to_pylist()
    except Exception:
        values = list(ds[column])
    from .data import _collect
    docs, skipped = _collect(where, column, values, columns, len(values))
    return docs, {"kind": "hf", "dataset": source.dataset, "config": source.config, "split": source.split,
                  "column": column, "requested_revision": source.revision,
                  "revision": resolve_revision(source.dataset, builder_hash, source.revision),
                  "rows": len(values), "documents": len(docs), "rows_skipped": skipped,
                  "datasets_version": getattr(datasets, "__version__", None)}
