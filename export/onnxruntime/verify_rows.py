"""Verification calls in the fused ONNX graph: several tokens in one call, each row's logits those a
one-token call gives, bit for bit (speculative decoding's check of drafted tokens).

What differs between a T-token call and T one-token calls in ONNX Runtime (measured op by op on the
fused graph, ORT 1.31): only ``GroupQueryAttention``. Everything else in the fused graph gives a row
the same bits whatever rows surround it: constant-weight ``MatMul``, ``MatMulNBits`` at accuracy level
4 with blocks of at most 32 (4-bit) or 64 (8-bit) columns (larger blocks do not: the exporter caps
them when ``verify_tokens`` is set), the norms, rotary, ``GatherBlockQuantized``, and the W8A8
per-token chain, whose arithmetic is ``DynamicQuantizeMatMul``'s
(:func:`export.onnxruntime.fused._per_token_nodes`).
(The ``MatMulNBits`` property is the host's kernels': on a Zen 3 host with AVX2 and no AVX-512 a row of a
5-row call moved by up to 2.4e-6 against the row alone, so there :func:`check_rows` refuses int4 exports,
as it does on ARM64; docs/onnxruntime.md.)

Inside the attention (ORT 1.31's CPU kernel, read in its source and measured): a one-token call runs
ONNX Runtime's flash-attention decode kernel, whose hand-written dot products no graph of standard ops
reproduces. With ``qk_output`` set (the probabilities as a fourth output) the node takes its other path:
scores by SGEMM (whose elements do not depend on the other rows), MLAS's softmax over exactly each row's
causal length, then the probabilities times V. There a block of rows gets every row's probabilities
bit for bit as a one-row call gets them, and a one-row call's output is exactly
``MatMul(probabilities, V)`` (MLAS's one-row GEMV kernel); only the block's own product with V differs.

So with ``verify_tokens`` every ``GroupQueryAttention`` becomes ``If(verify_rows)``:

- then (a verification call): the node once over the whole block, asking for its probabilities, which
  updates the cache as T one-token calls would and gives every row's probabilities; then V times them
  as one-row products: one batched ``MatMul`` whose every product has one row (the kernel a one-row call
  runs), over the call's whole length. Trailing zero probabilities (the positions after a row's own)
  leave a product's bits unchanged except where the row's causal length is 3 modulo 4 (MLAS's x86-64
  one-row kernel sums a last group of 3 in another order than 3 of a group of 4: measured on every
  length to 1003 and head sizes 8 to 256), so those rows are computed again over exactly their length
  (one row in 4, a ``Slice`` of V and a small ``MatMul`` each) and replace theirs;
- else: a prefill runs the node as it was (the flash kernel: faster, and the same in plain and
  speculative decoding).

One-token steps run the node with ``qk_output`` (the path the rows above match): each attention is
``If(one_token)`` first, whose else branch holds ``If(verify_rows)``, so a step pays one ``If`` a layer
and a verification call or a prefill two. A W8A8 graph's decode branch holds its one-token steps, so
there the attentions ask for probabilities in that branch and the other gets ``If(verify_rows)`` alone.

What the layers share (the call's rows, past length, the recomputed rows' positions) is computed once a
call (:func:`_prelude`). ``verify_rows`` is an overridable initializer that defaults to false (as
``return_all_logits`` is), so onnxruntime-genai and any runtime that feeds only the builder's inputs run
the else branch; our runners feed true for verification calls only. The row's past length comes from
``total_sequence_length`` (the call's minus its rows), so the same graph serves a growing cache (ONNX
Runtime) and onnxruntime-genai's shared max-length buffer. The modulo-4 rule is a property of one
kernel on one architecture, so the runners check the graph on their host before decoding speculatively
(:func:`check_rows`).
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

VERIFY = "verify_rows"
#: MatMulNBits (accuracy level 4) blocks whose kernels give a row the same bits in any call, by bits
ROW_EXACT_BLOCK = {4: 32, 8: 64}
#: GroupQueryAttention's qk_output: its probabilities after the softmax
QK_AFTER_SOFTMAX = 2
#: the causal lengths (modulo 4) whose one-row product with V changes when trailing zeros extend it
#: (MLAS's one-row GEMV kernel on x86-64); their rows are recomputed over exactly their length
RECOMPUTE_MOD4 = 3


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _with_probs(node: onnx.NodeProto, probs: str) -> None:
    """Ask ``node`` (a GroupQueryAttention) for its attention probabilities as a fourth output."""
    if any(a.name == "qk_output" for a in node.attribute):
        raise ValueError(f"{node.name} already sets qk_output")
    node.attribute.append(helper.make_attribute("qk_output", QK_AFTER_SOFTMAX))
    while len(node.output) < 3:
        node.output.append("")
    node.output.append(probs)


def _slots(max_tokens: int) -> int:
    """How many rows of a call of at most ``max_tokens`` tokens can need recomputing: those before the
    last (whose product already runs over exactly its length), one in 4."""
    return (max(2, max_tokens) - 2) // 4 + 1


def _p(name: str) -> str:
    return f"/verify_rows/{name}"


def _prelude(q: str, tot: str, kv_heads: int, max_tokens: int) -> tuple[list, list]:
    """What the layers share, computed once a call: whether the call is one token (every call), and,
    under ``If(verify_rows)`` so that other calls skip them, the verification branches' values: the
    call's total length, the shape that splits the probabilities into one-row products, and for each
    recompute slot where its row sits, that row's causal length and its mask."""
    mk = helper.make_node
    p = _p
    i = lambda x: p(f"in/{x}")  # noqa: E731
    shared = [(p("total"), [1]), (p("rows_shape"), [5])]
    for j in range(_slots(max_tokens)):
        shared += [(p(f"fix{j}/{k}"), shape) for k, shape in (("starts", [2]), ("ends", [2]), ("row_shape", [5]),
                                                               ("L", [1]))]
    nodes = [
        mk("Shape", [q], [i("B")], start=0, end=1, name=i("B")),  # [1] int64
        mk("Cast", [tot], [i("tot64")], to=TensorProto.INT64, name=i("tot64")),
        mk("Reshape", [i("tot64"), p("c/one")], [i("total")], name=i("total")),  # [1]
        mk("Sub", [i("total"), p("S")], [i("past")], name=i("past")),
        mk("Sub", [p("S"), p("c/one")], [i("last")], name=i("last")),
        # probabilities [B, H, S, total] -> [B, Hkv, g*S, 1, total]: one-row products with V
        mk("Concat", [i("B"), p("c/kv_heads"), p("c/minus_one"), p("c/one"), i("total")], [i("rows_shape")], axis=0,
           name=i("rows_shape")),
        mk("Squeeze", [p("S")], [i("S_s")], name=i("S_s")),
        mk("Range", [p("c/zero_s"), i("S_s"), p("c/one_s")], [i("rowids")], name=i("rowids")),
        mk("Unsqueeze", [i("rowids"), p("c/one")], [i("rowcol")], name=i("rowcol")),  # [S, 1]
        # the first row whose causal length past + 1 + r is RECOMPUTE_MOD4 modulo 4
        mk("Sub", [p("c/target"), i("past")], [i("first_raw")], name=i("first_raw")),
        mk("Mod", [i("first_raw"), p("c/four")], [i("first")], name=i("first")),
    ]
    masks = []
    for j in range(_slots(max_tokens)):
        s = lambda x: i(f"fix{j}/{x}")  # noqa: E731,B023
        nodes += [
            mk("Add", [i("first"), p(f"c/off{j}")], [s("r")], name=s("r")),
            mk("Min", [s("r"), i("last")], [s("rc")], name=s("rc")),  # always a row of this call
            mk("Add", [s("rc"), p("c/one")], [s("rc1")], name=s("rc1")),
            mk("Add", [i("past"), s("rc1")], [s("L")], name=s("L")),  # that row's causal length
            mk("Concat", [s("rc"), p("c/zero")], [s("starts")], axis=0, name=s("starts")),
            mk("Concat", [s("rc1"), s("L")], [s("ends")], axis=0, name=s("ends")),
            mk("Concat", [i("B"), p("c/kv_heads"), p("c/minus_one"), p("c/one"), s("L")], [s("row_shape")], axis=0,
               name=s("row_shape")),
            mk("Equal", [i("rowcol"), s("r")], [s("mask")], name=s("mask")),  # [S, 1]: only a row < S matches
        ]
        masks.append(p(f"fix{j}/mask"))
    then = helper.make_graph(
        nodes, "verify_rows_prelude", [],
        [helper.make_tensor_value_info(i(name[len(p("")):]), TensorProto.INT64, None) for name, _ in shared]
        + [helper.make_tensor_value_info(i(m[len(p("")):]), TensorProto.BOOL, None) for m in masks])
    # a call that does not verify needs none of them: constants of the same types stand in
    other = helper.make_graph(
        [mk("Constant", [], [f"{name}/none"], value=numpy_helper.from_array(np.zeros(shape, np.int64)))
         for name, shape in shared]
        + [mk("Constant", [], [f"{m}/none"], value=numpy_helper.from_array(np.zeros((1, 1), bool))) for m in masks],
        "verify_rows_prelude_none", [],
        [helper.make_tensor_value_info(f"{name}/none", TensorProto.INT64, None) for name, _ in shared]
        + [helper.make_tensor_value_info(f"{m}/none", TensorProto.BOOL, None) for m in masks])
    always = [
        mk("Shape", [q], [p("S")], start=1, end=2, name=p("S")),
        mk("Equal", [p("S"), p("c/one")], [p("one_token1")], name=p("one_token1")),
        mk("Squeeze", [p("one_token1")], [p("one_token")], name=p("one_token")),  # the If conditions' scalar
        mk("If", [VERIFY], [name for name, _ in shared] + masks, name=p("prelude"), then_branch=then, else_branch=other),
    ]
    c = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), p(f"c/{name}"))  # noqa: E731
    consts = [c("zero", [0]), c("one", [1]), c("minus_one", [-1]), c("kv_heads", [kv_heads]), c("four", [4]),
              c("target", [RECOMPUTE_MOD4 - 1]), c("zero_s", 0), c("one_s", 1)]
    consts += [c(f"off{j}", [4 * j]) for j in range(_slots(max_tokens))]
    return always, consts


def _rows(node: onnx.NodeProto, tag: str, max_tokens: int) -> onnx.GraphProto:
    """The then-branch: the node over the whole block for the cache and the probabilities, then the
    attention output as one-row products with V (module docstring), with :func:`_prelude`'s values."""
    attrs = _attrs(node)
    heads, kv_heads = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    t = lambda s: f"{tag}/{s}"  # noqa: E731
    p = _p
    mk = helper.make_node
    block = copy.deepcopy(node)
    block.name = t("block")
    block.output[:] = [t("block_out"), t("pk"), t("pv")]
    _with_probs(block, t("probs"))  # [B, H, S, total]
    nodes = [
        block,
        mk("Slice", [t("pv"), p("c/zero"), p("total"), t("axis2")], [t("v")], name=t("v")),  # [B, Hkv, total, D]
        mk("Unsqueeze", [t("v"), t("axis2")], [t("v5")], name=t("v5")),  # [B, Hkv, 1, total, D]
        mk("Reshape", [t("probs"), p("rows_shape")], [t("prows")], name=t("prows")),  # [B, Hkv, g*S, 1, total]
        mk("MatMul", [t("prows"), t("v5")], [t("o5")], name=t("o5")),  # [B, Hkv, g*S, 1, D]
        mk("Reshape", [t("o5"), t("heads_shape")], [t("o_0")], name=t("o_0")),  # [B, Hkv, g, S, D]
    ]
    cur = t("o_0")
    for j in range(_slots(max_tokens)):
        s = lambda x: t(f"fix{j}/{x}")  # noqa: E731,B023
        f = lambda x: p(f"fix{j}/{x}")  # noqa: E731,B023
        nodes += [
            mk("Slice", [t("probs"), f("starts"), f("ends"), t("axes23")], [s("p")], name=s("p")),  # [B, H, 1, L]
            mk("Reshape", [s("p"), f("row_shape")], [s("prow")], name=s("prow")),  # [B, Hkv, g, 1, L]
            mk("Slice", [t("v5"), p("c/zero"), f("L"), t("axis3")], [s("v")], name=s("v")),  # [B, Hkv, 1, L, D]
            mk("MatMul", [s("prow"), s("v")], [s("o")], name=s("o")),  # [B, Hkv, g, 1, D]
            mk("Where", [f("mask"), s("o"), cur], [s("merged")], name=s("merged")),
        ]
        cur = s("merged")
    nodes += [
        mk("Transpose", [cur], [t("o_t")], perm=[0, 3, 1, 2, 4], name=t("o_t")),  # [B, S, Hkv, g, D]
        mk("Reshape", [t("o_t"), t("out_shape")], [t("out")], name=t("out")),  # [B, S, H*D]
    ]
    c = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), t(name))  # noqa: E731
    consts = [c("axis2", [2]), c("axis3", [3]), c("axes23", [2, 3]),
              c("heads_shape", [0, kv_heads, heads // kv_heads, -1, 0]), c("out_shape", [0, 0, -1])]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in (t("out"), t("pk"), t("pv"))]
    return helper.make_graph(nodes, f"{tag.strip('/').replace('/', '_')}_rows", [], outs, consts)


def add_verify_rows(model: onnx.ModelProto, max_tokens: int) -> int:
    """Wrap every ``GroupQueryAttention`` of ``model`` (in place) in ``If(verify_rows)`` (module
    docstring) for calls of up to ``max_tokens`` tokens; returns how many (0: the graph has none, and
    nothing is changed). One-token calls ask for the probabilities (the path a verification row
    matches); prefill keeps the node as it was (ONNX Runtime's flash kernel: faster, and the same in
    plain and speculative decoding). A W8A8 graph's decode branch (one token a call:
    :mod:`export.onnxruntime.decode_branch`) is that one-token path already; its other branch gets the
    rest."""
    g = model.graph
    branch = next((n for n in g.node if n.op_type == "If" and n.name == "/decode_branch/If"), None)
    body = next(a.g for a in branch.attribute if a.name == "else_branch") if branch is not None else g
    if not any(n.op_type == "GroupQueryAttention" for n in body.node):
        return 0
    if branch is not None:
        one_token = next(a.g for a in branch.attribute if a.name == "then_branch")
        for n in one_token.node:
            if n.op_type == "GroupQueryAttention":
                _with_probs(n, f"{n.name}/probs")
    g.initializer.append(numpy_helper.from_array(np.array(False), VERIFY))
    g.input.append(helper.make_tensor_value_info(VERIFY, TensorProto.BOOL, []))
    return _wrap(body, max_tokens, one_token_steps=branch is None)


def _branch(node: onnx.NodeProto, name: str, outputs: list[str], probs: bool) -> onnx.GraphProto:
    """A branch that runs a copy of ``node`` (asking for its probabilities when ``probs``)."""
    whole = copy.deepcopy(node)
    whole.name = name
    whole.output[:] = outputs
    if probs:
        _with_probs(whole, f"{name}/probs")
    return helper.make_graph([whole], f"{name.strip('/').replace('/', '_')}_g", [],
                             [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs])


def _verify_if(n: onnx.NodeProto, tag: str, outputs: list[str], max_tokens: int) -> onnx.NodeProto:
    """``If(verify_rows)``: the verification rows, else the node as it was (prefill)."""
    return helper.make_node("If", [VERIFY], outputs, name=f"{tag}/If", then_branch=_rows(n, tag, max_tokens),
                            else_branch=_branch(n, f"{tag}/prefill", [f"{tag}/prefill/{k}" for k in ("out", "pk", "pv")],
                                                probs=False))


def _wrap(g: onnx.GraphProto, max_tokens: int, *, one_token_steps: bool) -> int:
    """``one_token_steps``: the graph's calls include one-token steps (no decode branch), which must take
    the probabilities path: each attention becomes ``If(one_token)``, its else branch ``If(verify_rows)``;
    else each becomes ``If(verify_rows)`` alone. Prefill keeps the node as it was."""
    nodes = list(g.node)
    gqa = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    kv = {int(_attrs(n)["kv_num_heads"]) for n in gqa}
    if len(kv) != 1:
        raise ValueError(f"verify_rows: attention layers with different KV head counts ({sorted(kv)})")
    out: list[onnx.NodeProto] = []
    for n in nodes:
        if n.op_type != "GroupQueryAttention":
            out.append(n)
            continue
        if n is gqa[0]:  # the shared values, once a call, where the first attention's inputs exist
            shared, consts = _prelude(n.input[0], n.input[6], kv.pop(), max_tokens)
            out.extend(shared)
            g.initializer.extend(consts)
        tag = f"{n.name}/verify_rows"
        if not one_token_steps:
            out.append(_verify_if(n, tag, list(n.output[:3]), max_tokens))
            continue
        # one-token steps first: one If a layer on the hot path, a second only for prefill and verification
        several = [f"{tag}/several/{k}" for k in ("out", "pk", "pv")]
        out.append(helper.make_node(
            "If", [_p("one_token")], list(n.output[:3]), name=f"{tag}/one_token",
            then_branch=_branch(n, f"{tag}/step", [f"{tag}/step/{k}" for k in ("out", "pk", "pv")], probs=True),
            else_branch=helper.make_graph(
                [_verify_if(n, tag, several, max_tokens)], f"{tag.strip('/').replace('/', '_')}_several", [],
                [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in several])))
    del g.node[:]
    g.node.extend(out)
    return len(gqa)


def has_verify_rows(input_names) -> bool:
    """Whether a loaded graph takes ``verify_rows`` (an export with ``verify_tokens``)."""
    return VERIFY in set(input_names)


#: the probe's prefix lengths: rows of a 2-token call after them have every causal length modulo 4
PROBE_PREFIXES = (9, 11)


def check_rows(runner, tokens: int) -> str | None:
    """Run the verification graph against one-token calls on this host, before any output depends on
    it: ``runner`` (a speculative runner: ``forward`` of 2 to ``tokens`` tokens asking for every position
    verifies) prefills a fixed prefix, verifies ``tokens`` more, is cut back, and feeds them one at a
    time; after two prefix lengths every row's causal length has met every residue modulo 4 (the
    module docstring's rule, measured on x86-64 MLAS; another host's kernels may sum otherwise).
    Returns None where every row is bit for bit, else what differed. The runner is reset after."""
    import torch

    limit = runner.max_seq_len
    try:
        for prefix in PROBE_PREFIXES:
            if limit is not None:  # a short cache: as many rows as fit after the prefix
                tokens = min(tokens, limit - prefix - 1)
            if tokens < 2:
                continue
            ids = torch.arange(prefix + tokens, dtype=torch.long) % 97 + 3  # ordinary ids of any vocabulary
            runner.reset()
            runner.forward(ids[:prefix], all_logits=False)
            block = runner.forward(ids[prefix:], all_logits=True)
            if not runner.truncate(prefix):
                return "the runtime cannot cut its cache back"
            for i in range(tokens):
                one = runner.forward(ids[prefix + i:prefix + i + 1], all_logits=False)[-1]
                if not torch.equal(block[i], one):
                    diff = float((block[i] - one).abs().max())
                    return (f"row {i} of a {tokens}-token verification call after {prefix} tokens differs from a "
                            f"one-token call by up to {diff:.3g}")
    finally:
        runner.reset()
    return None


def require_exact_rows(runner, name: str) -> None:
    """:func:`check_rows` for a runner's ``speculative_runner()``: a graph whose rows differ on this host is
    refused with what differed (``name``: the artifact, for the message)."""
    from export.decoding.runtime import RunnerError

    problem = check_rows(runner, runner.verify_tokens)
    if problem is not None:
        raise RunnerError(f"{name}: verification calls are not exact on this host ({problem}); speculative "
                          "decoding would change the output, so it is refused here (plain decoding is unaffected)")
