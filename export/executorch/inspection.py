"""What a lowered ExecuTorch program runs, read back for the export report and its checks: the
delegated share of the edge graph, the kernel and delegate calls of the serialized program, and
the refusal of a graph whose attention did not route through ExecuTorch's LLM ops."""

from __future__ import annotations

from collections import Counter

import torch

from export.base import ExportError


def _delegation(gm: torch.fx.GraphModule) -> dict:
    """Share of the edge graph's ops inside XNNPACK subgraphs (before ``to_executorch``)."""
    from executorch.devtools.backend_debug import get_delegation_info

    info = get_delegation_info(gm)
    total = info.num_delegated_nodes + info.num_non_delegated_nodes
    return {
        "delegated_fraction": info.num_delegated_nodes / total if total else 0.0,
        "delegated_nodes": info.num_delegated_nodes,
        "portable_nodes": info.num_non_delegated_nodes,
        "delegated_subgraphs": info.num_delegated_subgraphs,
    }


def _program_calls(prog, method: str = "forward") -> dict:
    """What one call of ``method`` runs, read from the serialized program (after quant fusion and
    memory planning, so what ships): kernel calls outside the delegate, by operator, and how
    many delegate calls. This is the "portable ops" list of the report."""
    plan = next(p for p in prog.executorch_program.execution_plan if p.name == method)
    names = [f"{o.name}.{o.overload}" if o.overload else o.name for o in plan.operators]
    kernels: Counter = Counter()
    delegates = 0
    for chain in plan.chains:
        for ins in chain.instructions:
            kind = type(ins.instr_args).__name__
            if kind == "KernelCall":
                kernels[names[ins.instr_args.op_index]] += 1
            elif kind == "DelegateCall":
                delegates += 1
    return {"delegate_calls": delegates, "portable_ops": dict(sorted(kernels.items()))}


def _graph_ops(gm: torch.fx.GraphModule) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _check_custom_ops(ep: torch.export.ExportedProgram, plan, rows: int = 1) -> dict:
    """The exported graph must update the cache through ExecuTorch's LLM ops (twice per layer) and
    attend with ``llama::custom_sdpa`` once per layer (soft-capped models: with the plain-op
    fallback), and run no transformers SDPA or KV ``index_put``: refuse a program that silently
    fell back. The verify method attends ``rows`` times a layer, one query row a call (ring and
    soft-capped models get no verify method: ``model_problems`` refuses them)."""
    n_layers = len(plan.layers)
    want_sdpa = 0 if plan.softcap is not None else n_layers * rows
    ops = _graph_ops(ep.graph_module)
    sdpa = sum(v for k, v in ops.items() if "llama.custom_sdpa" in k)
    upd = sum(v for k, v in ops.items() if "llama.update_cache" in k)
    # a ring's slot positions are one index_put per window per call
    fallback = {k: v for k, v in ops.items() if "scaled_dot_product" in k or "repeat_kv" in k
                or ("index_put" in k and v > len(plan.windows))}
    if sdpa != want_sdpa or upd != 2 * n_layers or fallback:
        raise ExportError(
            f"the exported graph has {sdpa} llama::custom_sdpa and {upd} llama::update_cache calls for {n_layers} "
            f"layers (want {want_sdpa} and {2 * n_layers}) and fallback ops {fallback or 'none'}; the model's "
            "attention did not route through ExecuTorch's LLM custom ops"
        )
    return {"llama::custom_sdpa": sdpa, "llama::update_cache": upd,
            "softcapped_attention_layers": n_layers if plan.softcap is not None else 0}
