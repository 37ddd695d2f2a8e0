"""The lm_head only where logits are used: ``logits`` holds the last fed position, and
``all_logits`` every fed position when a caller asks for them.

Why: to pick the next token a generator needs one row of logits, but the builder's graph runs the
lm_head on every position of a call. One 512-token prefill chunk at Gemma 3's 262,144-word
vocabulary is 512 MiB of float32 logits, and ONNX Runtime and onnxruntime-genai held about three
such buffers at once (docs/devices.md): more than the int8 weights. So the head reads
``Slice(hidden, start)``, where ``start`` is 0 when the boolean input ``return_all_logits`` is true
and -1 (the last position) when it is false:

- ``all_logits`` ``[batch, n, vocab]`` is the head's output: every fed position when asked, else
  the last one.
- ``logits`` ``[batch, 1, vocab]`` is its last row. Its static 1 is what onnxruntime-genai reads
  as a pruned model (``Model::IsPruned``): its ``Generator`` then allocates one row per call
  instead of a chunk's worth, so an app gets the saving with no change.

The input is an overridable initializer whose default is false, so a runtime that feeds only the
builder's inputs never pays for the other rows. Scoring feeds true: the pipeline's perplexity,
lm-eval and speculative verification. There is one head: its weights are stored once and packed
once (a second copy of the head's nodes would make ONNX Runtime pack them twice at load).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export.onnxruntime.decode_branch import Chain

LAST = "logits"
ALL = "all_logits"
ASK = "return_all_logits"
PREFIX = "/all_logits"


def _head_nodes(graph: onnx.GraphProto, hidden: str) -> list[onnx.NodeProto]:
    """The nodes downstream of ``hidden`` (the final norm's output), in graph order."""
    reach, out = {hidden}, []
    for n in graph.node:
        if any(i in reach for i in n.input):
            out.append(n)
            reach.update(o for o in n.output if o)
    return out


def split_head(model: onnx.ModelProto, hidden: str, chains: list[Chain]) -> dict | None:
    """Rewrite ``model`` (in place, before the decode branch) so that ``logits`` is the last
    position's and ``all_logits`` every position's on request; ``hidden`` is the input of the
    builder's lm_head MatMul. The lm_head's per-token chain in ``chains`` (the Linears the decode
    branch fuses) is pointed at the selected rows. Returns what the manifest records, or None
    where the graph has no such head (nothing is changed then)."""
    g = model.graph
    outputs = {o.name: o for o in g.output}
    head = _head_nodes(g, hidden)
    produced = {o for n in head for o in n.output if o}
    if LAST not in outputs or LAST not in produced or hidden in outputs or ALL in produced:
        return None
    if produced & (set(outputs) - {LAST}):  # the head feeds another output (hidden states): keep it whole
        return None
    mk = helper.make_node
    consts = {f"{PREFIX}/minus_one": np.array([-1], np.int64), f"{PREFIX}/zero": np.array([0], np.int64),
              f"{PREFIX}/end": np.array([np.iinfo(np.int64).max], np.int64), f"{PREFIX}/axis": np.array([1], np.int64)}
    for k, v in consts.items():
        g.initializer.append(numpy_helper.from_array(v, k))
    g.initializer.append(numpy_helper.from_array(np.array(False), ASK))
    g.input.append(helper.make_tensor_value_info(ASK, TensorProto.BOOL, []))
    rows = f"{PREFIX}/hidden"
    select = [
        mk("Where", [ASK, f"{PREFIX}/zero", f"{PREFIX}/minus_one"], [f"{PREFIX}/start"], name=f"{PREFIX}/Where"),
        mk("Slice", [hidden, f"{PREFIX}/start", f"{PREFIX}/end", f"{PREFIX}/axis"], [rows], name=f"{PREFIX}/Slice"),
    ]
    last_row = mk("Slice", [ALL, f"{PREFIX}/minus_one", f"{PREFIX}/end", f"{PREFIX}/axis"], [LAST],
                  name=f"{PREFIX}/last/Slice")
    for n in head:
        n.input[:] = [rows if i == hidden else i for i in n.input]
        n.output[:] = [ALL if o == LAST else o for o in n.output]
    for k, c in enumerate(chains):
        if c.x == hidden or c.y == LAST:
            chains[k] = Chain(rows if c.x == hidden else c.x, ALL if c.y == LAST else c.y, c.weight, c.col_scale,
                              c.nodes, c.weight_zero_point)
    nodes = list(g.node)
    first, last = nodes.index(head[0]), nodes.index(head[-1])
    del g.node[:]
    g.node.extend(nodes[:first] + select + nodes[first:last + 1] + [last_row] + nodes[last + 1:])
    # shapes the builder declared for every position no longer hold on the head's values
    for vi in [vi for vi in g.value_info if vi.name in produced]:
        g.value_info.remove(vi)
    logits_vi = outputs[LAST]
    extra = onnx.ValueInfoProto()
    extra.CopyFrom(logits_vi)
    extra.name = ALL
    extra.type.tensor_type.shape.dim[1].dim_param = "all_logits_length"
    logits_vi.type.tensor_type.shape.dim[1].Clear()
    logits_vi.type.tensor_type.shape.dim[1].dim_value = 1
    g.output.insert(list(g.output).index(logits_vi) + 1, extra)
    return {"logits": "last position only ([batch, 1, vocab])",
            "all_logits": f"every fed position when the input {ASK} is true, else the last one",
            "head_nodes": len(head)}


def split_head_io(input_names, output_names) -> bool:
    """Whether a loaded graph has the split head (an export from before it has neither name)."""
    return ASK in set(input_names) and ALL in set(output_names)
