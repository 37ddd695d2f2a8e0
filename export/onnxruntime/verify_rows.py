"""Verification calls in the fused ONNX graph: several tokens in one call, each row's logits those a
one-token call gives, bit for bit (speculative decoding's check of drafted tokens).

What differs between a T-token call and T one-token calls in ONNX Runtime (measured op by op on the
fused graph, ORT 1.31): only ``GroupQueryAttention``, which attends a block of query rows in another
summation order than one row (about 1e-7 in float32, a few percent of the logit scale once int8
activations round differently downstream). Everything else in the fused graph gives a row the same
bits whatever rows surround it: constant-weight ``MatMul``, ``MatMulNBits`` at accuracy level 4 with
blocks of at most 32 (4-bit) or 64 (8-bit) columns (larger blocks do not: the exporter caps them
when ``verify_tokens`` is set), the norms, rotary, ``GatherBlockQuantized``, and the W8A8 per-token
chain, whose arithmetic is ``DynamicQuantizeMatMul``'s (:func:`export.onnxruntime.fused._per_token_nodes`).

So each ``GroupQueryAttention`` becomes ``If(verify_rows)``: a ``Loop`` over the call's query rows, one
one-row ``GroupQueryAttention`` each at that row's own past length (what a one-token call runs),
carrying the cache; else the node as it was. ``verify_rows`` is an overridable initializer that
defaults to false (as ``return_all_logits`` is), so onnxruntime-genai and any runtime that feeds only
the builder's inputs run the graph they always ran; our runners feed true for verification calls
only. The row's past length comes from ``seqlens_k`` and ``total_sequence_length`` (the call's minus
the rows after it), so the same Loop serves a growing cache (ONNX Runtime) and onnxruntime-genai's
shared max-length buffer.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VERIFY = "verify_rows"
MS = "com.microsoft"
#: MatMulNBits (accuracy level 4) blocks whose kernels give a row the same bits in any call, by bits
ROW_EXACT_BLOCK = {4: 32, 8: 64}


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _rows(node: onnx.NodeProto, tag: str) -> onnx.GraphProto:
    """The then-branch: one-row GroupQueryAttention calls in a Loop over the query rows."""
    q, _, _, pk, pv, sk, tot, cos, sin = (list(node.input) + [""] * 9)[:9]
    out, prk, prv = node.output[:3]
    mk = helper.make_node
    b = lambda s: f"{tag}/row/{s}"  # noqa: E731
    c = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    body = helper.make_graph([
        mk("Unsqueeze", [b("i"), b("axis0")], [b("index")], name=b("Unsqueeze")),
        mk("Gather", [q, b("index")], [b("q")], axis=1, name=b("Gather")),  # [B, 1, hidden]
        # row i of S is a one-token call whose past is the call's minus the S - 1 - i rows after it
        mk("Sub", [f"{tag}/last", b("i")], [b("after64")], name=b("After")),
        mk("Cast", [b("after64")], [b("after")], to=TensorProto.INT32, name=b("CastAfter")),
        mk("Sub", [sk, b("after")], [b("seqlens_k")], name=b("SeqlensK")),
        mk("Sub", [tot, b("after")], [b("total")], name=b("Total")),
        mk("GroupQueryAttention", [b("q"), "", "", b("pk"), b("pv"), b("seqlens_k"), b("total"), cos, sin],
           [b("out"), b("pk_next"), b("pv_next")], name=b("GroupQueryAttention"), domain=MS, **_attrs(node)),
        mk("Identity", [b("cond")], [b("cond_next")], name=b("Identity")),
    ], f"{tag.strip('/').replace('/', '_')}_row",
        [helper.make_tensor_value_info(b("i"), TensorProto.INT64, []),
         helper.make_tensor_value_info(b("cond"), TensorProto.BOOL, []),
         helper.make_tensor_value_info(b("pk"), TensorProto.FLOAT, None),
         helper.make_tensor_value_info(b("pv"), TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info(b("cond_next"), TensorProto.BOOL, []),
         helper.make_tensor_value_info(b("pk_next"), TensorProto.FLOAT, None),
         helper.make_tensor_value_info(b("pv_next"), TensorProto.FLOAT, None),
         helper.make_tensor_value_info(b("out"), TensorProto.FLOAT, None)],
        [c(b("axis0"), [0])])
    t = lambda s: f"{tag}/{s}"  # noqa: E731
    return helper.make_graph([
        mk("Shape", [q], [t("S")], start=1, end=2, name=t("S")),
        mk("Squeeze", [t("S")], [t("trip")], name=t("trip")),
        mk("Sub", [t("trip"), t("one")], [t("last")], name=t("last")),
        mk("Loop", [t("trip"), "", pk, pv], [t("pk"), t("pv"), t("stacked")], name=t("Loop"), body=body),
        # the scan output stacks [S, B, 1, hidden]; the node's output is [B, S, hidden]
        mk("Squeeze", [t("stacked"), t("axis2")], [t("squeezed")], name=t("Squeeze")),
        mk("Transpose", [t("squeezed")], [t("out")], perm=[1, 0, 2], name=t("Transpose")),
    ], f"{tag.strip('/').replace('/', '_')}_rows", [],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in (t("out"), t("pk"), t("pv"))],
        [c(t("axis2"), [2]), numpy_helper.from_array(np.array(1, np.int64), t("one"))])


def add_verify_rows(model: onnx.ModelProto) -> int:
    """Wrap every ``GroupQueryAttention`` of ``model`` (in place) in ``If(verify_rows)`` with the
    row-by-row Loop; returns how many (0: the graph has none, and nothing is changed). A W8A8 graph's
    decode branch (one token a call: :mod:`export.onnxruntime.decode_branch`) is left as it is: a
    verification call has several tokens, so only the other branch gets the Loop."""
    g = model.graph
    branch = next((n for n in g.node if n.op_type == "If" and n.name == "/decode_branch/If"), None)
    body = next(a.g for a in branch.attribute if a.name == "else_branch") if branch is not None else g
    if not any(n.op_type == "GroupQueryAttention" for n in body.node):
        return 0
    g.initializer.append(numpy_helper.from_array(np.array(False), VERIFY))
    g.input.append(helper.make_tensor_value_info(VERIFY, TensorProto.BOOL, []))
    return _wrap(body)


def _wrap(g: onnx.GraphProto) -> int:
    nodes = list(g.node)
    gqa = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    out: list[onnx.NodeProto] = []
    for n in nodes:
        if n.op_type != "GroupQueryAttention":
            out.append(n)
            continue
        tag = f"{n.name}/verify_rows"
        whole = copy.deepcopy(n)
        whole.output[:] = [f"{tag}/whole/{k}" for k in ("out", "pk", "pv")]
        whole.name = f"{tag}/whole"
        plain = helper.make_graph([whole], f"{tag.strip('/').replace('/', '_')}_whole", [],
                                  [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in whole.output])
        out.append(helper.make_node("If", [VERIFY], list(n.output[:3]), name=f"{tag}/If",
                                    then_branch=_rows(n, tag), else_branch=plain))
    del g.node[:]
    g.node.extend(out)
    return len(gqa)


def has_verify_rows(input_names) -> bool:
    """Whether a loaded graph takes ``verify_rows`` (an export with ``verify_tokens``)."""
    return VERIFY in set(input_names)
