"""The recipe file: models × formats with calibration, evaluation and push settings, defaults and per-model
overrides — validated up front by pydantic models (unknown keys and wrong types refused), each error naming the
file, the line and the key.

    output: out/ladder                  # where artifacts and results go (relative to the recipe file)
    defaults:
      formats: [gguf:Q4_K_M, gguf:Q8_0]
      options: {imatrix: true}          # convert's options (the CLI flags, underscores for dashes)
      calibration: {source: bundle:wikitext2-en, samples: 128, seqlen: 512}
      eval: {data: ../shared/data/wikitext2-test.raw.txt, windows: 8}
      push: {repo: "ORG/{name}-GGUF"}   # {name}: the model's base name; {format}, {variant}
      resources: {num_gpus: 1}          # per model group, for --executor ray
    models:
      - model: demo:smollm2-135m
      - model: org/name@rev
        formats: [gptq:4bit-g128]       # replaces the default list
        options: {damp: 0.02}           # merged over the default options
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import UsageError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConvertOptions(_Strict):
    """convert's options, as its flags name them (underscores for dashes)."""
    device: Optional[str] = None
    max_shard_size: Optional[float] = Field(None, gt=0, description="GiB")
    tensor_type: list[str] = []
    pure: bool = False
    tokenizer_pre: Optional[str] = None
    imatrix: bool = False
    imatrix_out: Optional[str] = None
    imatrix_format: Optional[Literal["gguf", "dat"]] = None
    imatrix_file: Optional[str] = None
    error_feedback: bool = False
    feedback_reference: Optional[float] = Field(None, ge=0, le=1)
    act_order: Optional[bool] = None
    static_groups: Optional[bool] = None
    group_aware: Optional[bool] = None
    sym: Optional[bool] = None
    damp: Optional[float] = Field(None, ge=0)
    damp_step: Optional[float] = Field(None, ge=0)
    mse: Optional[bool] = None
    gptq_block_size: Optional[int] = Field(None, gt=0)
    awq_clip: Optional[bool] = None
    awq_duo: Optional[bool] = None
    awq_grid: Optional[int] = Field(None, ge=2, le=200)
    awq_search_samples: Optional[int] = Field(None, ge=0)
    measurement: Optional[str] = None
    save_measurement: Optional[str] = None
    exl2_measure_samples: Optional[int] = Field(None, ge=0)
    bnb_compute_dtype: Optional[str] = None
    skip_modules: list[str] = []
    split_max_size: Optional[str] = None


class Calibration(_Strict):
    source: str
    samples: int = Field(128, gt=0)
    seqlen: int = Field(512, gt=1)
    seed: int = 0
    column: Optional[str] = None


class Evaluation(_Strict):
    data: str
    ctx: int = Field(512, gt=1)
    windows: int = Field(8, gt=0)
    runtime: Literal["quantkit", "llama.cpp", "transformers"] = "quantkit"


class Push(_Strict):
    repo: str
    private: bool = False
    revision: Optional[str] = None


class Resources(_Strict):
    """What one model group's task asks a Ray cluster for (`--executor ray`); not part of a job's id."""
    num_cpus: float = Field(1, gt=0)
    num_gpus: float = Field(0, ge=0)


class Settings(_Strict):
    formats: Optional[list[str]] = None
    resources: Optional[Resources] = None
    options: Optional[ConvertOptions] = None
    calibration: Optional[Calibration] = None
    eval: Optional[Evaluation] = None
    push: Optional[Push] = None

    @field_validator("formats")
    @classmethod
    def _formats(cls, v):
        from ..backends import parse_format_spec
        for spec in v or []:
            try:
                parse_format_spec(spec)
            except Exception as e:  # noqa: BLE001 - the format's own one-line reason
                raise ValueError(str(e)) from None
        return v


class ModelEntry(Settings):
    model: str
    name: Optional[str] = None         # {name} in push repos; default: the model's base name


class Recipe(_Strict):
    output: str = "recipe-out"
    defaults: Settings = Settings()
    models: list[ModelEntry] = Field(min_length=1)


def load_recipe(path: Path) -> Recipe:
    """The validated recipe; any problem is one UsageError naming the file, line and key."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"{path}: cannot read the recipe ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise UsageError(f"{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: a recipe is a mapping with `models:` (and optionally `defaults:`, `output:`)")
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-"))]
        key = ".".join(str(p) for p in loc) or "(top level)"
        line = _line_of(text, loc)
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise UsageError(f"{path}:{line}: {key}: {_message(err)}{more}") from None


def _message(err: dict) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown key"
    return err["msg"].removeprefix("Value error, ")


def _line_of(text: str, loc: list) -> int:
    """The 1-based line of the YAML node at `loc` (or of its nearest existing parent)."""
    node = yaml.compose(text)
    line = node.start_mark.line + 1 if node is not None else 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next(((k, v) for k, v in node.value if k.value == str(part)), None)
            if match is None:
                return line
            line, node = match[0].start_mark.line + 1, match[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line
