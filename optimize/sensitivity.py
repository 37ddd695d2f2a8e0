"""``optimize sensitivity``: the pipeline YAML's model and calibration text, ranked by
:mod:`optimize.quant.sensitivity` (one group quantized at a time), written beside its run."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Sequence

from optimize.config import PipelineConfigBase, load_config
from optimize.quant.sensitivity import (
    DEFAULT_GROUPS,
    GroupKind,
    SensitivityReport,
    analyze_sensitivity,
    write_sensitivity,
)
from targets.sources.corpus import split_data, windows as cut
from targets.sources import load_model

#: the ONNX Runtime exporter's ``quantize`` mode -> the fake-quant scheme with its arithmetic
_ORT_SCHEMES = {"dynamic": "w8a8-tensor", "static": "w8a8-tensor", "dynamic_per_token": "8da8w"}


def _scheme_from_config(cfg: Any) -> tuple[str, int | None]:
    """The target's scheme: the first quantization stage's, else what the ORT exporter will apply."""
    for st in cfg.stages:
        s = st.quant_scheme()
        if s in ("8da4w", "8da8w"):
            return s, getattr(st, "effective_group_size", None)
    ort = (cfg.export or {}).get("onnxruntime", {}).get("quantize")
    if ort in _ORT_SCHEMES and (cfg.target in (None, "onnxruntime")):
        return _ORT_SCHEMES[ort], None
    return "8da4w", None


def run_sensitivity(
    config: str | Path | dict | Any,
    overrides: Sequence[str] = (),
    *,
    scheme: str | None = None,
    groups: Sequence[GroupKind] = DEFAULT_GROUPS,
    windows: int = 4,
    seq_len: int = 256,
    algorithm: Literal["rtn", "hqq"] = "rtn",
    out_dir: str | Path | None = None,
    log=None,
) -> SensitivityReport:
    """Load the pipeline config's model and calibration text, analyze, and write the report.

    ``scheme`` defaults to the first quantization stage's scheme in the config (else 8da4w);
    ``windows`` x ``seq_len`` tokens are taken from the calibration span (after evaluation).
    Output goes to ``out_dir`` (default ``<run dir>/sensitivity``).
    """
    if windows < 1 or seq_len < 8:
        raise ValueError(f"windows={windows} must be >= 1 and seq_len={seq_len} >= 8")
    cfg = config if isinstance(config, PipelineConfigBase) else load_config(config, overrides)
    cfg_scheme, cfg_gs = _scheme_from_config(cfg)
    scheme = scheme or cfg_scheme
    loaded = load_model(cfg.model)
    splits = split_data(cfg.data, loaded.tokenizer, calib_tokens=max(cfg.data.calibration_tokens, windows * seq_len))
    wins = cut(splits.calib_ids, seq_len, max_windows=windows)
    report = analyze_sensitivity(loaded.model, wins, scheme, groups, group_size=cfg_gs or 32, algorithm=algorithm, log=log)
    write_sensitivity(report, Path(out_dir) if out_dir else cfg.run_dir() / "sensitivity")
    return report
