"""The pipeline YAML, as pydantic v2 models written out in code.

Every block is a :class:`Strict` model (unknown keys are errors listing the allowed keys);
stages are a discriminated union on ``kind`` built from the stage registry; model sources
a union on ``source``. :func:`load_config` reports every problem with its YAML path.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Annotated, Any, Literal, Sequence, Union

import yaml
from pydantic import Field, ValidationError, create_model

from optimize.checks.arm64_config import Arm64Check
from optimize.device import DeviceError, DeviceName, DtypeName, cuda_missing
from optimize.config_checks import model_problems, semantic_problems
from optimize.errors import ConfigError, problems_from
from optimize.gates_config import GatesConfig
from optimize.overrides import OverrideError, apply_overrides
from optimize.stage_api import StageConfig, registered_stages
from optimize.tasks.config import TasksConfig
from targets.config_base import Strict
from targets.sources import BundledSource, GGUFSource, HFSource, ModelSource, RandomSource
from train.tracking import TrackingConfig, missing_package

CONFIG_VERSION = 1


class DataConfig(Strict):
    """Real text for evaluation and calibration; the two spans never overlap."""

    corpus: str = Field("pydoc", description="'pydoc' (CPython's bundled docs), a text file or a directory")
    eval_tokens: int = Field(4096, ge=16, description="tokens every accuracy figure rests on")
    calibration_tokens: int = Field(2048, ge=0, description="tokens for calibration, taken after the eval span")
    seq_len: int = Field(512, ge=8, description="window length for perplexity (non-overlapping, no cache)")


class LatencyConfig(Strict):
    enabled: bool = Field(True, description="measure prefill and decode latency")
    prompt_tokens: int = Field(128, ge=1, description="prompt length for the prefill measurement")
    decode_tokens: int = Field(32, ge=1, description="tokens generated for the decode measurement")
    runs: int = Field(3, ge=1, description="timed runs; the median is reported")
    warmup: int = Field(1, ge=0, description="untimed runs first")
    threads: int = Field(2, ge=1, description="torch / runtime threads while timing")
    eager_quantized: bool = Field(
        False,
        description="also time eager torchao-quantized models (slow on CPU and not what ships; "
        "with a target, the exported artifact is timed instead)",
    )


class ChecksConfig(Strict):
    accuracy: bool = Field(True, description="perplexity, top-1 agreement and KL against the baseline")
    latency: LatencyConfig = Field(default_factory=LatencyConfig)
    generate_tokens: int = Field(16, ge=0, description="greedy tokens compared between eager and the export")
    tasks: TasksConfig = Field(default_factory=TasksConfig,
                               description="lm-eval tasks scored in each selected row's runtime (docs/tasks.md)")
    memory: bool = Field(True, description="measure each export row's peak resident memory in a child process "
                         "(load + prefill of max_seq_len + decode; optimize/footprint/memory.py, docs/devices.md)")
    arm64: Arm64Check | None = Field(
        None, description="also run each export row's artifact in the ARM64 build of its runtime under QEMU "
        "(`optimize setup arm64` first) and compare greedy tokens and perplexity with x86-64 (docs/devices.md)")
    baseline_cache: bool = Field(
        False, description="reuse the baseline's perplexity and log-probabilities from an earlier run of the very "
        "same model (every weight's bytes) on the same text, toolchain and threads, kept under "
        "$OPTIMIZE_CACHE/baselines (the 4 most recently used; a few hundred MB each for a small model)")


class DraftConfigBase(Strict):
    """``draft``: a small model the run makes for speculative decoding (docs/executorch.md,
    "A draft model"). Its ``stages`` run on a copy of the model as loaded, after the pipeline's own
    stages (a depth- or width-``prune``, a ``distill`` whose teacher is the model as loaded, a
    ``ptq_int8`` like the target's), each a report row named ``draft:<i>:<kind>``; the exporter
    writes the result beside the target (an ExecuTorch program's ``draft`` method, which
    ``optimize run --speculative draft`` drafts with). A ``distill`` stage with
    ``frozen: [embeddings]`` keeps the loaded embedding table and head, which the program then stores
    once for both models."""

    gates: GatesConfig = Field(
        default_factory=GatesConfig, description="gates on the draft's rows (default none: a draft is judged by "
        "how often the target keeps its tokens, which the export row measures; the pipeline-wide gates do not "
        "apply to it)")


class PipelineConfigBase(Strict):
    version: Literal[1] = Field(description="config schema version; this release reads 1")
    name: str = Field("pipeline", min_length=1, description="run name; the default output dir is runs/<name>")
    model: ModelSource
    data: DataConfig = Field(default_factory=DataConfig)
    checks: ChecksConfig = Field(default_factory=ChecksConfig)
    gates: GatesConfig = Field(default_factory=GatesConfig, description="pipeline-wide gates; stages may override")
    target: str | None = Field(None, description="target profile name (optimize ls targets) or a profile YAML path")
    device_profile: str | None = Field(
        None, description="device the export must fit (optimize ls devices) or a device profile YAML path: its "
        "usable memory, storage and decode budget become gates on the export rows (docs/devices.md)")
    export: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="options per exporter, e.g. export.executorch.group_size"
    )
    output_dir: Path | None = Field(None, description="where artifacts and the report go (default runs/<name>)")
    seed: int = Field(0, description="seed for anything random in stages")
    device: DeviceName = Field(
        "auto", description="where the stages and the eager checks run: cuda, cpu, or auto (cuda when "
        "torch.cuda.is_available()); the exporter always gets the model back on the CPU"
    )
    compute_dtype: DtypeName | None = Field(
        None, description="floating dtype of the model's weights while the stages and eager checks run "
        "(float32, bfloat16, float16); null keeps the dtype model.dtype loads. The exporter gets the "
        "model back in the loaded dtype"
    )
    resume: bool = Field(True, description="reuse finished stages of an earlier run of the same config")
    stage_cache: bool = Field(
        False, description="also keep finished stages under $OPTIMIZE_CACHE/stages and reuse them in any run "
        "directory: the same stages on the same weights (every byte), calibration text, target, device, toolchain "
        "and code (the 4 most recently used; stages of at least 10 s)")
    tracking: TrackingConfig | None = Field(
        None, description="experiment tracking: tracking.mlflow records params, per-row metrics and the report "
        "in MLflow (the optional `tracking` extra)"
    )

    stages: list[StageConfig] = Field(default_factory=list)
    draft: DraftConfigBase | None = None

    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name


@functools.lru_cache(maxsize=None)
def _pipeline_model() -> type[PipelineConfigBase]:
    specs = registered_stages()
    classes = tuple(s.config_cls for s in specs.values())
    if len(classes) == 1:
        stage_type: Any = classes[0]
    else:
        stage_type = Annotated[Union[classes], Field(discriminator="kind")]  # type: ignore[valid-type]
    draft = create_model(
        "DraftConfig",
        __base__=DraftConfigBase,
        stages=(list[stage_type], Field(..., min_length=1, description="how the draft is made from the model as "
                                        "loaded, in order (e.g. prune depth, distill, ptq_int8)")),
    )
    return create_model(
        "PipelineConfig",
        __base__=PipelineConfigBase,
        stages=(list[stage_type], Field(default_factory=list, description="stages, run in order")),
        draft=(draft | None, Field(None, description="a draft model for speculative decoding, made by its own "
                                   "stages and exported beside the target (docs/executorch.md)")),
    )


def __getattr__(name: str):
    if name == "PipelineConfig":
        return _pipeline_model()
    raise AttributeError(name)


def json_schema() -> dict:
    return _pipeline_model().model_json_schema()


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), [("", f"config file not found: {path}")])
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [("", f"not valid YAML: {exc}")]) from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), [("", "the top level must be a mapping of keys")])
    return data


def load_config(
    source: str | Path | dict,
    overrides: Sequence[str] = (),
    *,
    target: str | None = None,
    device_profile: str | None = None,
    check_files: bool = True,
    check_model: bool = True,
) -> PipelineConfigBase:
    """Read, override, validate and semantically check a pipeline config.

    ``source`` is a YAML path or an already-parsed dict. ``target`` (from ``--target``)
    replaces the config's target. With ``check_model`` the model's config is read (no
    weights) and every stage and the exporter say whether they can handle it
    (:func:`model_problems`). Raises :class:`ConfigError` listing every problem; with
    ``check_files``, ``device: cuda`` on a machine without CUDA is refused first, in one line
    (:class:`~optimize.device.DeviceError`, a ConfigError at ``device``).
    """
    label = str(source) if not isinstance(source, dict) else "<config>"
    data = read_yaml(source) if not isinstance(source, dict) else json.loads(json.dumps(source, default=str))
    try:
        apply_overrides(data, overrides)
    except OverrideError as exc:
        raise ConfigError(label, [("", str(exc))]) from None
    if target is not None:
        data["target"] = target
    if device_profile is not None:
        data["device_profile"] = device_profile
    if isinstance(source, (str, Path)):
        _resolve_relative_paths(data, Path(source).parent)
    try:
        cfg = _pipeline_model().model_validate(data)
    except ValidationError as exc:
        raise ConfigError(label, problems_from(exc, data)) from None
    missing = cuda_missing(cfg.device) if check_files else None
    if missing:  # this machine, not the file, is wrong: one line, before anything is read or run
        raise DeviceError(label, missing)
    missing = missing_package(cfg.tracking) if check_files else None
    if missing:  # an optional package this machine lacks: one line naming the install command
        raise PackageMissing(label, "tracking.mlflow", missing)
    problems = semantic_problems(cfg, check_files=check_files)
    if not problems and check_model and check_files:
        problems = model_problems(cfg)
    if problems:
        raise ConfigError(label, problems)
    return cfg


class PackageMissing(ConfigError):
    """The config needs an optional package this machine lacks: one line, naming the install command."""

    def __init__(self, source: str, path: str, why: str):
        super().__init__(source, [(path, why)])
        self.args = (f"{source}: {path}: {why}",)

    def __str__(self) -> str:
        return self.args[0]


def _resolve_relative_paths(data: dict, base: Path) -> None:
    """Paths in a YAML file are relative to that file, not to the shell's directory."""
    model = data.get("model")
    if isinstance(model, dict) and isinstance(model.get("path"), str) and not Path(model["path"]).is_absolute():
        model["path"] = str((base / model["path"]).resolve())
    d = data.get("data")
    if isinstance(d, dict) and isinstance(d.get("corpus"), str) and d["corpus"] != "pydoc":
        if not Path(d["corpus"]).is_absolute():
            d["corpus"] = str((base / d["corpus"]).resolve())
    tasks = (data.get("checks") or {}).get("tasks") if isinstance(data.get("checks"), dict) else None
    if isinstance(tasks, dict) and isinstance(tasks.get("include_path"), list):
        tasks["include_path"] = [str((base / p).resolve()) if isinstance(p, str) and not Path(p).is_absolute() else p
                                 for p in tasks["include_path"]]
    dev = data.get("device_profile")
    if isinstance(dev, str) and dev.endswith((".yaml", ".yml")) and not Path(dev).is_absolute():
        data["device_profile"] = str((base / dev).resolve())


def dump_config(cfg: PipelineConfigBase) -> dict:
    """JSON-safe dict of the validated config (for reports and hashing)."""
    return json.loads(cfg.model_dump_json())


__all__ = [
    "CONFIG_VERSION",
    "BundledSource",
    "ChecksConfig",
    "ConfigError",
    "DataConfig",
    "GGUFSource",
    "HFSource",
    "LatencyConfig",
    "PipelineConfigBase",
    "RandomSource",
    "dump_config",
    "json_schema",
    "load_config",
]
