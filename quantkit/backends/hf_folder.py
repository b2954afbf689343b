"""The side files of a quantized Hugging Face folder, the same for every format that writes one (GPTQ, bnb,
AWQ): config.json with the format's `quantization_config`, the tokenizer and generation config copied from the
source, and quantkit.json (what was done, from what, and each weight file's sha256)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from .. import __version__
from ..artifact import sha256_file

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                "generation_config.json")


def write_side_files(model, folder: Path, quantization_config: dict, info: dict, weight_files: list[Path]) -> None:
    """Everything but the weights.  `info` is the format's part of quantkit.json; the version, the source and
    the file hashes are added here."""
    folder = Path(folder)
    config = json.loads((model.folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPIED_FILES:
        if (model.folder / name).exists():
            shutil.copyfile(model.folder / name, folder / name)
    record = {"quantkit_version": __version__, **info, "source": {"model": model.name, "revision": model.revision},
              "files": {p.name: sha256_file(p) for p in weight_files}}
    (folder / "quantkit.json").write_text(json.dumps(record, indent=2) + "\n")
