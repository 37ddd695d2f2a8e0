"""A mixture of experts' fused expert weights as one ``nn.Linear`` per expert projection.

Why: transformers 5 keeps a MoE block's experts as two 3-D parameters (Mixtral's
``MixtralExperts.gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``). torchao quantizes
``nn.Linear`` only, so those weights would silently stay fp32 under ``ptq_int8``; GPTQ's
Hessians hook Linears; the equalization folds scale Linear columns. :func:`unfuse_experts`
replaces each fused module with :class:`UnfusedExperts`, which holds ``gate_proj``/``up_proj``/
``down_proj`` Linears per expert (``<block>.experts.<e>.gate_proj``) and computes the same
function: expert ``e``'s ``gate``/``up`` rows are the two halves of ``gate_up_proj[e]``.

Two forwards of one function:

- ``routed`` (the default, what transformers computes): each expert runs on the tokens routed to
  it only, so a Linear runs a data-dependent number of times and a calibration hook on it sees
  exactly its expert's tokens (GPTQ's per-expert Hessians);
- ``dense`` (for export): every expert runs on every token and is weighted by the routing
  weights, zero for the experts a token was not routed to. ``torch.export`` cannot trace the
  routed loop (which experts run depends on the data); the dense form has static shapes and
  adds the experts in the same order, so a token's sum is the routed one plus exact zeros.
  It costs ``E / top_k`` times the expert compute.

This sits on the ground floor because the stages (``optimize/``) and the exporters
(``export/``) both need it, and exporters never import ``optimize``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


class ExpertsRefused(ValueError):
    """A fused experts module this rewrite cannot unfuse exactly; the message says why."""


class ExpertMLP(nn.Module):
    """One expert: ``down(act(gate(x)) * up(x))``, the SwiGLU MLP of a Llama block."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act_fn: nn.Module):
        super().__init__()
        self.gate_proj = _linear(gate)
        self.up_proj = _linear(up)
        self.down_proj = _linear(down)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _linear(weight: torch.Tensor) -> nn.Linear:
    out_f, in_f = weight.shape
    with torch.device("meta"):
        lin = nn.Linear(in_f, out_f, bias=False)
    lin.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    return lin


class UnfusedExperts(nn.ModuleList):
    """The experts of one MoE block as :class:`ExpertMLP` modules, called like the fused module:
    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``."""

    def __init__(self, experts: list[ExpertMLP], dense: bool = False):
        super().__init__(experts)
        self.num_experts = len(experts)
        self.dense = dense

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.dense:
            return self.forward_dense(hidden_states, top_k_index, top_k_weights)
        return self.forward_routed(hidden_states, top_k_index, top_k_weights)

    def forward_routed(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """transformers' loop: expert ``e`` on its routed tokens, added in expert order."""
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            hit = torch.bincount(top_k_index.flatten(), minlength=self.num_experts).nonzero().flatten().tolist()
        for e in hit:
            token_idx, k_pos = torch.where(top_k_index == e)
            y = self[e](hidden_states[token_idx]) * top_k_weights[token_idx, k_pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    def forward_dense(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """Every expert on every token, weighted by its routing weight (0 where not routed)."""
        experts = torch.arange(self.num_experts, device=top_k_index.device)
        # [T, k, E] one-hot of the chosen experts times their weights, summed over k: [T, E]
        weights = ((top_k_index.unsqueeze(-1) == experts).to(top_k_weights.dtype) * top_k_weights.unsqueeze(-1)).sum(1)
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self):
            out = out + (expert(hidden_states) * weights[:, e, None]).to(out.dtype)
        return out


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers experts module that keeps its expert weights as 3-D parameters."""
    return any(p.dim() == 3 for p in module.parameters(recurse=False)) and hasattr(module, "num_experts")


def fused_expert_params(model: nn.Module) -> list[str]:
    """Names of the 3-D expert weights still fused (what torchao and the Linear hooks cannot see)."""
    return [f"{name}.{p}" for name, m in model.named_modules() if is_fused_experts(m)
            for p, t in m.named_parameters(recurse=False) if t.dim() == 3]


def check_layout(name: str, m: nn.Module) -> None:
    """Only the layout whose unfused form is known exact: concatenated [gate; up] rows, no bias, a
    gated activation, weights stored [out, in] (Mixtral's). Expert parallelism
    (``train/parallel/experts.py``) computes the experts from the same layout and checks it here too."""
    why = None
    gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        why = "it has no gate_up_proj and down_proj weights"
    elif getattr(m, "has_bias", False) or getattr(m, "is_transposed", False) or not getattr(m, "is_concatenated", True):
        why = "its weights carry biases, are stored transposed or interleave gate and up rows"
    elif not getattr(m, "has_gate", True) or not hasattr(m, "act_fn"):
        why = "it has no gated activation"
    elif getattr(m, "has_post_expert_norm", False):
        why = "it normalises each expert's output"
    elif getattr(getattr(type(m), "_apply_gate", None), "__name__", "_default_apply_gate") != "_default_apply_gate":
        why = "its gate is not act(gate) * up"
    elif gate_up.shape[0] != down.shape[0] or gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
        why = f"its shapes {tuple(gate_up.shape)} and {tuple(down.shape)} are not [E, 2I, H] and [E, H, I]"
    if why:
        raise ExpertsRefused(f"{name} ({type(m).__name__}) cannot be split into per-expert Linears: {why}")


def split_experts(name: str, m: nn.Module, dense: bool = False) -> UnfusedExperts:
    """The per-expert form of one fused module (its weights copied; ``m`` is left as it was)."""
    check_layout(name, m)
    inter = m.down_proj.shape[2]
    return UnfusedExperts([ExpertMLP(m.gate_up_proj[e, :inter], m.gate_up_proj[e, inter:], m.down_proj[e], m.act_fn)
                           for e in range(m.gate_up_proj.shape[0])], dense=dense)


def unfuse_experts(model: nn.Module, dense: bool = False) -> list[str]:
    """Replace every fused experts module of ``model`` by :class:`UnfusedExperts`, in place; returns
    the replaced modules' names ([] for a dense model, or one already unfused). Works on a meta-device
    model too (the stages' pre-flight). Raises :class:`ExpertsRefused` for a layout it cannot split."""
    fused = [(n, m) for n, m in model.named_modules() if is_fused_experts(m)]
    for name, m in fused:
        check_layout(name, m)
    for name, m in fused:
        model.set_submodule(name, split_experts(name, m, dense), strict=True)
    return [n for n, _ in fused]


def dense_experts(model: nn.Module) -> list[str]:
    """Every experts module of ``model`` in the dense form from now on (an exporter's own copy):
    fused ones split, unfused ones switched. Returns their names."""
    unfuse_experts(model, dense=True)
    names = []
    for name, m in model.named_modules():
        if isinstance(m, UnfusedExperts):
            m.dense = True
            names.append(name)
    return names


def expert_linears(model: nn.Module) -> list[str]:
    """Names of the per-expert Linears (they run on the tokens routed to them: maybe none)."""
    return [f"{name}.{sub}" for name, m in model.named_modules() if isinstance(m, UnfusedExperts)
            for sub, lin in m.named_modules() if isinstance(lin, nn.Linear)]


def routers(model: nn.Module) -> list[str]:
    """The routers beside the unfused experts that are no ``nn.Linear`` (Mixtral's ``MixtralTopKRouter``):
    torchao leaves them fp32, which keeps every routing decision as it was."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, UnfusedExperts):
            parent = name.rpartition(".")[0]
            out += [f"{parent}.{n}" for n, r in model.get_submodule(parent).named_children()
                    if r is not m and not isinstance(r, nn.Linear) and getattr(r, "weight", None) is not None]
    return out


@contextlib.contextmanager
def export_form(model: nn.Module) -> Iterator[list[str]]:
    """``model``'s experts in the dense form while the block runs, then as they were: fused modules
    are swapped for a dense per-expert copy and put back, unfused ones switched to dense and back.
    Yields the names of the experts modules (for an exporter's details)."""
    fused = [(n, m) for n, m in model.named_modules() if is_fused_experts(m)]
    for name, m in fused:
        check_layout(name, m)
    unfused = [(n, m, m.dense) for n, m in model.named_modules() if isinstance(m, UnfusedExperts)]
    try:
        for name, m in fused:
            model.set_submodule(name, split_experts(name, m, dense=True), strict=True)
        for _, m, _ in unfused:
            m.dense = True
        yield sorted([n for n, _ in fused] + [n for n, _, _ in unfused])
    finally:
        for name, m in fused:
            model.set_submodule(name, m, strict=True)
        for _, m, was in unfused:
            m.dense = was
