"""Stand-ins for the NVIDIA libraries the ARM64 torch wheel links against, so it loads without them.

PyPI's only ARM64 torch wheel is the CUDA build: ``libtorch_cpu.so`` and ``libtorch_python.so``
(which ExecuTorch's pybindings link against too) list ``libcudart``, ``libcudnn``, ``libnccl``...
as needed libraries, and their wheels add about 2 GB (cuDNN alone is 445 MB, and only
``manylinux_2_27``) for code the CPU path never calls. Instead each missing library gets a stub
with its soname, the symbol versions its users require, and every symbol they import from it:

* a function returns a pointer to zeroed scratch memory. CUDA's C APIs read that as an error
  code (not ``cudaSuccess``), so ``torch.cuda.is_available()`` is False, and a C++ function that
  returns a reference (``c10d::get_gil_checker()``, called while ``torch._C`` initialises) gets
  writable memory;
* a ``typeinfo`` object is a real ``std::type_info`` layout with its mangled name (pybind11
  hashes the name of the CUDA-only classes it registers); other data is 64 zero bytes.

Torch's own CUDA libraries (``libtorch_cuda.so``...) stay real, so their static initialisers run
as built; only the NVIDIA C libraries are replaced. Nothing here is loaded on the host.
"""

from __future__ import annotations

import collections
import re
import subprocess
from pathlib import Path

#: where Debian's ARM64 libraries sit in the guest root (merged /usr)
ROOT_LIB_DIRS = ("usr/lib/aarch64-linux-gnu", "lib/aarch64-linux-gnu")
READELF = "aarch64-linux-gnu-readelf"
CC = "aarch64-linux-gnu-gcc"


def _readelf(args: list[str], path: Path) -> str:
    return subprocess.run([READELF, "-W", *args, str(path)], capture_output=True, text=True, check=False).stdout


def _dynsyms(path: Path):
    """(type, binding, section, name, version) of each dynamic symbol."""
    for line in _readelf(["--dyn-syms"], path).splitlines():
        f = line.split()
        if len(f) >= 8 and f[0].rstrip(":").isdigit():
            name, _, ver = f[7].partition("@")
            yield f[3], f[4], f[6], name, ver.lstrip("@") or None


def _shared_objects(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*.so*") if p.is_file() and not p.is_symlink() and p.suffix != ".py"
            and "AArch64" in _readelf(["-h"], p)]


def missing_libraries(site: Path, root: Path) -> dict[str, dict[str, tuple[str, str | None]]]:
    """Each needed library that neither ``site`` nor ``root`` holds -> {symbol: (type, version)}
    its users import from it. Unversioned symbols cannot be traced to their library, so every
    stub without versioned symbols exports all of them (the first one loaded answers)."""
    libs = _shared_objects(site)
    have = {p.name for p in libs} | {p.name for d in ROOT_LIB_DIRS for p in (root / d).glob("*.so*")}
    missing: set[str] = set()
    version_file: dict[str, str] = {}
    defined: set[str] = set()
    wanted: list[tuple[str, str | None, str]] = []
    for lib in libs:
        missing.update(m for m in re.findall(r"\(NEEDED\).*\[(.+?)\]", _readelf(["-d"], lib)) if m not in have)
        current = None
        for line in _readelf(["-V"], lib).splitlines():
            if m := re.search(r"File: (\S+)", line):
                current = m.group(1)
            elif (m := re.search(r"Name: (\S+)", line)) and current:
                version_file[m.group(1)] = current
        for typ, bind, section, name, ver in _dynsyms(lib):
            if section != "UND":
                defined.add(name)
            elif name and bind != "WEAK":
                wanted.append((name, ver, typ))
    for d in ROOT_LIB_DIRS:
        for lib in (root / d).glob("*.so*"):
            if lib.is_file() and not lib.is_symlink():
                defined.update(n for _, _, section, n, _ in _dynsyms(lib) if section != "UND")
    stubs: dict[str, dict[str, tuple[str, str | None]]] = {name: {} for name in missing}
    unversioned: dict[str, tuple[str, str | None]] = {}
    for name, ver, typ in wanted:
        if name in defined:
            continue
        if ver is None:
            unversioned[name] = (typ, None)
        elif version_file.get(ver) in stubs:
            stubs[version_file[ver]][name] = (typ, ver)
    for syms in stubs.values():
        if not any(v for _, v in syms.values()):
            syms.update(unversioned)
    return stubs


def _assembly(symbols: dict[str, tuple[str, str | None]]) -> str:
    out = [".bss", ".balign 16", "stub_scratch: .zero 65536", ".text"]
    for i, (name, (typ, _)) in enumerate(sorted(symbols.items())):
        if typ == "OBJECT" and name.startswith("_ZTI"):
            out += [".data", ".balign 8", f".globl {name}", f".type {name}, %object", f".size {name}, 16",
                    f"{name}: .quad 0", f".quad .Lname{i}", f'.Lname{i}: .asciz "{name[4:]}"', ".text"]
        elif typ == "OBJECT":
            out += [".data", ".balign 16", f".globl {name}", f".type {name}, %object", f".size {name}, 64",
                    f"{name}: .zero 64", ".text"]
        else:
            out += [".balign 4", f".globl {name}", f".type {name}, %function", f"{name}:",
                    "adrp x0, stub_scratch", "add x0, x0, :lo12:stub_scratch", "ret"]
    return "\n".join(out) + "\n"


def write_stubs(site: Path, root: Path, out: Path) -> dict[str, int]:
    """Build a stub for every library the ARM64 wheels in ``site`` need and ``root`` lacks, into
    ``out``; returns soname -> symbols it exports."""
    out.mkdir(parents=True, exist_ok=True)
    built = {}
    for soname, symbols in sorted(missing_libraries(site, root).items()):
        src = out / f"{soname}.s"
        src.write_text(_assembly(symbols))
        nodes: dict[str, list[str]] = collections.defaultdict(list)
        for name, (_, ver) in symbols.items():
            if ver:
                nodes[ver].append(name)
        cmd = [CC, "-shared", "-nostdlib", "-o", str(out / soname), f"-Wl,-soname,{soname}", str(src)]
        if nodes:
            script = out / f"{soname}.map"
            script.write_text("".join(f"{v} {{ global: {' '.join(n + ';' for n in sorted(ns))} }};\n"
                                      for v, ns in sorted(nodes.items())))
            cmd.append(f"-Wl,--version-script={script}")
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        src.unlink()
        built[soname] = len(symbols)
    return built
