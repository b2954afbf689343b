"""Calibration data shared by every calibrated format (GPTQ; later AWQ, EXL2, GGUF imatrix).

`load_calibration(CalibrationSpec(source, samples, seqlen, seed), checkpoint)` gives a `CalibrationSet`:
(samples, seqlen) int64 tokens, their provenance and a token hash; `to_json()` goes into the artifact's
quantkit.json.  Sources: a local .txt/.jsonl/.parquet file, ``hf:NAME[:CONFIG]:SPLIT[:COLUMN]`` or ``self``
(see `quantkit.calibration.spec`).
"""
from .data import CalibrationSet, draw_windows, load_calibration, token_hash
from .spec import CalibrationSource, CalibrationSpec, calibration_size, parse_calibration_source

__all__ = ["CalibrationSet", "CalibrationSource", "CalibrationSpec", "calibration_size", "draw_windows", "load_calibration",
           "parse_calibration_source", "token_hash"]
