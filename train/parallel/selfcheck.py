"""Every parallel wrapper on a one-device mesh, against the plain model: the degenerate layouts.

A mesh dimension of size 1 still runs the wrapper's whole code path (DTensor parameters, the
parallel styles' input/output hooks, the experts' collectives, the stage forward, the mesh-wide
gradient norm) with nothing to split, so its forward and backward must match the plain model
to float rounding. This is how the CUDA path of each wrapper runs at least once on a single
GPU (``bench/gpu.py``), and the same check runs on CPU in the tests.
"""

from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

from train.parallel.layout import Layout
from train.parallel.mesh import build_mesh


def ensure_single_process_group(device: torch.device) -> bool:
    """A process group of one for this process if none exists; True if this call made it."""
    if dist.is_initialized():
        return False
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="selfcheck-"), "store"), 1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    return True


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().float().cpu()
    return loss.detach().float().cpu(), grads


def _not_applicable(dim: str, family: str, moe: bool) -> str | None:
    from train.parallel.layout import PP_FAMILIES, TP_FAMILIES

    if dim == "ep" and not moe:
        return "not a mixture-of-experts model"
    if dim == "tp" and (moe or family not in TP_FAMILIES):
        return f"train.parallel refuses tp for '{family}'"
    if dim == "pp" and family not in PP_FAMILIES:
        return f"train.parallel refuses pp for '{family}'"
    return None


def degenerate_layouts(model: nn.Module, device: torch.device, dims=("tp", "pp", "ep"), seq_len: int = 16) -> dict:
    """For each of ``dims`` that applies to ``model``: that wrapper alone on a one-device mesh,
    with the max relative difference of its loss and gradients from the plain model's.

    Returns ``{dim: {"loss_rel": ..., "grad_rel": ..., "grad_norm_rel": ...}}`` (or ``{"skipped": why}``)."""
    from train.parallel.experts import apply_expert_parallel, expert_modules
    from train.parallel.grad_norm import total_grad_norm
    from train.parallel.pipeline import keep_stage
    from train.parallel.tensor import apply_tensor_parallel

    made = ensure_single_process_group(device)
    try:
        torch.manual_seed(0)
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (2, seq_len), device=device)
        ref_model = copy.deepcopy(model).to(device).float().train()
        ref_loss, ref_grads = _loss_and_grads(ref_model, ids)
        ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
        pmesh = build_mesh(Layout(), device.type)
        results: dict = {}
        family = getattr(model.config, "model_type", "")
        moe = bool(expert_modules(model))
        for dim in dims:
            why = _not_applicable(dim, family, moe)
            if why:
                results[dim] = {"skipped": why}
                continue
            m = copy.deepcopy(model).to(device).float().train()
            if dim == "tp":
                apply_tensor_parallel(m, pmesh.dim("tp"), sequence_parallel=True)
            elif dim == "pp":
                keep_stage(m, pmesh)
            elif dim == "ep":
                apply_expert_parallel(m, pmesh.dim("ep"))
            loss, grads = _loss_and_grads(m, ids)
            params = [p for p in m.parameters() if p.grad is not None]
            norm = total_grad_norm(params, pmesh).float().cpu()
            grad_rel = max(float((grads[k] - g).norm() / g.norm().clamp(min=1e-12)) for k, g in ref_grads.items())
            results[dim] = {
                "loss_rel": float((loss - ref_loss).abs() / ref_loss.abs()),
                "grad_rel": grad_rel,
                "grad_norm_rel": float((norm - ref_norm).abs() / ref_norm),
            }
        return results
    finally:
        if made:
            dist.destroy_process_group()
