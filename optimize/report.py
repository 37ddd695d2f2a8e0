"""The run report: typed (pydantic, versioned schema), written as JSON, Markdown and a PNG.

``report.json`` is the machine-readable record MLOps pipelines consume; ``report.md`` is the
table people read; ``report.png`` plots accuracy against size and latency per stage.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from optimize.gates_config import GateResult
from optimize.footprint.memory import MemoryFootprint
from optimize.footprint.predict import DevicePrediction
from optimize.resources import Resources
from optimize.tasks.scores import TaskScore
from optimize.tasks.table import task_lines
from targets.atomic import atomic_path, atomic_write_json, atomic_write_text

#: 1.1: rows carry ``resources`` (device and peak memory); ``metrics.tasks`` (lm-eval task scores) is
#: optional and additive, as are export rows' ``metrics.memory`` (artifact, KV cache, measured peak RSS)
#: and, with a device profile, ``metrics.device`` (fit and predicted decode) and ``device_profile``
#: 1.2: ``metrics.tasks`` holds any lm-eval task or group: each score carries ``metrics`` / ``stderr``
#: (lm-eval's keys and values), ``headline``, ``higher_is_better``, ``kind``, ``subtasks``, ``parent``
#: (1.1's ``acc`` / ``acc_norm`` fields are ``metrics.acc`` / ``metrics.acc_norm``)
#: 1.3: export rows' ``metrics.arm64`` (with ``checks.arm64``): one ARM64 verification per emulated core
REPORT_SCHEMA_VERSION = "1.3"


class Metrics(BaseModel):
    perplexity: float | None = None
    perplexity_delta_pct: float | None = Field(None, description="vs the baseline, percent")
    top1_agreement: float | None = Field(None, description="fraction of positions whose argmax matches the baseline's")
    kl_divergence: float | None = Field(None, description="mean KL(baseline || this), nats per token")
    eval_tokens: int | None = Field(None, description="tokens the accuracy figures rest on")
    params: int | None = None
    size_mb: float | None = Field(None, description="serialized model or artifact size, MiB")
    prefill_ms: float | None = None
    prefill_tokens: int | None = None
    decode_tok_s: float | None = None
    decode_tokens: int | None = None
    tasks: dict[str, TaskScore] | None = Field(
        None, description="lm-eval task scores in this row's runtime (checks.tasks); None when the row was not scored")
    memory: MemoryFootprint | None = Field(
        None, description="export rows: artifact and KV-cache bytes, peak RSS measured in a child process (checks.memory)")
    arm64: list[dict[str, Any]] | None = Field(
        None, description="export rows with checks.arm64: one export.arm64.verify report per emulated core")
    device: DevicePrediction | None = Field(
        None, description="export rows with a device_profile: memory fit and the PREDICTED decode rate on the device")


class StageRow(BaseModel):
    index: int = Field(description="-1 for the baseline; export rows follow the stages")
    name: str
    kind: str
    runtime: str = "eager"
    status: Literal["pass", "warn", "fail", "error", "resumed"] = "pass"
    metrics: Metrics = Field(default_factory=Metrics)
    gates: list[GateResult] = Field(default_factory=list)
    wall_s: float = Field(0.0, description="seconds the row took: the stage (or export) and its checks")
    resources: Resources | None = Field(None, description="device and peak memory over the same span as wall_s")
    artifact: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)
    error: str | None = None


class Report(BaseModel):
    schema_version: str = REPORT_SCHEMA_VERSION
    name: str
    ok: bool = True
    stopped_at: str | None = Field(None, description="the stage whose gate or error stopped the run")
    last_good_artifact: str | None = None
    target: str | None = None
    device_profile: dict[str, Any] | None = Field(None, description="the device profile the export rows were checked "
                                                  "against (targets/devices), as loaded")
    rows: list[StageRow] = Field(default_factory=list)
    data: dict[str, Any] = Field(default_factory=dict, description="corpus and the token spans used")
    config: dict[str, Any] = Field(default_factory=dict)
    environment: dict[str, Any] = Field(default_factory=dict)
    output_dir: str = ""
    wall_s: float = 0.0

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def warned_gates(self) -> list[tuple[str, GateResult]]:
        """(row name, gate) for every gate that failed without stopping the run (``on_fail: warn``)."""
        return [(r.name, g) for r in self.rows for g in r.gates if not g.ok]

    def verdict(self) -> str:
        """One line on how the run ended: stopped, finished with gates that warned (each named with
        its figure), or finished with every gate passed. Never "passed" when a gate failed."""
        if not self.ok:
            return f"STOPPED at {self.stopped_at}"
        warned = self.warned_gates()
        ended = ("all gates passed" if not warned else f"finished with {len(warned)} gate(s) failed as warnings: "
                 + "; ".join(f"{name}: {g.message}" for name, g in warned))
        missing = self.nothing_exported()
        return ended if missing is None else f"{ended} · {missing}"

    def nothing_exported(self) -> str | None:
        """Why a run whose YAML has an ``export:`` block shipped no artifact (it named no target), or None.

        A YAML that sets exporter options and no ``target`` runs its stages and exports nothing; its end
        must say so, not read as if the artifact were there."""
        names = sorted((self.config or {}).get("export") or {})
        if not names or (self.config or {}).get("target") or any(r.name.startswith("export:") for r in self.rows):
            return None
        return (f"nothing exported: the export block sets {', '.join(f'export.{n}' for n in names)} but no target "
                f"was given (pass --target {names[0]}, or set target: {names[0]})")

    def row(self, name: str) -> StageRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no row named {name!r}; rows: {', '.join(r.name for r in self.rows)}")


def _fmt(v: float | None, spec: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return format(v, spec)


def markdown_table(report: Report) -> str:
    head = ("| stage | runtime | perplexity | Δ ppl | top-1 agree | KL | size MiB | prefill ms | decode tok/s | wall s | status |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    lines = [head]
    for r in report.rows:
        m = r.metrics
        delta = f"{m.perplexity_delta_pct:+.2f}%" if m.perplexity_delta_pct is not None else "–"
        agree = f"{100 * m.top1_agreement:.1f}%" if m.top1_agreement is not None else "–"
        lines.append(
            f"| {r.name} | {r.runtime} | {_fmt(m.perplexity, '.3f')} | {delta} | {agree} | {_fmt(m.kl_divergence, '.4f')} "
            f"| {_fmt(m.size_mb, '.1f')} | {_fmt(m.prefill_ms, '.1f')} | {_fmt(m.decode_tok_s, '.1f')} | {r.wall_s:.1f} | {r.status} |"
        )
    return "\n".join(lines)


def _names(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f", … ({len(names)} in all)" if len(names) > limit else "")


def precision_lines(report: Report) -> list[str]:
    """One line per row that changed or exported precisions: what each Linear ended up as."""
    lines = []
    for r in report.rows:
        d = r.details
        mix = d.get("precision_mix")
        if mix:
            parts = [f"{k} {v}" for k, v in mix.items() if v]
            extra = []
            if d.get("int8_modules") and d.get("scheme") == "8da4w":
                extra.append(f"8da8w: {_names(d['int8_modules'])}")
            if d.get("kept_modules"):
                extra.append(f"fp32: {_names(d['kept_modules'])}")
            mp = d.get("mixed_precision")
            if mp:
                extra.append(f"budget promoted {_names(mp.get('kept_groups', []))} to {mp.get('promote_to')} "
                             f"(est. {mp.get('estimated_size_mb')} MB, decode +{mp.get('estimated_decode_slowdown_pct')}%)")
            if d.get("gptq"):
                extra.append(f"GPTQ output error -{100 * d['gptq'].get('output_error_reduction', 0):.0f}% vs round-to-nearest")
            lines.append(f"- {r.name} ({d.get('algorithm', 'rtn')}): {' · '.join(parts)}" + ("; " + "; ".join(extra) if extra else ""))
        exported = (d.get("quantization") or {}).get("exported_linear")
        if exported and exported.get("counts"):
            parts = [f"{k} {v}" for k, v in exported["counts"].items()]
            minority = [f"{k}: {_names(v)}" for k, v in exported.get("modules", {}).items()]
            lines.append(f"- {r.name}, read from the exported graph: {' · '.join(parts)}"
                         + ("; " + "; ".join(minority) if minority else ""))
    return lines


def runtime_lines(report: Report) -> list[str]:
    """One line per export row whose exporter reported delegation (the fraction of ops the backend
    runs, the portable ops left) or ExecuTorch's C++ runner (its own stats, greedy vs the Python loop)."""
    lines = []
    for r in report.rows:
        d = r.details
        deleg = d.get("delegation")
        if deleg:
            ops = ", ".join(f"{k} {v}" for k, v in (deleg.get("portable_ops") or {}).items()) or "none"
            calls = f", {deleg['delegate_calls']} delegate calls a forward" if deleg.get("delegate_calls") else ""
            lines.append(f"- {r.name}: {deleg.get('delegated_fraction', 0):.1%} of ops delegated "
                         f"({deleg.get('delegated_subgraphs')} subgraphs{calls}); portable kernel calls a forward: {ops}")
        llm = d.get("llm_runner")
        if llm and llm.get("used"):
            s, g = llm["stats"], llm["greedy"]
            rate = f"{s['decode_tok_s']:.1f}" if s.get("decode_tok_s") else "-"
            lines.append(f"- {r.name}, ExecuTorch C++ runner (TextLLMRunner): prefill {s['prefill_ms']:.0f} ms for "
                         f"{s['prompt_tokens']} tokens, decode {rate} tok/s; greedy {g['tokens']} tokens "
                         + ("equal the Python loop's" if g["match"] else f"differ from the Python loop's at {g['diverged_at']}"))
        elif llm:
            lines.append(f"- {r.name}, ExecuTorch C++ runner not used: {llm.get('reason')}")
        spec = d.get("speculative")
        if spec:
            for how, x in (("prompt lookup", spec), ("the draft model", spec.get("draft"))):
                if not x:
                    continue
                acc = f", {x['accepted']}/{x['drafted']} drafted tokens kept" if x.get("drafted") else ""
                lines.append(f"- {r.name}, speculative decoding ({how} through `{spec['method']}`, drafts of up to "
                             f"{(spec.get('verify_tokens') or 2) - 1} tokens): {x['tokens']} greedy tokens "
                             + ("equal plain decoding's" if x["match"] else f"DIFFER from plain decoding's at "
                                f"{x['diverged_at']}") + f", {x['tokens_per_call']:.2f} tokens a call{acc}")
        drafted = (d.get("llm_ops") or {}).get("draft_method")
        if drafted:
            lines.append(f"- {r.name}, draft model (method `{drafted['method']}`): {drafted['layers']} layers, "
                         f"{drafted['own_bytes'] / 2**20:.1f} MiB of its own, {drafted['shared_bytes'] / 2**20:.1f} MiB "
                         "stored once with the target" + (f", head over {drafted['vocab']} tokens" if drafted.get("vocab")
                                                          else ""))
    return lines


def device_lines(report: Report) -> list[str]:
    """Each export row's memory (measured) and, with a device profile, its fit and PREDICTED decode."""
    rows = [r for r in report.rows if r.metrics.memory is not None]
    if not rows:
        return []
    mib = lambda b: _fmt(None if b is None else b / 2**20, ".1f")  # noqa: E731
    out = ["## Memory of the exported artifacts (measured on this host)",
           "| row | artifact MiB | KV cache MiB @ max_seq_len | peak RSS MiB | interpreter MiB | artifact's RSS MiB "
           "| predicted peak MiB | prediction vs measured |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r.metrics.memory
        kv = f"{mib(m.kv_cache_bytes)} @ {m.max_seq_len}" if m.kv_cache_bytes is not None else "–"
        err = m.prediction_error_pct
        diff = "–" if err is None else (f"{err:+.1f}% (artifact's part "
                                         f"{mib(m.predicted_peak_rss_bytes - m.interpreter_rss_bytes)} vs "
                                         f"{mib(m.model_rss_bytes)})")
        out.append(f"| {r.name} | {mib(m.artifact_bytes)} | {kv} | {mib(m.peak_rss_bytes)} | "
                   f"{mib(m.interpreter_rss_bytes)} | {mib(m.model_rss_bytes)} | {mib(m.predicted_peak_rss_bytes)} "
                   f"| {diff} |" if m.error is None else f"| {r.name} | {mib(m.artifact_bytes)} | {kv} | "
                   f"not measured: {m.error} | | | | |")
    m0 = rows[0].metrics.memory
    out += ["", f"Peak RSS: a child process loads the artifact, prefills {m0.prefill_tokens} tokens and decodes "
            f"{m0.decode_tokens} ({m0.peak_source}); the interpreter column is that process after importing "
            "Python, torch and the runtime, before loading. The artifact's RSS (peak minus interpreter) is what "
            "a device's usable memory is compared with."]
    parts = [(r.name, r.metrics.memory.predicted_parts) for r in rows if r.metrics.memory.predicted_parts]
    if parts:
        out += ["", "The prediction's terms, MiB (optimize/footprint/memory.py, `predicted_parts`):"]
        out += [f"- {name}: " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in p.items() if v) for name, p in parts]
    out.append("")
    dev = [r for r in rows if r.metrics.device is not None]
    if dev:
        d0 = dev[0].metrics.device
        out += [f"## Device `{d0.device}` ({d0.kind}): fit and PREDICTED decode",
                "| row | artifact's RSS MiB (measured here) | usable MiB | fits | artifact MiB | storage MiB | "
                "host decode tok/s (measured) | host GB/s (measured) | fraction of host ceiling | device GB/s | "
                "decode tok/s (predicted) | at max_seq_len (predicted) |",
                "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in dev:
            p = r.metrics.device
            fits = "–" if p.fits_memory is None else ("yes" if p.fits_memory and p.fits_storage is not False else "NO")
            out.append(f"| {r.name} | {mib(p.model_rss_bytes)} | {mib(p.usable_memory_bytes)} | {fits} | "
                       f"{mib(p.artifact_bytes)} | {mib(p.storage_bytes)} | {_fmt(p.host_decode_tok_s, '.1f')} | "
                       f"{_fmt(p.host_bandwidth_gb_s, '.1f')} | {_fmt(p.host_fraction_of_ceiling, '.2f')} | "
                       f"{_fmt(p.device_bandwidth_gb_s, '.1f')} | {_fmt(p.predicted_decode_tok_s, '.1f')} | "
                       f"{_fmt(p.predicted_decode_tok_s_at_max_seq_len, '.1f')} |")
        out += ["", f"Method (predicted, not measured on the device): {d0.method}."]
        out += [f"- {n}" for n in dict.fromkeys(n for r in dev for n in r.metrics.device.notes)]
        out.append("")
    return out


def resource_lines(report: Report) -> list[str]:
    """One line per row that was measured: its time, device and peak memory."""
    lines = []
    for r in report.rows:
        res = r.resources
        if res is None:
            continue
        parts = [f"{r.wall_s:.1f} s on {res.device}"]
        if res.peak_rss_mb is not None:
            parts.append(f"peak RSS {res.peak_rss_mb:.0f} MiB (+{_fmt(res.peak_rss_delta_mb, '.0f')} over its start)")
        if res.peak_cuda_mb is not None:
            parts.append(f"CUDA peak {res.peak_cuda_mb:.0f} MiB allocated")
        lines.append(f"- {r.name}: " + ", ".join(parts))
    return lines


def render_markdown(report: Report) -> str:
    out = [f"# Pipeline report: {report.name}", ""]
    out += [f"Result: **{report.verdict()}**" + (f" · target `{report.target}`" if report.target else ""), ""]
    out += [markdown_table(report), ""]
    eval_tokens = next((r.metrics.eval_tokens for r in report.rows if r.metrics.eval_tokens), None)
    if report.data:
        spans = {k: v for k, v in report.data.items() if isinstance(v, dict)}
        span_txt = "; ".join(f"{k} tokens [{v['start']}, {v['stop']})" for k, v in spans.items())
        out += [f"Text: `{report.data.get('corpus')}` ({span_txt}). Accuracy figures rest on {eval_tokens} tokens.", ""]
    precision = precision_lines(report)
    if precision:
        out += ["## Precision of the Linear layers", *precision, ""]
    runtime = runtime_lines(report)
    if runtime:
        out += ["## Export runtime", *runtime, ""]
    tasks_cfg = ((report.config or {}).get("checks") or {}).get("tasks") or {}
    tasks = task_lines(report, expand_groups=bool(tasks_cfg.get("expand_groups")))
    if tasks:
        out += tasks
    device = device_lines(report)
    if device:
        out += device
    resources = resource_lines(report)
    if resources:
        out += ["## Time and memory per row", *resources, ""]
    gate_lines = [f"- {r.name}: {'ok' if g.ok else 'FAILED'} — {g.message}" for r in report.rows for g in r.gates]
    if gate_lines:
        out += ["## Gates", *gate_lines, ""]
    errors = [f"- {r.name}: {r.error}" for r in report.rows if r.error]
    if errors:
        out += ["## Errors", *errors, ""]
    if report.last_good_artifact:
        out += [f"Last good model: `{report.last_good_artifact}`", ""]
    return "\n".join(out)


def render_plot(report: Report, path: Path) -> Path | None:
    """Perplexity against size and against decode speed, one point per row.

    None without matplotlib (a pinned dependency, but absent from a bare GPU image that runs only
    the stages): the JSON and Markdown report of a finished run must not be lost to a missing plot."""
    try:
        import matplotlib
    except ImportError:
        logging.getLogger(__name__).warning("report.png not drawn: matplotlib is not installed (pip install matplotlib)")
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.metrics.perplexity is not None]
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, attr, label in ((axes[0], "size_mb", "size (MiB)"), (axes[1], "decode_tok_s", "decode (tokens/s)")):
        pts = [(getattr(r.metrics, attr), r.metrics.perplexity, r) for r in rows if getattr(r.metrics, attr) is not None]
        for k, (x, y, r) in enumerate(pts):
            color = "tab:red" if r.status in ("fail", "error") else ("tab:orange" if r.status == "warn" else "tab:blue")
            ax.scatter([x], [y], color=color, zorder=3)
            # stagger labels so neighbouring points (a stage and its export) stay readable
            ax.annotate(f"{r.name} ({r.runtime})", (x, y), textcoords="offset points",
                        xytext=(4, 4 - 12 * (k % 3)), fontsize=8)
        if len(pts) > 1:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color="0.7", lw=1, zorder=1)
        ax.set_xlabel(label)
        ax.set_ylabel("perplexity (lower is better)")
        ax.grid(alpha=0.3)
        if not pts:
            ax.text(0.5, 0.5, f"no {label} measured", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"{report.name}: accuracy vs size and speed per stage")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path


def write_report(report: Report, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": atomic_write_json(out_dir / "report.json", report.model_dump(mode="json")),
        "md": atomic_write_text(out_dir / "report.md", render_markdown(report)),
    }
    png = render_plot(report, out_dir / "report.png")
    if png is not None:
        paths["png"] = png
    return paths


def report_json_schema() -> dict:
    return Report.model_json_schema()
