"""ExecuTorch: a KV-cache ``.pte`` lowered to XNNPACK, verified by loading it in ExecuTorch's runtime.

The exporter is :class:`ExecuTorchExporter` (``exporter.py``) with its options in ``options.py``.
Where things live: quantization for XNNPACK in ``quant.py``; the decoder wrapper and ExecuTorch's
LLM ops (custom SDPA, KV cache) in ``llm.py``; graph rewrites that keep operators inside XNNPACK in
``delegable.py``, ``fusion.py``, ``head_layout.py``, ``joint_rope.py``, ``xnnpack_slices.py`` and
``xnnpack_boundaries.py``; reading a lowered program back in ``inspection.py``; the Python runner
in ``runner.py`` and ExecuTorch's C++ text runner in ``llm_runner.py``; MKL threading in
``blas_threads.py``. Other packages use the names below, not the submodules.
"""

from export.lazy import lazy_names

__all__ = ["ExecuTorchDecoder", "ExecuTorchExporter", "ExecuTorchOptions", "ExecuTorchRunner", "LLMRunnerUnavailable",
           "NativeLLMRunner", "apply_quantization", "exported_linear_schemes", "is_attention", "load_llama_custom_ops",
           "lower_to_pte", "plan_layers", "set_threads", "uses_llama_custom_ops"]

__getattr__, __dir__ = lazy_names(__name__, {
    "ExecuTorchExporter": "exporter", "lower_to_pte": "exporter",
    "ExecuTorchOptions": "options",
    "ExecuTorchRunner": "runner", "load_llama_custom_ops": "runner", "set_threads": "runner",
    "uses_llama_custom_ops": "runner",
    "ExecuTorchDecoder": "llm", "plan_layers": "llm",
    "LLMRunnerUnavailable": "llm_runner", "NativeLLMRunner": "llm_runner",
    "exported_linear_schemes": "quant", "apply_quantization": "quant", "is_attention": "quant",
})
