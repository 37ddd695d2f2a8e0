"""SIGKILL an export at every point where it changes the output directory, for both the
ExecuTorch and the ONNX Runtime exporter.

The points are found, not guessed: the export runs once (the *previous* artifact) while every
rename/unlink/rmtree that touches a visible path of the output directory is recorded. A child
process then re-exports a distinguishable artifact (same model, one extra tokenizer token) and
SIGKILLs itself right before the k-th such step, or right after the export returns. The child is
a fresh interpreter that rebuilds the seeded model, not a fork of the test worker: a fork of a
pytest-xdist worker inherits its other threads' locks, and one such child hung in CI for 600 s
before doing anything. After each kill the directory must hold the previous
complete artifact whose manifest matches every file's sha256, or nothing; stray temporary
entries (dot-names) are tolerated but counted. A rerun must then succeed and verify.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from export.base import get_exporter
from targets.atomic import sha256_file

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

MANIFEST = "manifest.json"
AFTER = "after-return"
OPTIONS = {"executorch": {"max_seq_len": 32}, "onnxruntime": {}}


def _quiet(*_a, **_k):
    pass


def _build_tiny():
    """The seeded one-block Llama; the children build the very same one."""
    from tests.conftest import TINY_CONFIGS
    from targets.sources import RandomSource, load_model

    return load_model(RandomSource(config={**TINY_CONFIGS["llama"], "num_hidden_layers": 1, "initializer_range": 0.2},
                                   seed=0))


def _with_extra_token(tokenizer):
    """Same model, one extra token: every export with it differs in its tokenizer files."""
    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(["<kill-test-token>"])
    return tok


@pytest.fixture(scope="module")
def tiny():
    return _build_tiny()


@pytest.fixture(scope="module")
def other_tokenizer(tiny):
    return _with_extra_token(tiny.tokenizer)


# ---- recording / killing at the steps that change the visible directory


class _Steps:
    """Wrap os.replace/rename/unlink/remove and shutil.rmtree; ``hook(step)`` runs before each
    call that touches ``out`` itself or a non-dot entry directly inside it."""

    NAMES = (("os", "replace"), ("os", "rename"), ("os", "unlink"), ("os", "remove"), ("shutil", "rmtree"))

    def __init__(self, out: Path, hook):
        self.out, self.hook, self.saved = out.resolve(), hook, []

    def _visible(self, p) -> bool:
        try:
            p = Path(os.fspath(p)).absolute()
        except TypeError:
            return False
        return p == self.out or (p.parent == self.out and not p.name.startswith("."))

    def install(self):
        mods = {"os": os, "shutil": shutil}
        for mod, name in self.NAMES:
            real = getattr(mods[mod], name)
            self.saved.append((mods[mod], name, real))

            def wrapper(*args, _real=real, _name=f"{mod}.{name}", **kw):
                paths = [a for a in args[:2] if isinstance(a, (str, os.PathLike))]
                if any(self._visible(p) for p in paths):
                    self.hook(f"{_name}({', '.join(Path(os.fspath(p)).name for p in paths)})")
                return _real(*args, **kw)

            setattr(mods[mod], name, wrapper)
        return self

    def uninstall(self):
        for mod, name, real in reversed(self.saved):
            setattr(mod, name, real)


def _state(out: Path) -> tuple[str, dict | None, list[str]]:
    """('nothing' | 'complete', manifest, litter). Fails on a partial or mismatching directory."""
    if not out.exists():
        return "nothing", None, []
    entries = sorted(out.iterdir())
    litter = [p.name for p in entries if p.name.startswith(".")]
    visible = [p for p in entries if not p.name.startswith(".")]
    if not visible:
        return "nothing", None, litter
    names = [p.name for p in visible]
    assert MANIFEST in names, f"{out} holds {names} but no {MANIFEST}: a partial export"
    manifest = json.loads((out / MANIFEST).read_text())
    files = manifest["files"]
    for name, info in files.items():
        assert (out / name).is_file(), f"manifest lists {name}, missing from {out}"
        assert sha256_file(out / name) == info["sha256"], f"{out / name}: sha256 differs from its manifest"
    extra = set(names) - set(files) - {MANIFEST}
    assert not extra, f"{out} holds files its manifest does not list: {sorted(extra)}"
    return "complete", manifest, litter


def _sibling_litter(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def _child(name: str, out: str, kill_at: str, lowered: str) -> None:
    """The child's body (a fresh interpreter): export the other-tokenizer artifact, SIGKILL at step
    ``kill_at`` (1-based) or AFTER. ``lowered``: a pickle of ExecuTorch's captured lowering, or ''."""
    tiny = _build_tiny()
    tokenizer = _with_extra_token(tiny.tokenizer)
    count = 0

    def hook(step):
        nonlocal count
        count += 1
        if str(count) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    if lowered:
        import export.executorch.exporter as et

        result = pickle.loads(Path(lowered).read_bytes())
        et.lower_to_pte = lambda *a, **k: result
    _Steps(Path(out), hook).install()
    get_exporter(name).export(tiny.model, tokenizer, Path(out), OPTIONS[name], log=_quiet)
    if kill_at == AFTER:
        os.kill(os.getpid(), signal.SIGKILL)


_CHILD = """import importlib.util, sys
spec = importlib.util.spec_from_file_location("kill_export_child", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
mod._child(*sys.argv[2:])
"""


def _run_child(name, out, kill_at, lowered: Path | None) -> int:
    """The child's return code: -SIGKILL where it killed itself as told."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, __file__, name, str(out), str(kill_at),
                               str(lowered or "")], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} export child did not finish in 600 s (kill point {kill_at})")
    if proc.returncode != -signal.SIGKILL:
        print(proc.stderr[-4000:], file=sys.stderr)
    return proc.returncode


@pytest.mark.parametrize("name", ["executorch", "onnxruntime"])
def test_sigkill_at_every_step_leaves_old_or_nothing_and_rerun_succeeds(name, tiny, other_tokenizer, tmp_path,
                                                                         monkeypatch):
    out = tmp_path / "export" / name
    exporter = get_exporter(name)

    # the previous artifact, exported for real; ExecuTorch's lowering (the slow part, and no
    # step of shipping) is captured so that children and reruns ship the same program quickly
    lowered = {}
    if name == "executorch":
        import export.executorch.exporter as et

        real_lower = et.lower_to_pte

        def capture(*a, **k):
            lowered["result"] = real_lower(*a, **k)
            return lowered["result"]

        monkeypatch.setattr(et, "lower_to_pte", capture)
    exporter.export(tiny.model, tiny.tokenizer, out, OPTIONS[name], log=_quiet)
    state, old_manifest, _ = _state(out)
    assert state == "complete"
    pristine = tmp_path / "pristine"
    shutil.copytree(out, pristine, ignore=shutil.ignore_patterns(".*"))

    lowered_file = None
    if lowered:
        lowered_file = tmp_path / "lowered.pickle"
        lowered_file.write_bytes(pickle.dumps(lowered["result"]))
    patch_in_parent = (lambda: monkeypatch.setattr("export.executorch.exporter.lower_to_pte",
                                                   lambda *a, **k: lowered["result"])) if lowered else (lambda: None)

    # the steps a re-export over an existing artifact takes
    steps: list[str] = []
    recorder = _Steps(out, steps.append).install()
    try:
        patch_in_parent()
        exporter.export(tiny.model, other_tokenizer, out, OPTIONS[name], log=_quiet)
    finally:
        recorder.uninstall()
    state, new_manifest, _ = _state(out)
    assert state == "complete" and new_manifest["files"] != old_manifest["files"]
    assert steps, f"{name}: the export changed {out} without any rename/unlink"
    n = len(steps)
    points = sorted({1, 2, (n + 1) // 2, n} & set(range(1, n + 1))) + [AFTER]

    outcomes = {}
    for k in points:
        shutil.rmtree(out)
        shutil.copytree(pristine, out)
        status = _run_child(name, out, k, lowered_file)
        assert status == -signal.SIGKILL, (
            f"{name}: the child was to die at step {k} of {steps} but ended with status {status} (its stderr above)")
        try:
            state, manifest, litter = _state(out)
        except AssertionError as exc:
            where = "after the export returned" if k == AFTER else f"before step {k} ({steps[k - 1]})"
            raise AssertionError(f"{name}: SIGKILL {where} of {steps}: {exc}") from None
        if state == "complete":
            which = "old" if manifest["files"] == old_manifest["files"] else "new"
            assert which == "old" or manifest["files"] == new_manifest["files"]
            assert which == "old" or k == AFTER or k == n, f"{name}: new artifact complete before its last step {k}/{n}"
            state = which
        outcomes[k if k == AFTER else f"before {steps[k - 1]}"] = (state, litter + _sibling_litter(out))
        assert k != AFTER or state == "new", f"{name}: a finished export must leave the new artifact"

        # a rerun after the kill succeeds and verifies
        patch_in_parent()
        result = exporter.export(tiny.model, other_tokenizer, out, OPTIONS[name], log=_quiet)
        state, manifest, _ = _state(out)
        assert state == "complete" and manifest["files"] == new_manifest["files"], f"{name}: rerun after kill at {k}"
        runner = exporter.load(result.artifact)
        try:
            assert runner.forward(tiny.tokenizer("def f(x):", return_tensors="pt").input_ids[0]).shape[-1] >= 49152
        finally:
            runner.close()
    print(f"\n{name}: {n} steps {steps}\n" + "\n".join(f"  kill {k}: {v}" for k, v in outcomes.items()))
