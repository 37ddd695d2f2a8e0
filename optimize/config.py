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

from optimize.device import DeviceError, DeviceName, DtypeName, cuda_missing
from optimize.errors import ConfigError, problems_from
from optimize.gates_config import GatesConfig
from optimize.overrides import OverrideError, apply_overrides
from optimize.stage_api import StageConfig, registered_stages
from optimize.tasks.config import TasksConfig
from targets.config_base import Strict
from train.sources import BundledSource, GGUFSource, HFSource, ModelSource, RandomSource
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
                         "(load + prefill of max_seq_len + decode; optimize/memory.py, docs/devices.md)")
    baseline_cache: bool = Field(
        False, description="reuse the baseline's perplexity and log-probabilities from an earlier run of the very "
        "same model (every weight's bytes) on the same text, toolchain and threads, kept under "
        "$OPTIMIZE_CACHE/baselines (the 4 most recently used; a few hundred MB each for a small model)")


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
    return create_model(
        "PipelineConfig",
        __base__=PipelineConfigBase,
        stages=(list[stage_type], Field(default_factory=list, description="stages, run in order")),
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
    dev = data.get("device_profile")
    if isinstance(dev, str) and dev.endswith((".yaml", ".yml")) and not Path(dev).is_absolute():
        data["device_profile"] = str((base / dev).resolve())


def semantic_problems(cfg: PipelineConfigBase, check_files: bool = True) -> list[tuple[str, str]]:
    """Checks that need more than types: files exist, stages suit the target, export options."""
    from export.base import exporter_names, get_exporter
    from targets import TargetError, load_target

    problems: list[tuple[str, str]] = []
    src = cfg.model
    if check_files and isinstance(src, (HFSource, GGUFSource)) and not Path(src.path).exists():
        problems.append(("model.path", f"not found: {src.path}"))
    if check_files and isinstance(src, GGUFSource) and Path(src.path).is_dir():
        problems.append(("model.path", f"{src.path} is a directory; a gguf source takes a .gguf file (use source: hf for a directory)"))
    if check_files and cfg.data.corpus != "pydoc" and not Path(cfg.data.corpus).exists():
        problems.append(("data.corpus", f"not found: {cfg.data.corpus} (use 'pydoc', a text file or a directory)"))

    profile = None
    if cfg.target is not None:
        try:
            profile = load_target(cfg.target)
        except TargetError as exc:
            problems.append(("target", str(exc)))
    if profile is not None:
        for i, stage in enumerate(cfg.stages):
            scheme = stage.quant_scheme()
            if scheme is not None:
                why = profile.check_scheme(scheme)
                if why:
                    problems.append((f"stages.{i}", f"stage {stage.label(i)!r}: {why}"))

    for name, options in cfg.export.items():
        if name not in exporter_names():
            problems.append((f"export.{name}", f"unknown exporter; available: {', '.join(exporter_names())}"))
            continue
        merged = dict(profile.export_options) if profile is not None and profile.exporter == name else {}
        merged.update(options)
        try:
            get_exporter(name).options_model.model_validate(merged)
        except ValidationError as exc:
            problems.extend(problems_from(exc, merged, prefix=f"export.{name}"))
        except ImportError as exc:
            problems.append((f"export.{name}", f"exporter cannot load: {exc}"))
    problems += _device_problems(cfg)
    problems += _task_problems(cfg, check_files)
    return problems


def _device_problems(cfg: PipelineConfigBase) -> list[tuple[str, str]]:
    """device_profile: a profile that loads, and that runs the target's runtime."""
    if cfg.device_profile is None:
        return []
    from targets.devices import DeviceError, device_path, load_device

    try:
        if cfg.device_profile == "host":
            device_path("host")  # measured at run time, not at validation
            return []
        device = load_device(cfg.device_profile)
    except DeviceError as exc:
        return [("device_profile", str(exc))]
    if cfg.target is not None:
        from targets import TargetError, load_target

        try:
            t = load_target(cfg.target)
        except TargetError:
            return []  # reported at target
        why = device.check_target(t.name) and device.check_target(t.exporter)  # a custom target: by its exporter
        if why:
            return [("device_profile", why)]
    return []


def _task_problems(cfg: PipelineConfigBase, check_files: bool) -> list[tuple[str, str]]:
    """checks.tasks: rows that name no row of this run, task gates on unscored tasks, missing packages."""
    tasks = cfg.checks.tasks
    problems: list[tuple[str, str]] = []
    gated = [("gates.tasks", cfg.gates.tasks)] + [(f"stages.{i}.gates.tasks", s.gates.tasks if s.gates else None)
                                                  for i, s in enumerate(cfg.stages)]
    for where, goals in gated:
        missing = [t for t in goals or {} if t not in tasks.names]
        if missing:
            problems.append((where, f"gate on {', '.join(missing)}, which checks.tasks.names does not score "
                             f"(it scores: {', '.join(tasks.names) or 'nothing'})"))
        relative = [t for t, g in (goals or {}).items() if g.threshold is None]
        if relative and tasks.names and "baseline" not in tasks.rows:
            problems.append((where, f"{', '.join(relative)}: max_degradation / max_pct_degradation compare with "
                             "the baseline, which checks.tasks.rows does not score (add 'baseline')"))
    if not tasks.enabled:
        return problems
    labels = {x for i, s in enumerate(cfg.stages) for x in (s.label(i), s.kind, str(i), *([s.name] if s.name else []))}
    for j, sel in enumerate(tasks.rows):
        if isinstance(sel, int):
            ok = 0 <= sel < len(cfg.stages)
        else:
            ok = sel in ("baseline", "export") or sel in labels
        if not ok:
            problems.append((f"checks.tasks.rows.{j}", f"{sel!r} names no row of this run; rows: baseline, "
                             + ", ".join(s.label(i) for i, s in enumerate(cfg.stages)) + ", export"))
    if "export" in tasks.rows and cfg.target is None and "rows" in tasks.model_fields_set:
        problems.append(("checks.tasks.rows", "'export' is selected but the run has no target, so nothing is exported"))
    if check_files:
        from optimize.tasks.data import missing_packages

        problems += [("checks.tasks", msg) for msg in missing_packages()]
    return problems


def model_problems(cfg: PipelineConfigBase, model_config: Any = None) -> list[tuple[str, str]]:
    """What the model's transformers config shows against the stages and the target.

    Each stage checks the config as the stages before it leave it (``StageConfig.check_model``
    then ``planned_config``), then the exporter checks the final one (``Exporter.check_model``).
    ``model_config`` defaults to the source's config read without weights; the pipeline passes
    the loaded model's. Nothing here loads weights or runs a stage.
    """
    import copy

    from export.base import get_exporter
    from targets import TargetError, load_target
    from train.sources import ModelSourceError, peek_config

    if model_config is None:
        try:
            model_config = peek_config(cfg.model)
        except ModelSourceError as exc:
            return [("model", str(exc))]
    try:
        profile = load_target(cfg.target) if cfg.target else None
    except TargetError as exc:
        return [("target", str(exc))]
    problems: list[tuple[str, str]] = []
    config = copy.deepcopy(model_config)
    for i, stage in enumerate(cfg.stages):
        try:
            msgs = stage.check_model(config, profile)
            config = stage.planned_config(config)
        except Exception as exc:  # a check that cannot run is a problem to report, not a traceback
            problems.append((f"stages.{i}", f"stage {stage.label(i)!r}: its pre-flight check failed on this model "
                             f"({type(exc).__name__}: {exc})"))
            return problems
        problems += [(f"stages.{i}", f"stage {stage.label(i)!r}: {msg}") for msg in msgs]
    if profile is not None:
        try:
            options = export_options(cfg, profile.exporter, profile)
            msgs = get_exporter(profile.exporter).check_model(config, options)
        except Exception as exc:
            msgs = [f"its pre-flight check failed on this model ({type(exc).__name__}: {exc})"]
        problems += [("target", f"{profile.name} ({profile.exporter} exporter): {msg}") for msg in msgs]
    return problems


def export_options(cfg: PipelineConfigBase, exporter_name: str, profile) -> Any:
    """The exporter's validated options: target defaults, then the YAML's export block."""
    from export.base import get_exporter

    options_model = get_exporter(exporter_name).options_model
    merged = dict(profile.export_options) if profile is not None else {}
    # an exporter whose options say so takes the profile's max_seq_len as its default
    # (a custom profile's included)
    if profile is not None and getattr(options_model, "max_seq_len_from_profile", False):
        merged.setdefault("max_seq_len", profile.max_seq_len)
    merged.update(cfg.export.get(exporter_name, {}))
    options = options_model.model_validate(merged)
    # options that depend on the rest of the run (ExecuTorch's scoring method on checks.tasks)
    for_run = getattr(options, "for_run", None)
    return for_run(cfg, f"export:{profile.name if profile is not None else exporter_name}") if for_run else options


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
    "model_problems",
]
