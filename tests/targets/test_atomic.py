"""targets.atomic: writes are all-or-nothing, and a writer killed mid-write is healed by the next."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from targets.atomic import atomic_dir, atomic_path, atomic_write_text, recover_leftovers


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_failed_write_leaves_the_old_file(tmp_path):
    target = atomic_write_text(tmp_path / "f.txt", "old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_failed_dir_write_leaves_the_old_dir(tmp_path):
    with atomic_dir(tmp_path / "d") as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "d") as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError("killed")
    assert (tmp_path / "d" / "a").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["d"]


def test_dir_moved_aside_by_a_dead_writer_is_restored(tmp_path):
    """A kill between 'move the old dir aside' and 'rename the new one in' leaves only the old
    copy, hidden; the next writer (or recover_leftovers) puts it back before doing anything."""
    pid = _dead_pid()
    old = tmp_path / f".d.old-{pid}"
    old.mkdir()
    (old / "a").write_text("last complete")
    recover_leftovers(tmp_path / "d")
    assert (tmp_path / "d" / "a").read_text() == "last complete" and not old.exists()


def test_leftover_temporaries_of_dead_writers_are_removed(tmp_path):
    pid = _dead_pid()
    (tmp_path / f".d.{pid}.abc.tmp").mkdir()
    (tmp_path / f".f.txt.{pid}.xyz.tmp").write_text("partial")
    live = tmp_path / f".f.txt.{os.getpid()}.live.tmp"  # our own, in flight: kept
    live.write_text("in flight")
    atomic_write_text(tmp_path / "f.txt", "new")
    with atomic_dir(tmp_path / "d") as tmp:
        (tmp / "a").write_text("x")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["d", "f.txt", live.name])
    # an old copy beside a present final is stale: removed
    stale = tmp_path / f".d.old-{pid}"
    stale.mkdir()
    recover_leftovers(tmp_path / "d")
    assert not stale.exists() and (tmp_path / "d" / "a").read_text() == "x"


def test_keep_existing_lets_the_first_complete_writer_win(tmp_path):
    """Two writers of one cache entry, interleaved: the second finds the first's directory in
    place and discards its own, so a reader of the first never sees it replaced."""
    final = tmp_path / "cache" / "model"
    first, second = atomic_dir(final, keep_existing=True), atomic_dir(final, keep_existing=True)
    a, b = first.__enter__(), second.__enter__()
    (a / "w").write_text("first")
    (b / "w").write_text("second")
    first.__exit__(None, None, None)
    held = (final / "w").open()  # a reader of the winner
    second.__exit__(None, None, None)
    assert held.read() == "first" and (final / "w").read_text() == "first"
    held.close()
    assert sorted(p.name for p in final.parent.iterdir()) == ["model"]  # the loser's tmp is gone
    with atomic_dir(final) as c:  # without keep_existing, a writer still replaces it
        (c / "w").write_text("third")
    assert (final / "w").read_text() == "third"
