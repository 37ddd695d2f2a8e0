"""The user cache keeps one conversion per GGUF file that still exists: a new conversion removes
the ones no load can hit again, and nothing it cannot judge."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from targets.user_cache import SOURCE_FILE, conversion_dir, drop_stale_conversions, record_source
from targets.sources import bundled_gguf_path, convert_gguf


def _conversion(root: Path, name: str, source: Path | None) -> Path:
    entry = root / name
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{}")
    if source is not None:
        record_source(entry, source)
    return entry


def test_a_conversion_removes_only_the_conversions_no_load_can_hit(tmp_path):
    """Every reinstall of a bundled model (a new mtime, a new venv path) used to leave another
    full-precision copy behind; CI's disk filled with them. Stale: an older key of the same
    file, or a file that is gone. Kept: other files' conversions, temporaries, foreign dirs."""
    model, other = tmp_path / "m.gguf", tmp_path / "other.gguf"
    model.write_bytes(b"x")
    other.write_bytes(b"y")
    root = tmp_path / "gguf"
    fresh = _conversion(root, "m-new", model)
    older = _conversion(root, "m-old", model)
    gone = _conversion(root, "gone-1", tmp_path / "deleted.gguf")
    kept = _conversion(root, "other-1", other)
    foreign = _conversion(root, "unknown", None)
    in_progress = _conversion(root, ".m-new.123.abc.tmp", model)
    odd = _conversion(root, "odd", None)
    (odd / SOURCE_FILE).write_text(json.dumps({"gguf": 7}))  # not a path: not ours to judge
    drop_stale_conversions(fresh, model)
    assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in (fresh, kept, foreign, in_progress, odd))
    assert not older.exists() and not gone.exists()


@pytest.mark.slow
def test_converting_a_reinstalled_gguf_drops_its_older_conversion(tmp_path):
    """End to end (one real conversion, 40 s): the bundled file, copied as a reinstall would,
    converts; the conversion its older mtime made is removed; the new one is reused."""
    gguf = tmp_path / "model.gguf"
    shutil.copyfile(bundled_gguf_path("smollm2-135m"), gguf)
    older = _conversion(tmp_path / "cache" / "gguf", "model-0123456789abcdef", gguf)
    (older.parent / f".{older.name}.lock").touch()  # the lock its conversion left
    assert older != conversion_dir(gguf, tmp_path / "cache")
    fresh = convert_gguf(gguf, tmp_path / "cache")
    # the fresh conversion and its lock (kept: another process may wait on it) are all that is left
    assert sorted(p.name for p in (tmp_path / "cache" / "gguf").iterdir()) == sorted([fresh.name, f".{fresh.name}.lock"])
    assert (fresh / "model.safetensors").is_file()
    assert convert_gguf(gguf, tmp_path / "cache") == fresh  # a hit


def test_a_bounded_cache_drops_old_entries_with_their_locks_and_old_orphan_locks(tmp_path):
    import os
    import time

    from targets.user_cache import ORPHAN_LOCK_S, keep_most_recent

    for k, name in enumerate(["a", "b", "c"]):
        (tmp_path / name).mkdir()
        (tmp_path / f".{name}.lock").touch()
        os.utime(tmp_path / name, (time.time() - 100 + k, time.time() - 100 + k))  # c is the most recent
    (tmp_path / ".writing.123.tmp").mkdir()  # an entry being written
    old, fresh = tmp_path / ".gone.lock", tmp_path / ".busy.lock"  # locks without an entry
    old.touch()
    os.utime(old, (time.time() - ORPHAN_LOCK_S - 5, time.time() - ORPHAN_LOCK_S - 5))
    fresh.touch()  # a writer may hold it right now
    keep_most_recent(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".b.lock", ".busy.lock", ".c.lock", ".writing.123.tmp", "b", "c"]


@pytest.fixture()
def rank_one(monkeypatch):
    """As in the second process of a torchrun launch: transformers 5's save_pretrained writes
    nothing there (only rank 0 saves), so a conversion made by that process must not rely on it."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 1)


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_a_conversion_is_written_whole_by_any_rank_with_its_tied_head_stored_once(arch, tiny_config, rank_one,
                                                                                   tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from targets.sources.gguf import _save_conversion

    from transformers import AutoConfig

    cfg = tiny_config(arch, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).eval()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    _save_conversion(model, tmp_path)
    assert (tmp_path / "config.json").is_file()
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert not any(k.startswith("lm_head") for k in keys)  # the tied head is the embedding, stored once
    back = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert back.get_output_embeddings().weight is back.get_input_embeddings().weight
    want, got = model.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]), k
