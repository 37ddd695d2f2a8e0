"""What ``optimize validate`` checks in a pipeline config beyond its types, before any stage runs.

:func:`~optimize.config.load_config` runs these on every config it returns: files that must
exist, stages that suit the target, each exporter's options merged over the target's defaults,
the device profile against the target's runtime, the task rows and gates, and (reading the
model's config, no weights) every stage and the exporter against the model as the stages before
them leave it. ``cfg`` is always a validated :class:`~optimize.config.PipelineConfigBase`; this
module does not import it, so that the schema can call the checks without a cycle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from export.base import exporter_names, get_exporter
from optimize.errors import problems_from
from optimize.tasks.data import missing_packages
from optimize.tasks.scores import base_metric
from targets import TargetError, load_target
from targets.devices import DeviceError, device_path, load_device
from targets.sources import GGUFSource, HFSource, ModelSourceError, peek_config


def semantic_problems(cfg, check_files: bool = True) -> list[tuple[str, str]]:
    """Checks that need more than types: files exist, stages suit the target, export options."""
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
    problems += _draft_problems(cfg, profile)
    problems += _device_problems(cfg)
    problems += _task_problems(cfg, check_files)
    problems += _arm64_problems(cfg, check_files)
    return problems


def _draft_problems(cfg, profile) -> list[tuple[str, str]]:
    """``draft``: a target whose exporter writes drafts, the verification they need, a draft quantized
    where the target is, and ``draft_vocab`` only beside a draft."""
    problems: list[tuple[str, str]] = []
    draft = getattr(cfg, "draft", None)
    vocab = (cfg.export.get("executorch") or {}).get("draft_vocab")
    if draft is None:
        if vocab is not None:
            problems.append(("export.executorch.draft_vocab", "sizes the draft model's head, and this config has no "
                             "draft block (add one, or drop draft_vocab)"))
        return problems
    for i, stage in enumerate(draft.stages):
        scheme = stage.quant_scheme()
        why = profile.check_scheme(scheme) if profile is not None and scheme is not None else None
        if why:
            problems.append((f"draft.stages.{i}", f"stage {stage.label(i)!r}: {why}"))
    if profile is None:
        return problems
    try:
        exporter = get_exporter(profile.exporter)
    except Exception:  # reported at target / export
        return problems
    if not exporter.supports_draft:
        return problems + [("draft", f"the {profile.exporter} exporter writes no draft model (executorch does: a "
                                     "draft method beside forward and verify); remove the draft block for this target")]
    try:
        options = export_options(cfg, profile.exporter, profile)
    except (ValidationError, ImportError):
        return problems  # reported at export
    if not getattr(options, "verify_tokens", None):
        problems.append(("draft", f"the target's verify method checks the draft's tokens: set "
                                  f"export.{profile.exporter}.verify_tokens (for example 5)"))
    target_quant = [s.label(i) for i, s in enumerate(cfg.stages) if s.quant_scheme()]
    if target_quant and getattr(options, "quantize", "none") == "none" \
            and not any(s.quant_scheme() for s in draft.stages):
        problems.append(("draft.stages", f"the target is quantized by stage {target_quant[-1]!r} and no draft stage "
                                         "quantizes: an fp32 draft reads more bytes a token than it saves; add a "
                                         "ptq_int8 stage to the draft"))
    return problems


def _arm64_problems(cfg, check_files: bool) -> list[tuple[str, str]]:
    """``checks.arm64`` needs the ARM64 environment built for the installed versions and QEMU on the
    host: refused before any stage runs rather than after the export."""
    if cfg.checks.arm64 is None or not check_files:
        return []
    from targets.arm64.environment import Arm64SetupError, require

    try:
        require()
    except Arm64SetupError as exc:
        return [("checks.arm64", f"{exc}, or remove checks.arm64")]
    return []


def _device_problems(cfg) -> list[tuple[str, str]]:
    """device_profile: a profile that loads, and that runs the target's runtime."""
    if cfg.device_profile is None:
        return []
    try:
        if cfg.device_profile == "host":
            device_path("host")  # measured at run time, not at validation
            return []
        device = load_device(cfg.device_profile)
    except DeviceError as exc:
        return [("device_profile", str(exc))]
    if cfg.target is not None:
        try:
            t = load_target(cfg.target)
        except TargetError:
            return []  # reported at target
        why = device.check_target(t.name) and device.check_target(t.exporter)  # a custom target: by its exporter
        if why:
            return [("device_profile", why)]
        why = device.check_isa(t)  # the runtime build's ISA floor against the device's cores
        if why:
            return [("device_profile", why)]
    return []


def _task_problems(cfg, check_files: bool) -> list[tuple[str, str]]:
    """checks.tasks: rows that name no row of this run, task gates on unscored tasks or metrics, and
    (``check_files``) every named task built as the run will build it: an unknown name, data that is
    not on this machine, a user's YAML lm-eval cannot read, missing packages."""
    tasks = cfg.checks.tasks
    problems: list[tuple[str, str]] = []
    entries = None
    if check_files and tasks.enabled:
        missing = missing_packages()
        problems += [("checks.tasks", msg) for msg in missing]
        if not missing:
            from optimize.tasks.catalog import check_tasks, not_folders

            bad = not_folders(tasks.include_path)
            problems += [(f"checks.tasks.include_path.{i}", f"{tasks.include_path[i]!r} is not a folder") for i in bad]
            if not bad:
                entries, found = check_tasks(tasks.names, tasks.include_path)
                problems += [("checks.tasks.names", msg) for msg in found]
    gated = [("gates.tasks", cfg.gates.tasks)] + [(f"stages.{i}.gates.tasks", s.gates.tasks if s.gates else None)
                                                  for i, s in enumerate(cfg.stages)]
    members = {m: e for e in (entries or {}).values() if e.named for m in [*e.tasks, *e.groups]}
    for where, goals in gated:
        scored = set(tasks.names) | set(members)
        missing = [t for t in goals or {} if t not in scored]
        if missing:
            problems.append((where, f"gate on {', '.join(missing)}, which checks.tasks.names does not score "
                             f"(it scores: {', '.join(tasks.names) or 'nothing'}"
                             + (" and their members" if members else "") + ")"))
        for t, goal in (goals or {}).items():
            e = (entries or {}).get(t)
            if goal.metric and e is not None and e.kind == "task" and e.metrics \
                    and base_metric(goal.metric) not in e.metrics:
                problems.append((f"{where}.{t}.metric", f"{t} has no metric {goal.metric!r}; "
                                 f"it has: {', '.join(e.metrics)}"))
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
    return problems


def model_problems(cfg, model_config: Any = None) -> list[tuple[str, str]]:
    """What the model's transformers config shows against the stages and the target.

    Each stage checks the config as the stages before it leave it (``StageConfig.check_model``
    then ``planned_config``), then the exporter checks the final one (``Exporter.check_model``).
    ``model_config`` defaults to the source's config read without weights; the pipeline passes
    the loaded model's. Nothing here loads weights or runs a stage.
    """
    import copy

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
    draft = getattr(cfg, "draft", None)
    if draft is not None:  # made from the model as loaded, by its own stages
        problems += _draft_model_problems(draft, copy.deepcopy(model_config), cfg, profile)
    return problems


def _draft_model_problems(draft, config: Any, cfg, profile) -> list[tuple[str, str]]:
    """The draft block's stages against the model as loaded (each on what the ones before leave), then
    the exporter against the draft it makes."""
    problems: list[tuple[str, str]] = []
    for i, stage in enumerate(draft.stages):
        try:
            msgs = stage.check_model(config, profile)
            config = stage.planned_config(config)
        except Exception as exc:
            return problems + [(f"draft.stages.{i}", f"stage {stage.label(i)!r}: its pre-flight check failed on this "
                                                     f"model ({type(exc).__name__}: {exc})")]
        problems += [(f"draft.stages.{i}", f"stage {stage.label(i)!r}: {msg}") for msg in msgs]
    if profile is not None and not problems:
        try:
            msgs = get_exporter(profile.exporter).check_model(config, export_options(cfg, profile.exporter, profile))
        except Exception as exc:
            msgs = [f"its pre-flight check failed on the draft ({type(exc).__name__}: {exc})"]
        problems += [("draft", f"{profile.name} ({profile.exporter} exporter), the draft model: {msg}") for msg in msgs]
    vocab = getattr(export_options(cfg, profile.exporter, profile), "draft_vocab", None) if profile else None
    size = getattr(config, "vocab_size", None)
    if vocab is not None and size is not None and vocab > size:
        problems.append(("export.executorch.draft_vocab", f"{vocab} is more than the model's {size} tokens"))
    return problems


def export_options(cfg, exporter_name: str, profile) -> Any:
    """The exporter's validated options: target defaults, then the YAML's export block."""
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
