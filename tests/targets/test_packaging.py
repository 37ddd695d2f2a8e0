"""The wheel a user installs holds what the package reads at run time: every target profile and
every device profile (``optimize ls targets`` / ``optimize ls devices`` read them from the
installed package, so a non-editable install without them has no devices at all), and the build
itself says nothing about a deprecated license table."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_built_wheel_ships_every_profile_and_builds_without_warnings(tmp_path):
    # built from a copy: setuptools writes build/ and *.egg-info beside the sources
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info",
                                                             "__pycache__", "tests", "bench", "docs", "examples"))
    # the venv's own setuptools, no download: --no-build-isolation
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "project.license" not in done.stdout + done.stderr, "setuptools warns about the license table"
    (wheel,) = (tmp_path / "dist").glob("edge_optimize-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder in ("profiles", "devices"):
        shipped = {p.name for p in (ROOT / "targets" / folder).glob("*.yaml")}
        assert shipped, folder
        assert {f"targets/{folder}/{n}" for n in shipped} <= names, sorted(names)[:20]
