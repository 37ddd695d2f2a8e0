"""Verify an artifact in the ARM64 build of its own runtime, on an emulated device core.

The same :func:`export.arm64.probe.probe` runs twice: in this process on the host's x86-64
runtime, and under QEMU on the ARM64 wheels of the same versions (:mod:`targets.arm64`). The
artifact passes when

* greedy decoding gives the same tokens from every prompt, or first diverges at a near-tie: the
  host's logit gap between the two runtimes' choices is no larger than the typical largest logit
  difference the two builds show at one position of the perplexity windows (the report gives the
  gap and that threshold);
* perplexity over the windows is within ``ppl_tolerance_pct`` of the host runtime's.

The guest's wall time is an emulator's: the report keeps it under ``emulated_seconds`` and never
turns it into a speed.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from export.arm64.probe import probe
from targets.arm64 import cpus
from targets.arm64.emulate import run_python
from targets.arm64.environment import require

#: the folders the guest imports this project from (export.*, targets.*)
PROJECT = Path(__file__).resolve().parents[2]


class Arm64VerifyError(ValueError):
    """Bad input to the ARM64 check (an unknown CPU, an artifact that is not there)."""


def _pick_cpu(cpu: str | None, device: str | None) -> tuple[cpus.EmulatedCpu, str]:
    if cpu and device:
        raise Arm64VerifyError("give either cpu or device, not both")
    if device:
        from targets.devices import load_device

        return cpus.cpu_for_device(load_device(device))
    try:
        c = cpus.resolve_cpu(cpu or "cortex-a76")
    except cpus.CpuError as exc:
        raise Arm64VerifyError(str(exc)) from None
    return c, c.name


def _divergence(host_ids, guest_ids, host_steps, tie: float) -> dict:
    """Where two greedy runs first differ, and whether it is a near-tie on the host's logits."""
    n = min(len(host_ids), len(guest_ids))
    k = next((i for i in range(n) if host_ids[i] != guest_ids[i]), None)
    if k is None:
        return {"equal": len(host_ids) == len(guest_ids), "first_divergence": None}
    a, b = host_ids[k], guest_ids[k]
    gap = float(host_steps[k][a] - host_steps[k][b])
    return {"equal": False, "first_divergence": k, "host_token": a, "guest_token": b,
            "host_gap": round(gap, 5), "tie_threshold": round(tie, 5), "near_tie": gap <= tie}


def verify_on_arm64(artifact: str | Path, *, prompts: list[list[int]], windows: list[list[int]],
                    new_tokens: int = 16, cpu: str | None = None, device: str | None = None,
                    ppl_tolerance_pct: float = 1.0, threads: int = 2, timeout: float = 1800) -> dict:
    """Run ``artifact`` on the host and on an emulated Arm core; a JSON-serializable report.

    ``prompts`` and ``windows`` are token ids (the caller tokenizes); ``cpu`` is an emulated core
    (:data:`targets.arm64.cpus.CPUS`) or ``device`` a device profile whose core is used."""
    artifact = Path(artifact).resolve()
    if not artifact.exists():
        raise FileNotFoundError(f"artifact not found: {artifact}")
    if not prompts and not windows:
        raise Arm64VerifyError("nothing to compare: give prompts or windows")
    core, stands_for = _pick_cpu(cpu, device)
    env = require()
    where = f"aarch64 (emulated, {core.name})"
    with tempfile.TemporaryDirectory(prefix="arm64-verify-") as tmp:
        tmp = Path(tmp)
        host = probe(artifact, prompts, new_tokens, windows, tmp / "host.npz", threads)
        request = tmp / "request.json"
        request.write_text(json.dumps({"artifact": str(artifact), "prompts": prompts, "windows": windows,
                                       "new_tokens": new_tokens, "tag": "guest", "threads": threads}))
        run = run_python(env, core, ["-m", "export.arm64.probe", str(request)], paths=[PROJECT],
                         timeout=timeout, threads=threads)
        report = {"artifact": str(artifact), "runtime": host["runtime"], "where": where, "cpu": core.name,
                  "core": core.describe(stands_for), "qemu_cpu": core.qemu, "stands_for": stands_for,
                  "environment": env.info()["versions"],
                  "host": {k: host[k] for k in ("greedy", "perplexity", "tokens")}}
        failure = run.failure()
        if failure is None:
            try:
                guest = json.loads(run.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                failure = f"the guest printed no report: {run.stderr.strip()[-300:]}"
        if failure is not None:
            return {**report, "verified": False, "failure": failure, "guest_stderr": run.stderr[-2000:]}
        return {**report, **_compare(host, guest, np.load(tmp / "host.npz"), np.load(tmp / "guest.npz"),
                                     ppl_tolerance_pct)}


def _compare(host: dict, guest: dict, h, g, ppl_tolerance_pct: float) -> dict:
    """The verdict on two probes (``h``, ``g``: their saved logits): the builds' noise measured on
    the windows sets the near-tie threshold for the greedy runs."""
    per_position = [np.abs(h[k] - g[k]).max(axis=-1) for k in h.files if k.startswith("window")]
    per_position = np.concatenate(per_position) if per_position else np.zeros(0)
    scale = max((float(np.abs(h[k]).max()) for k in h.files), default=1.0)
    tie = float(np.median(per_position)) if per_position.size else 0.0
    greedy = [_divergence(hi, gi, h[f"greedy{i}"], tie) for i, (hi, gi) in enumerate(zip(host["greedy"], guest["greedy"]))]
    ppl_h, ppl_g = host["perplexity"], guest["perplexity"]
    rel = abs(ppl_g - ppl_h) / ppl_h * 100 if ppl_h else 0.0
    se = _paired_se_pct(host.get("window_nll"), guest.get("window_nll"), host.get("tokens"))
    worst = float(per_position.max()) if per_position.size else None
    greedy_ok = all(d["equal"] or d.get("near_tie") for d in greedy)
    ppl_ok = ppl_h is None or rel <= ppl_tolerance_pct
    return {"verified": bool(greedy_ok and ppl_ok and guest.get("machine") == "aarch64"),
            "guest": {"machine": guest.get("machine"), "greedy": guest["greedy"], "perplexity": ppl_g,
                      "emulated_seconds": guest["seconds"]},
            "greedy": greedy,
            "perplexity": {"host": ppl_h, "guest": ppl_g, "rel_diff_pct": round(rel, 4),
                           "tolerance_pct": ppl_tolerance_pct, "ok": ppl_ok,
                           "windows": len(host.get("window_nll") or []), "se_pct": se},
            "logits": {"max_abs_diff": None if worst is None else round(worst, 5),
                       "median_position_max_abs_diff": round(tie, 5), "scale": round(scale, 4),
                       "max_abs_diff_pct_of_scale": None if worst is None else round(worst / scale * 100, 3)}}


def _paired_se_pct(host: list[float] | None, guest: list[float] | None, tokens: int | None) -> float | None:
    """The standard error, in percent of perplexity, of the two builds' difference, from how it varies
    window to window: how far apart two builds that compute the same model land on this many windows
    (a 4-bit model's builds round differently and differ by a few percent a window either way)."""
    if not host or not guest or len(host) != len(guest) or len(host) < 2 or not tokens:
        return None
    per_token = np.array(guest) - np.array(host)  # each window's NLL difference (sums)
    n = len(per_token)
    # the per-token mean difference is sum(d) / tokens; its spread across equal windows gives the error
    se_nats = float(np.std(per_token, ddof=1)) * np.sqrt(n) / tokens
    return round(float(np.expm1(se_nats)) * 100, 4)


def verify_artifact(artifact: str | Path, *, cpu: str | None = None, device: str | None = None,
                    corpus: str = "pydoc", prompts: int = 2, prompt_tokens: int = 32, new_tokens: int = 16,
                    windows: int = 24, window_tokens: int = 128, ppl_tolerance_pct: float = 1.0,
                    threads: int = 2) -> dict:
    """:func:`verify_on_arm64` on text: the tokenizer beside ``artifact`` tokenizes ``corpus``;
    the windows are its first tokens (the project's evaluation span), the prompts start at token
    5000 (the reference measurement's prompt offset), each clipped to the artifact's
    ``max_seq_len``."""
    from transformers import AutoTokenizer

    from export.arm64.probe import open_runner
    from targets.sources.corpus import load_text, tokenize

    artifact = Path(artifact)
    if not artifact.exists():
        raise FileNotFoundError(f"artifact not found: {artifact}")
    for name, value in (("prompts", prompts), ("windows", windows)):
        if value < 0:
            raise Arm64VerifyError(f"{name} must be >= 0, got {value}")
    for name, value in (("prompt_tokens", prompt_tokens), ("new_tokens", new_tokens), ("window_tokens", window_tokens)):
        if value < 1:
            raise Arm64VerifyError(f"{name} must be >= 1, got {value}")
    folder = artifact if artifact.is_dir() else artifact.parent
    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise Arm64VerifyError(f"no tokenizer files beside {artifact} ({type(exc).__name__}: {exc})") from None
    limit = open_runner(artifact).max_seq_len
    if limit is not None:
        window_tokens = min(window_tokens, limit - 1)
        prompt_tokens = min(prompt_tokens, max(1, limit - 1 - new_tokens))
    ids = tokenize(load_text(corpus), tok).tolist()
    wins = [ids[i * window_tokens: (i + 1) * window_tokens + 1] for i in range(windows)]
    start = min(5000, max(0, len(ids) - prompts * prompt_tokens))
    prs = [ids[start + i * prompt_tokens: start + (i + 1) * prompt_tokens] for i in range(prompts)]
    return verify_on_arm64(artifact, prompts=prs, windows=[w for w in wins if len(w) > 1], new_tokens=new_tokens,
                           cpu=cpu, device=device, ppl_tolerance_pct=ppl_tolerance_pct, threads=threads)


def summary(report: dict) -> str:
    """One line per fact, for the CLI."""
    lines = [f"{Path(report['artifact']).name} ({report['runtime']}) on {report['where']}, {report['core']}:"]
    if report.get("failure"):
        return "\n".join(lines + [f"  NOT verified: {report['failure']}"])
    for i, d in enumerate(report["greedy"]):
        if d["equal"]:
            lines.append(f"  prompt {i}: greedy tokens equal ({len(report['host']['greedy'][i])})")
        else:
            lines.append(f"  prompt {i}: greedy diverges at step {d['first_divergence']} (host gap {d['host_gap']} vs "
                         f"near-tie threshold {d['tie_threshold']}: {'near-tie, accepted' if d['near_tie'] else 'NOT a tie'})")
    p = report["perplexity"]
    if p["host"] is not None:
        se = f" ± {p['se_pct']:.2f}% standard error over {p['windows']} windows" if p.get("se_pct") is not None else ""
        signed = (p["guest"] - p["host"]) / p["host"] * 100 if p["host"] else 0.0  # the gate reads its size
        lines.append(f"  perplexity {p['guest']:.4f} vs {p['host']:.4f} on x86-64 ({signed:+.3f}%{se}, "
                     f"tolerance {p['tolerance_pct']}%)")
    lines.append(f"  logits: largest difference {report['logits']['max_abs_diff_pct_of_scale']}% of their scale")
    lines.append(f"  {'verified' if report['verified'] else 'NOT verified'} on {report['where']}")
    return "\n".join(lines)
