"""ONNX Runtime: an ONNX graph with a KV cache (and, for the families onnxruntime-genai's builder
knows, its fused GQA / MatMulNBits graph), verified in ONNX Runtime and onnxruntime-genai.

The exporter is :class:`OnnxRuntimeExporter` (``exporter.py``). Where things live: the
``torch.onnx`` dynamo export and ORT quantization in ``dynamo.py`` and ``quant.py``; the fused
genai path in ``fused_export.py``, planned in ``plan.py``, its weights in ``weights.py``, its
graph rewrites in ``fused.py`` and ``decode_branch.py``, the builder in ``genai_builder.py``;
the shipped directory in ``package.py``; runners in ``runner.py`` (ONNX Runtime) and
``genai_runner.py`` (onnxruntime-genai). Other packages use the names below.
"""

from export.lazy import lazy_names

__all__ = ["FUSED_MODEL_TYPES", "GenaiRunner", "OnnxRuntimeExporter", "OnnxRuntimeOptions", "OnnxRuntimeRunner",
           "check_onnx", "onnx_files"]

__getattr__, __dir__ = lazy_names(__name__, {
    "OnnxRuntimeExporter": "exporter", "OnnxRuntimeOptions": "exporter", "FUSED_MODEL_TYPES": "exporter",
    "OnnxRuntimeRunner": "runner", "onnx_files": "runner",
    "GenaiRunner": "genai_runner",
    "check_onnx": "package",
})
