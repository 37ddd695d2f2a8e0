"""``checks.arm64`` on an export row: the artifact run in the ARM64 build of its runtime on each
emulated core (:mod:`export.arm64.verify`), and the row's ``arm64`` gate.

The prompts are cut from the run's latency prompt and the windows are the first evaluation
windows, shortened to ``window_tokens``: the emulator runs a runtime about a hundred times slower
than the host, so the check is a few windows, not the row's whole perplexity.
"""

from __future__ import annotations

from pathlib import Path

from export.arm64.probe import GENAI_CONFIG
from optimize.checks.arm64_config import Arm64Check
from optimize.gates_config import GateResult


def runnable(path: Path) -> bool:
    """Whether the guest has a runtime for ``path`` (AOTInductor's ``.pt2`` is compiled for the
    host, and torchchat's ``.pth`` runs in torchchat, which the guest does not hold)."""
    path = Path(path)
    return (path.suffix in (".pte", ".onnx") or path.name == GENAI_CONFIG
            or (path.is_dir() and (path / GENAI_CONFIG).is_file()))


def cores(check: Arm64Check, device) -> list[str]:
    """The cores to emulate: the config's, else the device profile's, else a Cortex-A76."""
    if check.cpus:
        return list(check.cpus)
    if device is not None and device.arch == "aarch64":
        from targets.arm64.cpus import cpu_for_device

        return [cpu_for_device(device)[0].name]
    return ["cortex-a76"]


def measure_arm64(check: Arm64Check, path: Path, prompt, eval_windows, max_seq_len: int | None, device,
                  say) -> list[dict]:
    """One :func:`export.arm64.verify.verify_on_arm64` report per core (a dict saying why not, for an
    artifact without an ARM64 runtime)."""
    if not runnable(path):
        why = f"no ARM64 runtime check for {Path(path).name} (only .pte, .onnx and onnxruntime-genai)"
        say(f"{Path(path).name}: {why}")
        return [{"artifact": str(path), "verified": None, "skipped": why}]
    from export.arm64.verify import summary, verify_on_arm64

    window = check.window_tokens if max_seq_len is None else min(check.window_tokens, max_seq_len - 1)
    plen = check.prompt_tokens if max_seq_len is None else max(1, min(check.prompt_tokens, max_seq_len - 1 - check.new_tokens))
    ids = [int(t) for t in prompt.reshape(-1)]
    prompts = [ids[i * plen:(i + 1) * plen] for i in range(check.prompts) if len(ids) >= (i + 1) * plen] or (
        [ids[:plen]] if check.prompts else [])
    windows = _cut(eval_windows, window, check.windows)
    out = []
    for cpu in cores(check, device):
        say(f"{Path(path).name}: verifying on emulated {cpu} (ARM64 build of its runtime)")
        rep = verify_on_arm64(path, prompts=prompts, windows=windows, new_tokens=check.new_tokens, cpu=cpu,
                              ppl_tolerance_pct=check.ppl_tolerance_pct)
        for line in summary(rep).splitlines()[1:]:
            say(f"  {line.strip()}")
        out.append(rep)
    return out


def _cut(eval_windows, window: int, count: int) -> list[list[int]]:
    """``count`` windows of ``window`` targets, in order, from the run's evaluation windows (each cut in as
    many as it holds): the check's perplexity text is the start of the row's own."""
    out: list[list[int]] = []
    for w in eval_windows:
        ids = [int(t) for t in w.reshape(-1)]
        for start in range(0, len(ids) - window, window):
            if len(out) == count:
                return out
            out.append(ids[start:start + window + 1])
    return out


def arm64_gates(results: list[dict] | None) -> list[GateResult]:
    """One ``arm64`` gate per emulated core that ran; a skipped artifact has none."""
    gates = []
    for rep in results or []:
        if rep.get("verified") is None:
            continue
        if rep.get("failure"):
            why = rep["failure"]
        else:
            bad = [f"prompt {i} diverges at step {d['first_divergence']} (gap {d['host_gap']} > {d['tie_threshold']})"
                   for i, d in enumerate(rep["greedy"]) if not d["equal"] and not d.get("near_tie")]
            p = rep["perplexity"]
            if not p["ok"]:
                bad.append(f"perplexity {p['rel_diff_pct']}% from x86-64 > {p['tolerance_pct']}%")
            why = "; ".join(bad) or "ok"
        gates.append(GateResult(metric="arm64", goal={"cpu": rep["cpu"], "ppl_tolerance_pct": rep.get(
            "perplexity", {}).get("tolerance_pct")}, value=rep.get("perplexity", {}).get("rel_diff_pct"), baseline=None,
            ok=bool(rep["verified"]), message=(f"verified on {rep['where']}" if rep["verified"]
                                               else f"NOT verified on {rep['where']}: {why}")))
    return gates
