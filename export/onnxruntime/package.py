"""Packaging an ONNX export directory: the checker, toolchain versions, and the atomic ship
(the directory is built beside the output and swapped in whole)."""

from __future__ import annotations

import platform
import shutil
import tempfile
from pathlib import Path

import torch

from targets.atomic import atomic_dir, atomic_write_json
from export.base import ExportError, ExportResult
from export.onnxruntime.runner import MANIFEST

MODEL_FILE = "model.onnx"


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


#: ops ORT registers in the default ONNX domain though ONNX does not define them (the model
#: builder emits them); the checker sees them under com.microsoft, where it skips the schema
ORT_DEFAULT_DOMAIN_OPS = ("SimplifiedLayerNormalization",)


def check_onnx(path: Path) -> None:
    """``onnx.checker`` on the path (so external data is followed); failure never ships.

    ORT's default-domain extensions (:data:`ORT_DEFAULT_DOMAIN_OPS`) are checked as contrib
    ops, on a copy of the graph beside the original (same external data); ORT itself loads the
    real file in the smoke check."""
    import onnx

    path = Path(path)
    try:
        proto = onnx.load(str(path), load_external_data=False)
        from export.onnxruntime.decode_branch import all_nodes

        odd = [n for n in all_nodes(proto.graph) if n.domain in ("", "ai.onnx") and n.op_type in ORT_DEFAULT_DOMAIN_OPS]
        if not odd:
            onnx.checker.check_model(str(path))
            return
        for n in odd:
            n.domain = "com.microsoft"
        if not any(o.domain == "com.microsoft" for o in proto.opset_import):
            proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
        copy = path.with_name(f".check.{path.name}")
        try:
            onnx.save(proto, str(copy))
            onnx.checker.check_model(str(copy))
        finally:
            copy.unlink(missing_ok=True)
    except Exception as exc:  # ValidationError, or a load error for a broken file
        raise ExportError(f"ONNX checker rejected {path.name}: {exc}") from None


def _ship(out_dir: Path, build, log) -> ExportResult:
    """Build into a temporary directory beside ``out_dir`` and swap it in whole
    (:func:`targets.atomic.atomic_dir`): at every instant ``out_dir`` is the old complete export,
    the new complete one, or absent; a failed build leaves it as it was. ``build(stage, work)``
    writes the shipped files into ``stage``; ``work`` is scratch space, never shipped."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.work.", dir=out_dir.parent))
    try:
        with atomic_dir(out_dir) as stage:
            manifest = build(stage, work)
            atomic_write_json(stage / MANIFEST, manifest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"onnxruntime: wrote {out_dir / MODEL_FILE} ({manifest['size_bytes'] / 2**20:.1f} MiB)")
    return ExportResult(artifact=out_dir / MODEL_FILE,
                        files=[out_dir / name for name in manifest["files"]] + [out_dir / MANIFEST],
                        manifest=manifest,
                        details={"quantization": manifest["quantization"], "smoke": manifest["smoke_check"],
                                 "external_data": manifest["external_data"], "toolchain": manifest["toolchain"]})
