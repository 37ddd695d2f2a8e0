"""The fused ONNX Runtime graph: onnxruntime-genai's builder graph carrying the weights our
stages chose.

Route: the eager model (fp32, or with torchao quantized Linears) is written to a temporary HF
folder with every quantized weight *dequantized* (``q * scale``, exact in fp32), the builder
turns it into its fused fp32 graph, then each ``MatMul`` whose weight came from a quantized
Linear is replaced by a kernel fed the stage's own integers and scales:

- ``MatMulNBits`` (4 or 8 bits, block-wise, ``accuracy_level`` 4 = int8 activations);
- or, for per-channel int8 weights, ``MatMulInteger`` behind per-token activation
  quantization (the 8da8w arithmetic: one asymmetric uint8 scale per token).

Before a weight is replaced, the builder's fp32 initializer must equal our dequantized
integers bit for bit: that proves the node-to-module mapping (packed QKV, Phi-3's fused
projections) and that nothing was re-rounded on the way. The embedding becomes
``GatherBlockQuantized`` when it is quantized, sharing the lm_head's packed weights when the
model ties them.

Why not the builder's own GPTQ/AWQ loader: it round-trips the integers through fp16
dequantize/requantize, reads neither fp32 Linears inside a quantized block nor a quantized
embedding, and hands the checkpoint's group size straight to MatMulNBits (power-of-two blocks
only, so a per-channel int8 scale has no form there); installing the integers ourselves has
none of those limits and is checked exactly.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from export.base import ExportError
from export.onnxruntime.int8_format import u8u8_arrays
from export.onnxruntime.decode_branch import Chain, add_decode_branch, all_nodes
from export.onnxruntime.last_logits import split_head
from export.onnxruntime.verify_rows import ROW_EXACT_BLOCK, add_verify_rows
from export.onnxruntime.plan import FusedPlan, LinearPlan, _kind, _linears, plan_model, write_hf_dir  # noqa: F401
from export.onnxruntime.weights import BlockQuant, cat_rows, int8_columns, nbits_arrays, rtn_int8_rows

__all__ = ["FusedPlan", "LinearPlan", "install", "op_counts", "plan_model", "write_hf_dir"]

LAYER_MATMUL = re.compile(r"/model/layers\.(\d+)/(attn|mlp)/(\w+)/MatMul$")
LM_HEAD_NODE = "/lm_head/MatMul"
EMBED_NODE = "/model/embed_tokens/Gather"
MS = "com.microsoft"

# ---------------------------------------------------------------------------------- graph rewrite


def _pieces(node: str, modules: set[str], config, lm_head: str | None) -> list[tuple[str, slice | None]]:
    """The HF Linear rows a builder MatMul computes: (module, row slice or None for all)."""
    if node == LM_HEAD_NODE:
        return [(lm_head, None)] if lm_head else []
    m = LAYER_MATMUL.match(node)
    if not m:
        return []
    i, part, proj = m.groups()
    pre = f"model.layers.{i}." + ("self_attn." if part == "attn" else "mlp.")
    heads = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or config.hidden_size // heads
    q, kv = heads * hd, config.num_key_value_heads * hd
    inter = getattr(config, "intermediate_size", None)
    direct = pre + proj
    if direct in modules:
        return [(direct, None)]
    if proj == "qkv_proj" and all(pre + p in modules for p in ("q_proj", "k_proj", "v_proj")):
        return [(pre + p, None) for p in ("q_proj", "k_proj", "v_proj")]
    if proj in ("q_proj", "k_proj", "v_proj") and pre + "qkv_proj" in modules:
        start = {"q_proj": 0, "k_proj": q, "v_proj": q + kv}[proj]
        return [(pre + "qkv_proj", slice(start, start + (q if proj == "q_proj" else kv)))]
    if proj in ("gate_proj", "up_proj") and pre + "gate_up_proj" in modules and inter:
        return [(pre + "gate_up_proj", slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter))]
    if proj == "gate_up_proj" and all(pre + p in modules for p in ("gate_proj", "up_proj")):
        return [(pre + "gate_proj", None), (pre + "up_proj", None)]
    raise ExportError(f"onnxruntime exporter: builder node {node} maps to no Linear of the model (looked for {direct})")


class _Graph:
    """Mutable view of a model proto: initializers by name, unique names, node replacement."""

    def __init__(self, model: onnx.ModelProto, base: Path):
        self.model, self.g, self.base = model, model.graph, base
        self.inits = {i.name: i for i in self.g.initializer}
        self.chains: list[Chain] = []

    def array(self, name: str) -> np.ndarray:
        return numpy_helper.to_array(self.inits[name], str(self.base))

    def add(self, arr: np.ndarray, name: str) -> str:
        t = numpy_helper.from_array(np.ascontiguousarray(arr), name)
        self.g.initializer.append(t)
        self.inits[name] = t
        return name

    def replace(self, node: onnx.NodeProto, new: list[onnx.NodeProto]) -> None:
        idx = list(self.g.node).index(node)
        self.g.node.remove(node)
        for k, n in enumerate(new):
            self.g.node.insert(idx + k, n)

    def prune(self) -> None:
        """Drop nodes whose outputs nobody reads (a tied Transpose) and unread initializers."""
        outputs = {o.name for o in self.g.output}
        while True:
            used = {i for n in self.g.node for i in n.input} | outputs
            for n in self.g.node:
                for a in n.attribute:
                    if a.type == onnx.AttributeProto.GRAPH:
                        used |= {i for sn in a.g.node for i in sn.input}
            dead = [n for n in self.g.node if n.output and not any(o in used for o in n.output if o)]
            if not dead:
                break
            for n in dead:
                self.g.node.remove(n)
        used = {i for n in self.g.node for i in n.input}
        for t in [t for t in self.g.initializer if t.name not in used]:
            self.g.initializer.remove(t)
            self.inits.pop(t.name, None)


def _nbits_nodes(gr: _Graph, node: onnx.NodeProto, bq: BlockQuant, acc: int, prefix: str,
                 exact_rows: bool = False) -> list[onnx.NodeProto]:
    packed, scales, zp, block = nbits_arrays(bq, max_block=ROW_EXACT_BLOCK[bq.bits] if exact_rows else None)
    n, k = bq.shape
    inputs = [node.input[0], gr.add(packed, prefix + ".qweight"), gr.add(scales, prefix + ".scales")]
    if zp is not None:
        inputs.append(gr.add(zp, prefix + ".qzeros"))
    return [helper.make_node("MatMulNBits", inputs, [node.output[0]], name=node.name + "NBits", domain=MS,
                             K=k, N=n, bits=bq.bits, block_size=block, accuracy_level=acc)]


def _offset_rows(plan: FusedPlan, pieces: list, bq: BlockQuant) -> torch.Tensor | None:
    """The per-group offsets of the MatMul's rows (a kept source grid), zero rows for pieces
    without one; None when no piece has an offset path."""
    parts = [(plan.linears[mod].offset, plan.linears[mod].bq, sl) for mod, sl in pieces]
    if all(o is None for o, _, _ in parts):
        return None
    groups = next(o for o, _, _ in parts if o is not None).shape[1]
    rows = []
    for o, pbq, sl in parts:
        o = torch.zeros(pbq.shape[0], groups) if o is None else o
        rows.append(o if sl is None else o[sl])
    return torch.cat(rows)


def _with_offset(gr: _Graph, node: onnx.NodeProto, nodes: list[onnx.NodeProto], offset: torch.Tensor,
                 prefix: str) -> list[onnx.NodeProto]:
    """``nodes`` (the quantized MatMul) plus a kept source grid's offset path: the sum of each
    group of input columns times the group's offset, added to the MatMul's output."""
    n, groups = offset.shape
    x, y = node.input[0], node.output[0]
    t = lambda s: f"{node.name}/offset/{s}"  # noqa: E731
    shape = gr.add(np.array([0, 0, groups, -1], np.int64), prefix + ".offset_shape")
    axes = gr.add(np.array([-1], np.int64), prefix + ".offset_axes")
    r = gr.add(np.ascontiguousarray(offset.numpy().T, dtype=np.float32), prefix + ".offset")
    main = nodes[-1]
    main.output[0] = t("main")
    mk = helper.make_node
    return nodes + [
        mk("Reshape", [x, shape], [t("grouped")], name=t("grouped")),
        mk("ReduceSum", [t("grouped"), axes], [t("sums")], name=t("sums"), keepdims=0),
        mk("MatMul", [t("sums"), r], [t("out")], name=t("matmul")),
        mk("Add", [t("main"), t("out")], [y], name=t("add")),
    ]


def _per_token_consts(gr: _Graph) -> dict[str, str]:
    names = {"axes": np.array([-1], np.int64), "zero": np.array(0.0, np.float32), "qmax": np.array(255.0, np.float32),
             "eps": np.array(1e-12, np.float32)}
    out = {}
    for k, v in names.items():
        name = f"per_token.{k}"
        out[k] = name if name in gr.inits else gr.add(v, name)
    return out


def _per_token_nodes(gr: _Graph, node: onnx.NodeProto, bq: BlockQuant, prefix: str,
                     unsigned: bool = False) -> list[onnx.NodeProto]:
    """W8A8 with one asymmetric uint8 scale per token (the 8da8w arithmetic), as standard ops:

        s = (max(x_row, 0) - min(x_row, 0)) / 255;  z = round(-min(x_row, 0) / s)
        x_q = QuantizeLinear(x, s, z)                       (one block = one row, opset 21)
        y = float(MatMulInteger(x_q, W_q) - z * colsum(W_q)) * (s * s_col)

    ``MatMulInteger`` takes only a scalar activation zero point, so the per-row zero point is
    applied after the integer product through the weight's column sums, in int32 (exact). The
    float tail is ``DynamicQuantizeMatMul``'s own arithmetic, the integer sum times the product of
    the two scales: so a row of a several-token call gives the bits a one-token call's fused kernel
    gives (the decode branch), which speculative decoding's verification needs
    (:mod:`export.onnxruntime.verify_rows`). ``unsigned`` (u8u8, see
    :mod:`export.onnxruntime.int8_format`) stores ``W_q + 128`` as uint8 with zero point 128."""
    wq, ws = int8_columns(bq)
    c = _per_token_consts(gr)
    if unsigned:
        w_u8, zp = u8u8_arrays(wq)
        w, wz = gr.add(w_u8, prefix + ".w_uint8"), gr.add(zp, prefix + ".w_zero_point")
    else:
        w, wz = gr.add(wq, prefix + ".w_int8"), None
    s_col = gr.add(ws, prefix + ".w_scale")
    colsum = gr.add(wq.astype(np.int64).sum(axis=0).astype(np.int32), prefix + ".w_colsum")
    x, y, k = node.input[0], node.output[0], bq.shape[1]
    t = lambda s: f"{node.name}/pt/{s}"  # noqa: E731
    mk = helper.make_node
    nodes = [
        mk("ReduceMax", [x, c["axes"]], [t("mx0")], name=t("mx0"), keepdims=1),
        mk("ReduceMin", [x, c["axes"]], [t("mn0")], name=t("mn0"), keepdims=1),
        mk("Max", [t("mx0"), c["zero"]], [t("mx")], name=t("mx")),
        mk("Min", [t("mn0"), c["zero"]], [t("mn")], name=t("mn")),
        mk("Sub", [t("mx"), t("mn")], [t("rng")], name=t("rng")),
        mk("Div", [t("rng"), c["qmax"]], [t("s0")], name=t("s0")),
        mk("Max", [t("s0"), c["eps"]], [t("s")], name=t("s")),
        mk("Div", [t("mn"), t("s")], [t("mns")], name=t("mns")),
        mk("Neg", [t("mns")], [t("zn")], name=t("zn")),
        mk("Round", [t("zn")], [t("z")], name=t("z")),
        mk("Cast", [t("z")], [t("zu8")], name=t("zu8"), to=TensorProto.UINT8),
        mk("QuantizeLinear", [x, t("s"), t("zu8")], [t("xq")], name=t("xq"), axis=-1, block_size=k),
        mk("MatMulInteger", [t("xq"), w] + (["", wz] if wz else []), [t("acc")], name=node.name + "Integer"),
        mk("Cast", [t("zu8")], [t("zi")], name=t("zi"), to=TensorProto.INT32),
        mk("Mul", [t("zi"), colsum], [t("zc")], name=t("zc")),
        mk("Sub", [t("acc"), t("zc")], [t("acc0")], name=t("acc0")),
        mk("Cast", [t("acc0")], [t("accf")], name=t("accf"), to=TensorProto.FLOAT),
        mk("Mul", [t("s"), s_col], [t("scales")], name=t("scales")),
        mk("Mul", [t("accf"), t("scales")], [y], name=t("cols")),
    ]
    gr.chains.append(Chain(x, y, w, s_col, frozenset(n.name for n in nodes), wz))
    return nodes


def install(src: Path, dst: Path, model: torch.nn.Module, plan: FusedPlan, log: Callable[[str], None], *,
            decode_branch: bool = True, int8_format: dict | None = None, last_logits: bool = True,
            verify_rows: int = 0) -> dict:
    """Rewrite the builder's fp32 graph at ``src`` into ``dst`` (``model.onnx`` + ``.data``)
    with the planned kernels; returns what was installed (for the manifest). ``decode_branch``:
    per-token Linears run as one DynamicQuantizeMatMul each when one token is fed
    (:mod:`export.onnxruntime.decode_branch`). ``int8_format``: the resolved
    :func:`export.onnxruntime.int8_format.resolve_int8_format` for the per-token Linears
    (default u8s8). ``last_logits``: ``logits`` is the last position's and ``all_logits`` every
    position's on request (:mod:`export.onnxruntime.last_logits`). ``verify_rows``: the most tokens
    a verification call takes (0: none), calls that give one-token calls' logits bit for bit on request
    (:mod:`export.onnxruntime.verify_rows`; MatMulNBits blocks capped to the sizes whose kernels are
    row-exact)."""
    int8_format = int8_format or {"format": "u8s8", "why": "default"}
    unsigned = int8_format["format"] == "u8u8"
    proto = onnx.load(str(src), load_external_data=False)
    gr = _Graph(proto, src.parent)
    modules = set(_linears(model))
    hidden = next((n.input[0] for n in gr.g.node if n.name == LM_HEAD_NODE), None)
    installed: Counter = Counter()
    seen: set[str] = set()
    for node in [n for n in gr.g.node if n.op_type == "MatMul"]:
        pieces = _pieces(node.name, modules, model.config, plan.lm_head)
        plans = [plan.linears.get(mod) for mod, _ in pieces]
        if not pieces or all(p is None for p in plans):
            continue
        if any(p is None for p in plans) or len({_kind(p) for p in plans}) > 1:
            raise ExportError(f"onnxruntime exporter: {node.name} packs Linears with different quantization "
                              f"({[m for m, _ in pieces]}); this should have unpacked them (fuse_qkv)")
        seen.update(mod for mod, _ in pieces)
        weight = gr.array(node.input[1])  # [K, N] fp32, as the builder wrote it
        p0 = plans[0]
        if p0.bq is None:
            bq = rtn_int8_rows(torch.from_numpy(weight.T.copy()))
        else:
            bq = cat_rows([plan.linears[mod].bq if sl is None else plan.linears[mod].bq.rows(sl.start, sl.stop)
                           for mod, sl in pieces])
            offset = _offset_rows(plan, pieces, bq)
            full = bq.dequantize() if offset is None else bq.dequantize() + offset.repeat_interleave(
                bq.shape[1] // offset.shape[1], dim=1)
            if not np.array_equal(weight, full.numpy().T):
                raise ExportError(f"onnxruntime exporter: the builder's weight for {node.name} is not the dequantized "
                                  f"integers of {[m for m, _ in pieces]}; refusing to install them")
        prefix = node.name[1:].replace("/", ".")
        try:
            new = (_nbits_nodes(gr, node, bq, p0.accuracy_level, prefix, exact_rows=verify_rows) if p0.kernel == "nbits"
                   else _per_token_nodes(gr, node, bq, prefix, unsigned))
        except ValueError as exc:  # a layout ORT has no kernel for (e.g. a group size not a multiple of 16)
            raise ExportError(f"onnxruntime exporter: {[m for m, _ in pieces]}: {exc}") from None
        if p0.bq is not None and offset is not None:
            if p0.kernel != "nbits":
                raise ExportError(f"onnxruntime exporter: {node.name}: an offset path needs the nbits kernel")
            new = _with_offset(gr, node, new, offset, prefix)
            installed["offset paths"] += 1
        gr.replace(node, new)
        installed[f"int{bq.bits} {p0.kernel}"] += 1
    missing = sorted(set(plan.linears) - seen)
    if missing:
        raise ExportError(f"onnxruntime exporter: {len(missing)} quantized Linear(s) have no MatMul in the fused graph "
                          f"(e.g. {missing[0]}); their quantization would be lost")
    try:
        emb = _install_embedding(gr, plan)
    except ValueError as exc:
        raise ExportError(f"onnxruntime exporter: input embedding: {exc}") from None
    gr.prune()
    head = split_head(proto, hidden, gr.chains) if last_logits and hidden else None
    branched = add_decode_branch(proto, gr.chains) if decode_branch else 0
    verified = add_verify_rows(proto, verify_rows) if verify_rows else 0
    if verify_rows and not verified:
        raise ExportError("onnxruntime exporter: verify_tokens needs the fused graph's GroupQueryAttention; this graph "
                          "has none")
    onnx.external_data_helper.load_external_data_for_model(proto, str(src.parent))
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
              location=dst.name + ".data", size_threshold=1024)
    log(f"onnxruntime: installed {dict(installed) or 'no quantized'} MatMul kernels; embedding {emb}"
        + (f"; decode branch fuses {branched} per-token Linears" if branched else ""))
    out = {"matmuls": dict(installed), "embedding": emb, "decode_branch_linears": branched, "head": head,
           "verify_rows_attention": verified}
    if gr.chains:  # int8 weights against uint8 activations: say which integer GEMM runs them
        out["int8_format"] = int8_format
    return out


def _install_embedding(gr: _Graph, plan: FusedPlan) -> str:
    node = next((n for n in gr.g.node if n.name == EMBED_NODE and n.op_type == "Gather"), None)
    if plan.embedding is None:
        return "fp32"
    if node is None:
        raise ExportError(f"onnxruntime exporter: the fused graph has no {EMBED_NODE} to quantize")
    ids, out = node.input[1], node.output[0]
    mk = helper.make_node
    if plan.embedding == "tied":
        head = next(n for n in gr.g.node if n.name == LM_HEAD_NODE + "NBits")
        attrs = {a.name: helper.get_attribute_value(a) for a in head.attribute}
        qweight = gr.inits[head.input[1]]
        v, kb, blob = (int(d) for d in qweight.dims)
        shape = gr.add(np.array([v, kb * blob], np.int64), "model.embed_tokens.shape")
        nodes = [mk("Reshape", [head.input[1], shape], [out + "/data"], name=EMBED_NODE + "/Reshape")]
        inputs = [out + "/data", ids, head.input[2]] + ([head.input[3]] if len(head.input) > 3 else [])
        nodes.append(mk("GatherBlockQuantized", inputs, [out], name=EMBED_NODE + "BlockQuantized", domain=MS,
                        bits=attrs["bits"], block_size=attrs["block_size"], gather_axis=0, quantize_axis=1))
        gr.replace(node, nodes)
        return f"int{attrs['bits']} shared with lm_head (GatherBlockQuantized)"
    bq = plan.embedding
    packed, scales, zp, block = nbits_arrays(bq)
    v = bq.shape[0]
    inputs = [gr.add(packed.reshape(v, -1), "model.embed_tokens.qweight"), ids, gr.add(scales, "model.embed_tokens.scales")]
    if zp is not None:
        inputs.append(gr.add(zp, "model.embed_tokens.qzeros"))
    gr.replace(node, [mk("GatherBlockQuantized", inputs, [out], name=EMBED_NODE + "BlockQuantized", domain=MS,
                         bits=bq.bits, block_size=block, gather_axis=0, quantize_axis=1)])
    return f"int{bq.bits} {'per row' if bq.group == bq.shape[1] else f'g{bq.group}'} (GatherBlockQuantized)"


def op_counts(path: Path, branch: str = "prefill") -> dict[str, int]:
    """Node count by op type (the report's view of how fused the graph is). A graph with a
    decode branch is counted along one path: ``prefill`` (else branch) or ``decode`` (then)."""
    proto = onnx.load(str(path), load_external_data=False)
    nodes = []
    for n in proto.graph.node:
        if n.op_type == "If" and n.name == "/decode_branch/If":
            attr = "then_branch" if branch == "decode" else "else_branch"
            nodes += list(all_nodes(next(a.g for a in n.attribute if a.name == attr)))
        else:
            nodes.append(n)
    return dict(Counter(n.op_type for n in nodes).most_common())
