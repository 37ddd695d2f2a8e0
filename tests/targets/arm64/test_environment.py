"""The ARM64 environment's key, its refusals, the per-core prefix and the CUDA stubs' assembly,
without building anything (tests/export/arm64/test_verify.py builds and runs it)."""

from __future__ import annotations


import json

import pytest

from targets.arm64 import cpus, environment
from targets.arm64.cuda_stubs import _assembly


def test_key_follows_versions_and_local_labels_are_dropped(monkeypatch):
    seen = {"torch": "2.13.0+cpu"}
    monkeypatch.setattr(environment.metadata, "version", lambda d: seen.get(d, "1.0"))
    v = environment.pinned_versions()
    assert v["torch"] == "2.13.0"  # the ARM64 wheel of a +cpu build is the public release
    k = environment.environment_key(v)
    assert k == environment.environment_key(dict(v))
    assert k != environment.environment_key({**v, "executorch": "1.5.2"})


def test_a_missing_package_is_named(monkeypatch):
    def version(d):
        if d == "onnxruntime-genai":
            raise environment.metadata.PackageNotFoundError(d)
        return "1.0"

    monkeypatch.setattr(environment.metadata, "version", version)
    with pytest.raises(environment.Arm64SetupError, match="onnxruntime-genai is not installed"):
        environment.pinned_versions()


def test_without_root_the_apt_command_is_named(monkeypatch):
    monkeypatch.setattr(environment.shutil, "which", lambda c: None if c == "mmdebstrap" else f"/usr/bin/{c}")
    monkeypatch.setattr(environment.os, "geteuid", lambda: 1000)
    with pytest.raises(environment.Arm64SetupError, match=r"sudo apt-get install mmdebstrap"):
        environment._host_tools(lambda _m: None)


def test_nothing_built_is_found_and_required_says_how(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMIZE_ARM64_HOME", str(tmp_path))
    assert environment.find() is None
    with pytest.raises(environment.Arm64SetupError, match="optimize setup arm64"):
        environment.require()


def test_prefix_gives_each_core_its_identity_and_the_host_its_tmp(tmp_path):
    env = environment.Arm64Environment(tmp_path)
    for d in ("usr/bin", "etc", "tmp", "home"):
        (tmp_path / "root" / d).mkdir(parents=True)
    (tmp_path / "root/lib").symlink_to("usr/lib")
    p = env.prefix(cpus.CPUS["cortex-a72"])
    assert (p / "proc/cpuinfo").read_text() == cpus.cpuinfo_text(cpus.CPUS["cortex-a72"])
    assert (p / "sys/devices/system/cpu/cpu0/regs/identification/midr_el1").read_text().strip() == "0x00000000410fd083"
    assert (p / "usr").resolve() == (tmp_path / "root/usr").resolve() and (p / "lib").is_symlink()
    # /tmp and /home stay the host's, where artifacts and requests are
    assert not (p / "tmp").exists() and not (p / "home").exists()
    assert env.prefix(cpus.CPUS["cortex-a72"]) == p  # made once
    assert env.prefix(cpus.CPUS["cortex-a76"]) != p


def test_stub_assembly_gives_type_info_a_name_and_functions_scratch():
    text = _assembly({"_ZTIN5torch3FooE": ("OBJECT", None), "cudaMalloc": ("FUNC", "libcudart.so.13"),
                      "some_table": ("OBJECT", None)})
    assert '.asciz "N5torch3FooE"' in text  # pybind11 hashes type_info::name()
    assert "cudaMalloc:" in text and "adrp x0, stub_scratch" in text
    assert ".size some_table, 64" in text


def test_setup_command_prints_what_it_built(monkeypatch, capsys):
    from optimize.cli import main

    info = {"path": "/c/abc", "built": True, "bytes": {"root": 75 << 20, "site": 1300 << 20},
            "versions": {"torch": "2.13.0", "executorch": "1.5.1", "onnxruntime": "1.31.1", "onnxruntime-genai": "0.18.0",
                         "numpy": "2.4.6"}}
    calls = []
    monkeypatch.setattr(environment, "setup", lambda **kw: calls.append(kw) or info)
    assert main(["setup", "arm64"]) == 0
    out = capsys.readouterr().out
    assert "ARM64 environment built: /c/abc (1.34 GiB; torch 2.13.0, executorch 1.5.1" in out and "numpy" not in out
    assert main(["setup", "arm64", "--force", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == "/c/abc" and calls[-1]["force"] is True
    monkeypatch.setattr(environment, "setup", lambda **kw: (_ for _ in ()).throw(environment.Arm64SetupError("no apt")))
    assert main(["setup", "arm64"]) == 2 and "error: no apt" in capsys.readouterr().err
