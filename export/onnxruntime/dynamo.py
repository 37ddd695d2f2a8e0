"""The ``graph: dynamo`` route: ``torch.onnx.export(dynamo=True)`` of the HF code behind a flat
KV-cache signature, and ORT's own INT8 quantizers on that graph (see :mod:`export.onnxruntime.quant`).

The wrapper rebuilds a ``DynamicCache`` from the past tensors, so the model's own HF code runs
unchanged and one graph serves prefill (empty past) and decode (past from the previous call).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from export.base import ExportError


class KVWrapper(torch.nn.Module):
    """Flat tensors in, flat tensors out: the signature ONNX consumers (and optimum) expect."""

    def __init__(self, model: torch.nn.Module, n_layers: int):
        super().__init__()
        self.model, self.n_layers = model, n_layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i in range(self.n_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True)
        present = []
        for layer in out.past_key_values.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def io_names(n_layers: int) -> tuple[list[str], list[str]]:
    kv = [(i, k) for i in range(n_layers) for k in ("key", "value")]
    return (["input_ids", "attention_mask", "position_ids"] + [f"past_key_values.{i}.{k}" for i, k in kv],
            ["logits"] + [f"present.{i}.{k}" for i, k in kv])


def torch_export(model: torch.nn.Module, layout: list[tuple[int, int]], path: Path, opset: int, external: bool,
                  optimize: bool = True) -> None:
    """Trace with dynamic batch, sequence and past axes; a real past (3 tokens) avoids 0/1
    specialization, and ORT accepts an empty past at run time for prefill."""
    from torch.export import Dim
    from transformers import DynamicCache

    n = len(layout)
    b, s, p, tot = Dim("batch"), Dim("seq"), Dim("past_seq"), Dim("total_seq")
    with torch.no_grad():
        pre = model(input_ids=torch.arange(6, dtype=torch.long).reshape(2, 3) + 1,
                    past_key_values=DynamicCache(config=model.config), use_cache=True).past_key_values
    past = [t.contiguous() for l in pre.layers for t in (l.keys, l.values)]
    ids = torch.arange(10, dtype=torch.long).reshape(2, 5) + 7
    args = (ids, torch.ones(2, 8, dtype=torch.long), torch.arange(3, 8).expand(2, 5).contiguous(), *past)
    shapes = {"input_ids": {0: b, 1: s}, "attention_mask": {0: b, 1: tot}, "position_ids": {0: b, 1: s},
              "past": tuple({0: b, 2: p} for _ in past)}
    names_in, names_out = io_names(n)
    with torch.no_grad():
        prog = torch.onnx.export(KVWrapper(model, n), args, dynamo=True, dynamic_shapes=shapes, opset_version=opset,
                                 input_names=names_in, output_names=names_out, optimize=optimize, verbose=False)
    prog.save(str(path), external_data=external)


def calibration_windows(opts, calibration: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if opts.quantize == "static" and not calibration:
        raise ExportError("quantize: static needs calibration windows (real text token ids); got none")
    return [torch.as_tensor(w, dtype=torch.long).reshape(-1) for w in calibration][: opts.calibration_windows]


def quantize_graph(src: Path, dst: Path, opts, calib, layout, external: bool, work: Path, log) -> dict:
    if opts.quantize == "none":
        return {"mode": "none"}
    from export.onnxruntime import quant as onnx_quant

    int8 = opts.resolved_int8_format()
    log(f"onnxruntime: quantizing ({opts.quantize}"
        + (f", {opts.calibrate_method} on {len(calib)} windows" if opts.quantize == "static" else "") + ")")
    specs = {f"past_key_values.{i}.{k}": layout[i] for i in range(len(layout)) for k in ("key", "value")}
    try:
        quant = onnx_quant.quantize(
            src, dst, mode=opts.quantize, per_channel=opts.per_channel, reduce_range=opts.reduce_range,
            calibrate_method=opts.calibrate_method, quantize_lm_head=opts.quantize_lm_head,
            quantize_embedding=opts.quantize_embedding, nodes_to_exclude=opts.nodes_to_exclude, exclude_modules=opts.exclude_modules, calibration=calib,
            past_specs=specs, external_data=external, work_dir=work, int8_format=int8["format"],
        )
    except Exception as exc:
        raise ExportError(f"ONNX Runtime {opts.quantize} quantization failed: {type(exc).__name__}: {exc}") from exc
    from export.onnxruntime.package import check_onnx

    check_onnx(dst)
    return {**quant, "int8_format": int8}


