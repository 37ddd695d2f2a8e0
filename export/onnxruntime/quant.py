"""INT8 for ONNX Runtime: which nodes to quantize, and ORT's dynamic / static (QDQ) quantizers.

Quantization is a target-side option of the ONNX exporter, not an eager stage: ORT's quantizer
works on the exported graph, so it sees exactly the MatMuls ORT will run. By default only the
*weight* MatMuls (a constant B input: q/k/v/o and MLP projections) are quantized. Attention
MatMuls (Q@K^T, P@V) have two activation inputs and the embedding is a Gather; quantizing them
is what ORTQuantizer's defaults do and most of its accuracy loss (see shared notes).
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from export.onnxruntime.int8_format import u8u8_arrays


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {out: node for node in graph.node for out in node.output}


def lm_head_node(graph: onnx.GraphProto, logits: str = "logits") -> onnx.NodeProto | None:
    """The MatMul/Gemm that produces ``logits`` (walking back through reshapes and casts)."""
    prod = _producers(graph)
    name, seen = logits, 0
    while name in prod and seen < 16:
        node = prod[name]
        if node.op_type in ("MatMul", "Gemm"):
            return node
        name, seen = node.input[0], seen + 1
    return None


def weight_matmuls(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """MatMuls whose B input is an initializer: the Linear layers, never attention."""
    inits = {i.name for i in graph.initializer}
    consts = {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    return [n for n in graph.node if n.op_type == "MatMul" and (n.input[1] in inits or n.input[1] in consts)]


def untie_lm_head(model: onnx.ModelProto) -> bool:
    """Give a tied lm_head (``MatMul(x, Transpose(embedding))``) its own transposed initializer.

    The quantizer only quantizes a MatMul with a constant B; after this the lm_head has one, and
    the embedding Gather keeps the fp32 table. Returns whether anything changed.
    """
    g = model.graph
    head = lm_head_node(g)
    if head is None or head.op_type != "MatMul":
        return False
    prod = _producers(g)
    tr = prod.get(head.input[1])
    inits = {i.name: i for i in g.initializer}
    if tr is None or tr.op_type != "Transpose" or tr.input[0] not in inits:
        return False
    w = numpy_helper.to_array(inits[tr.input[0]])
    perm = [a.ints for a in tr.attribute if a.name == "perm"]
    wt = np.ascontiguousarray(np.transpose(w, list(perm[0]) if perm else None))
    name = tr.input[0] + ".lm_head_T"
    g.initializer.append(numpy_helper.from_array(wt, name))
    head.input[1] = name
    if not any(tr.output[0] in n.input for n in g.node):
        g.node.remove(tr)
    return True


def _replace_node(g: onnx.GraphProto, node: onnx.NodeProto, new: list[onnx.NodeProto],
                  weight: onnx.TensorProto) -> None:
    """Put ``new`` where ``node`` stood (keeping topological order); drop ``weight`` if nothing reads it now."""
    idx = list(g.node).index(node)
    g.node.remove(node)
    for k, n in enumerate(new):
        g.node.insert(idx + k, n)
    if not any(weight.name in n.input for n in g.node):
        g.initializer.remove(weight)


def quantize_embedding_rows(model: onnx.ModelProto, input_name: str = "input_ids") -> str | None:
    """Store the token-embedding table as int8 with one fp32 scale per row (symmetric).

    ORT's quantizer has no per-row int8 Gather (its Gather quantization is per-tensor, which is
    what hurts accuracy), so the table is rewritten as ``Gather(int8) * Gather(scale)``: the
    lookup dequantizes only the rows it reads. Returns the rewritten node's name or None.
    """
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    node = next((n for n in g.node if n.op_type == "Gather" and n.input[1] == input_name and n.input[0] in inits), None)
    if node is None:
        return None
    table = numpy_helper.to_array(inits[node.input[0]]).astype(np.float32)
    scale = np.maximum(np.abs(table).max(axis=1, keepdims=True), 1e-12) / 127.0
    q = np.clip(np.rint(table / scale), -127, 127).astype(np.int8)
    base = node.input[0] + ".int8"
    g.initializer.extend([numpy_helper.from_array(q, base), numpy_helper.from_array(scale.astype(np.float32), base + ".scale")])
    out = node.output[0]
    new = [
        onnx.helper.make_node("Gather", [base, input_name], [out + ".q"], name=node.name + "_q", axis=0),
        onnx.helper.make_node("Gather", [base + ".scale", input_name], [out + ".s"], name=node.name + "_s", axis=0),
        onnx.helper.make_node("Cast", [out + ".q"], [out + ".f"], name=node.name + "_cast", to=onnx.TensorProto.FLOAT),
        onnx.helper.make_node("Mul", [out + ".f", out + ".s"], [out], name=node.name + "_dq"),
    ]
    # The fp32 table may still feed a tied lm_head; it is dropped only when nothing reads it.
    _replace_node(g, node, new, inits[node.input[0]])
    return node.name


def module_path(node: onnx.NodeProto) -> str:
    """The HF module a node came from (``model.layers.3.mlp.down_proj``), read from the name
    scopes torch.onnx's dynamo exporter records; "" when the graph has none."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = json.loads(prop.value.replace("'", '"'))
            except ValueError:
                return ""
            mods = [sc for sc in scopes if sc.startswith("model.")]
            return mods[-1][len("model."):] if mods else ""
    return ""


def select_nodes(model: onnx.ModelProto, *, quantize_lm_head: bool, extra_exclude: Sequence[str],
                 exclude_modules: Sequence[str] = ()) -> tuple[list[str], list[str]]:
    """(MatMuls to quantize, every other MatMul) for ``nodes_to_exclude``. ``extra_exclude``
    are node names; ``exclude_modules`` are fnmatch patterns over HF module paths."""
    g = model.graph
    weights = {n.name for n in weight_matmuls(g)
               if not any(fnmatch.fnmatchcase(module_path(n), pat) for pat in exclude_modules)}
    head = lm_head_node(g)
    if head is not None and not quantize_lm_head:
        weights.discard(head.name)
    weights -= set(extra_exclude)
    all_mm = [n.name for n in g.node if n.op_type == "MatMul"]
    return sorted(weights), sorted(set(all_mm) - weights | set(extra_exclude))


def _unique(graph: onnx.GraphProto, base: str) -> str:
    taken = {o for n in graph.node for o in n.output} | {i.name for i in graph.initializer} | {i.name for i in graph.input}
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    return name


def integer_weight(g: onnx.GraphProto, w_q: np.ndarray, base: str, unsigned: bool) -> list[str]:
    """Add the int8 weight ``w_q`` [K, N] as an initializer; returns MatMulInteger's inputs after A:
    ``[B]`` (int8, u8s8) or ``[B, "", b_zero_point]`` (uint8 = int8 + 128, zero point 128 per
    column, u8u8): either way ``(B - b_zero_point)`` is ``w_q``."""
    if not unsigned:
        g.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w_q, dtype=np.int8), base + ".w_int8"))
        return [base + ".w_int8"]
    w_u8, zp = u8u8_arrays(w_q)
    g.initializer.extend([numpy_helper.from_array(w_u8, base + ".w_uint8"),
                          numpy_helper.from_array(zp, base + ".w_zero_point")])
    return [base + ".w_uint8", "", base + ".w_zero_point"]


def quantize_per_token(model: onnx.ModelProto, node_names: Sequence[str], *, unsigned: bool = False) -> int:
    """Rewrite weight MatMuls as W8A8 with one activation scale and zero point per *token* (row),
    the arithmetic of XNNPACK's 8da8w and torchao's ``int8_asym_per_token``.

    ORT's dynamic quantizer (``DynamicQuantizeLinear``) takes one scale for the whole activation
    tensor, so in a 512-token prefill the largest token (the attention-sink outliers of the first
    positions) sets the step for every row; that is most of its accuracy loss. ORT's
    ``MatMulInteger`` accepts only a scalar activation zero point, so the per-row zero point is
    applied after the integer product, through the weight's column sums:

        s = (max(x_row, 0) - min(x_row, 0)) / 255;  z = round(-min(x_row, 0) / s)
        x_q = clip(round(x / s) + z, 0, 255)                 (uint8)
        y = s * s_col * (MatMulInteger(x_q, W_q) - z * colsum(W_q))

    with ``W_q`` int8 symmetric per output column (``s_col = max|W_col| / 127``). Every op is a
    standard ONNX op (opset >= 18). ``unsigned`` stores ``W_q + 128`` as uint8 with weight zero
    point 128 (u8u8: the same products, no saturation on x86 without VNNI). Returns the number of
    MatMuls rewritten.
    """
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    by_name = {n.name: n for n in g.node}
    c = _unique(g, "per_token")
    consts = {"axes": np.array([-1], dtype=np.int64), "zero": np.array(0.0, dtype=np.float32),
              "qmax": np.array(255.0, dtype=np.float32), "eps": np.array(1e-12, dtype=np.float32)}
    g.initializer.extend([numpy_helper.from_array(v, f"{c}.{k}") for k, v in consts.items()])
    count = 0
    for name in node_names:
        node = by_name.get(name)
        if node is None or node.op_type != "MatMul" or node.input[1] not in inits:
            raise ValueError(f"per-token quantization: {name!r} is not a MatMul with a constant weight")
        w = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)  # [K, N]
        if w.ndim != 2:
            raise ValueError(f"per-token quantization: {name!r} has a {w.ndim}-D weight")
        s_col = np.maximum(np.abs(w).max(axis=0), 1e-12) / 127.0
        w_q = np.clip(np.rint(w / s_col), -127, 127).astype(np.int8)
        base = _unique(g, node.name or node.output[0])
        g.initializer.extend([numpy_helper.from_array(s_col.astype(np.float32), base + ".w_scale"),
                              numpy_helper.from_array(w_q.astype(np.float32).sum(axis=0), base + ".w_colsum")])
        mmi_inputs = integer_weight(g, w_q, base, unsigned)
        x, y = node.input[0], node.output[0]
        t = lambda k: f"{base}.{k}"  # noqa: E731
        mk = onnx.helper.make_node
        new = [
            mk("ReduceMax", [x, f"{c}.axes"], [t("mx0")], name=t("mx0"), keepdims=1),
            mk("ReduceMin", [x, f"{c}.axes"], [t("mn0")], name=t("mn0"), keepdims=1),
            mk("Max", [t("mx0"), f"{c}.zero"], [t("mx")], name=t("mx")),
            mk("Min", [t("mn0"), f"{c}.zero"], [t("mn")], name=t("mn")),
            mk("Sub", [t("mx"), t("mn")], [t("rng")], name=t("rng")),
            mk("Div", [t("rng"), f"{c}.qmax"], [t("s0")], name=t("s0")),
            mk("Max", [t("s0"), f"{c}.eps"], [t("s")], name=t("s")),
            mk("Div", [t("mn"), t("s")], [t("mns")], name=t("mns")),
            mk("Neg", [t("mns")], [t("zn")], name=t("zn")),
            mk("Round", [t("zn")], [t("z")], name=t("z")),
            mk("Div", [x, t("s")], [t("xs")], name=t("xs")),
            mk("Round", [t("xs")], [t("xr")], name=t("xr")),
            mk("Add", [t("xr"), t("z")], [t("xz")], name=t("xz")),
            mk("Clip", [t("xz"), f"{c}.zero", f"{c}.qmax"], [t("xc")], name=t("xc")),
            mk("Cast", [t("xc")], [t("xq")], name=t("xq"), to=onnx.TensorProto.UINT8),
            mk("MatMulInteger", [t("xq"), *mmi_inputs], [t("acc")], name=t("mmi")),
            mk("Cast", [t("acc")], [t("accf")], name=t("accf"), to=onnx.TensorProto.FLOAT),
            mk("Mul", [t("z"), base + ".w_colsum"], [t("zc")], name=t("zc")),
            mk("Sub", [t("accf"), t("zc")], [t("acc0")], name=t("acc0")),
            mk("Mul", [t("acc0"), t("s")], [t("rows")], name=t("rows")),
            mk("Mul", [t("rows"), base + ".w_scale"], [y], name=t("cols")),
        ]
        _replace_node(g, node, new, inits[node.input[1]])
        count += 1
    return count


class WindowReader:
    """A ``CalibrationDataReader`` over real-text token windows, each as a full prefill with an
    empty past: the KV-cache graph then sees the same activations as a normal forward, and the
    decode path uses the same quantized weights and activation ranges."""

    def __init__(self, windows: Sequence[torch.Tensor], past_specs: dict[str, tuple[int, int]]):
        self._windows = [torch.as_tensor(w, dtype=torch.long).reshape(-1) for w in windows]
        self._past = past_specs  # name -> (kv_heads, head_dim)
        self._it: Iterator[dict[str, np.ndarray]] | None = None

    def _feeds(self) -> Iterator[dict[str, np.ndarray]]:
        for w in self._windows:
            t = int(w.numel())
            feeds = {
                "input_ids": w.numpy().reshape(1, t).astype(np.int64),
                "attention_mask": np.ones((1, t), dtype=np.int64),
                "position_ids": np.arange(t, dtype=np.int64).reshape(1, t),
            }
            for name, (h, d) in self._past.items():
                feeds[name] = np.zeros((1, h, 0, d), dtype=np.float32)
            yield feeds

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._it is None:
            self._it = self._feeds()
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = None

    def __len__(self) -> int:
        return len(self._windows)


def quantize(
    src: Path,
    dst: Path,
    *,
    mode: str,
    per_channel: bool,
    reduce_range: bool,
    calibrate_method: str,
    quantize_lm_head: bool,
    quantize_embedding: bool,
    nodes_to_exclude: Sequence[str],
    exclude_modules: Sequence[str] = (),
    calibration: Sequence[torch.Tensor],
    past_specs: dict[str, tuple[int, int]],
    external_data: bool,
    work_dir: Path,
    int8_format: str = "u8s8",
) -> dict[str, Any]:
    """Quantize the fp32 graph at ``src`` into ``dst`` with ORT's quantizer; returns details.
    ``int8_format`` u8u8 stores the weights uint8 (:mod:`export.onnxruntime.int8_format`)."""
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    model = onnx.load(str(src))
    untied = untie_lm_head(model) if quantize_lm_head else False
    emb = quantize_embedding_rows(model) if quantize_embedding else None
    include, exclude = select_nodes(model, quantize_lm_head=quantize_lm_head, extra_exclude=nodes_to_exclude,
                                      exclude_modules=exclude_modules)
    unsigned = int8_format == "u8u8"
    weight_type = QuantType.QUInt8 if unsigned else QuantType.QInt8
    prepped = work_dir / "prepped.onnx"
    onnx.save(model, str(prepped), save_as_external_data=True, all_tensors_to_one_file=True,
              location=prepped.name + ".data", size_threshold=1024)
    del model
    if not include:
        raise ValueError("no weight MatMul left to quantize (check nodes_to_exclude)")
    common = dict(
        nodes_to_quantize=include,
        per_channel=per_channel,
        reduce_range=reduce_range,
        op_types_to_quantize=["MatMul"],
        nodes_to_exclude=exclude,
        use_external_data_format=external_data,
        extra_options={"MatMulConstBOnly": True, **({"WeightSymmetric": True} if unsigned else {})},
    )
    if mode == "dynamic_per_token":
        rewritten = onnx.load(str(prepped))
        quantize_per_token(rewritten, include, unsigned=int8_format == "u8u8")
        onnx.save(rewritten, str(dst), save_as_external_data=external_data, all_tensors_to_one_file=True,
                  location=dst.name + ".data", size_threshold=1024)
    elif mode == "dynamic":
        quantize_dynamic(prepped, dst, weight_type=weight_type, **common)
    else:
        methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                   "percentile": CalibrationMethod.Percentile}
        quantize_static(
            prepped,
            dst,
            WindowReader(calibration, past_specs),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt8,
            weight_type=weight_type,
            calibrate_method=methods[calibrate_method],
            calibration_providers=["CPUExecutionProvider"],
            **common,
        )
    return {
        "mode": mode,
        "activations": {"dynamic": "uint8 per tensor, scale at run time", "static": "uint8 per tensor, calibrated",
                        "dynamic_per_token": "uint8 per token (asymmetric, as XNNPACK 8da8w), scale at run time"}[mode],
        "per_channel": per_channel,
        "reduce_range": reduce_range,
        "calibrate_method": calibrate_method if mode == "static" else None,
        "calibration_windows": len(calibration) if mode == "static" else 0,
        "calibration_tokens": int(sum(int(w.numel()) for w in calibration)) if mode == "static" else 0,
        "quantized_matmuls": len(include),
        "fp32_matmuls": len(exclude),
        "excluded_modules": list(exclude_modules),
        "lm_head": "int8" if (quantize_lm_head and (untied or include)) else "fp32",
        "embedding": "int8 per-row" if emb else "fp32",
    }
