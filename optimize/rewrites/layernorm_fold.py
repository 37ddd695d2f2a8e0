"""LayerNorm -> RMSNorm by folding (Jiang et al. 2023, "Pre-RMSNorm and Pre-CRMSNorm
Transformers"; the SliceGPT layernorm fusion).

Why it is exact for pre-LN models: if every write into the residual stream has zero mean
across the hidden dimension (centred embedding rows, output projections with column means
removed), the stream stays centred, so LayerNorm's mean subtraction is a no-op and its
variance equals the mean square: LN(x) = gamma * RMSNorm(x) + beta with the same eps.
gamma and beta then fold into the linears that read the norm (W' = W diag(gamma),
b' = b + W beta), leaving RMSNorm with weight ones. All algebra runs in float64.

The result stays the same HF model class with ``LlamaRMSNorm`` modules in place of the
LayerNorms. ``from_pretrained`` would rebuild LayerNorms and drop any bias the fold added
(e.g. GPT-2's lm_head gets one from the final norm's beta), so the rewrite is recorded in
``config.edge_optimize_rmsnorm`` and :func:`load_rewritten` rebuilds the structure.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from optimize.rewrites.linear import bias_or_zeros, is_linear, set_bias, set_weight_out_in, weight_out_in
from optimize.rewrites.ln_plans import LNPlan, RewriteRefused, plan_for

CONFIG_KEY = "edge_optimize_rmsnorm"


def _norm_params(norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    d = norm.normalized_shape[-1]
    like = dict(dtype=torch.float64, device=next(norm.parameters(), torch.empty(0)).device)
    gamma = norm.weight.detach().double() if norm.weight is not None else torch.ones(d, **like)
    beta = norm.bias.detach().double() if getattr(norm, "bias", None) is not None else torch.zeros(d, **like)
    return gamma, beta


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _rmsnorm_like(norm: nn.LayerNorm, weight: torch.Tensor | None = None) -> LlamaRMSNorm:
    dtype = norm.weight.dtype if norm.weight is not None else torch.float32
    device = norm.weight.device if norm.weight is not None and not norm.weight.is_meta else None  # beside the old norm
    new = LlamaRMSNorm(norm.normalized_shape[-1], eps=norm.eps).to(device=device, dtype=dtype)
    if weight is not None:
        with torch.no_grad():
            new.weight.copy_(weight)
    return new


def _tied(model: nn.Module, head: str) -> bool:
    emb, lm = model.get_input_embeddings(), model.get_submodule(head)
    return lm.weight is emb.weight or (not lm.weight.is_meta and lm.weight.data_ptr() == emb.weight.data_ptr())


def untie_config(config) -> None:
    config.tie_word_embeddings = False
    if hasattr(config, "get_text_config"):
        config.get_text_config().tie_word_embeddings = False


def untie_head(model: nn.Module, head: str) -> bool:
    """Give the output embedding its own weight (folding changes head and input embedding differently)."""
    if not _tied(model, head):
        return False
    model.get_submodule(head).weight = nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    untie_config(model.config)
    return True


def planned_record(model: nn.Module, approximate: bool) -> dict | None:
    """The ``config.edge_optimize_rmsnorm`` record the rmsnorm stage will write, foreseen from a
    (meta-device) model before any weights load; marked ``"planned": True`` (the real record
    adds ``eps`` and ``added_bias``). None when the stage changes nothing or will refuse."""
    layernorms = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    if not layernorms:
        return None
    try:
        plan = plan_for(model)
    except RewriteRefused:
        if not approximate:
            return None
        return {"mode": "approximate", "arch": model.config.model_type, "norms": layernorms,
                "untied_head": False, "planned": True}
    return {"mode": "exact", "arch": plan.arch, "norms": [n for n, _ in plan.norms],
            "untied_head": _tied(model, plan.head), "planned": True}


def fold_exact(model: nn.Module, plan: LNPlan) -> dict:
    """Rewrite ``model`` in place per ``plan``; returns the record stored in its config."""
    for name, _ in plan.norms:
        if not isinstance(model.get_submodule(name), nn.LayerNorm):
            raise RewriteRefused(f"{plan.arch}: {name} is {type(model.get_submodule(name)).__name__}, not LayerNorm")
    untied = untie_head(model, plan.head)
    added_bias: list[str] = []
    for name, readers in plan.norms:
        gamma, beta = _norm_params(model.get_submodule(name))
        for r in readers:
            lin = model.get_submodule(r)
            if not is_linear(lin):
                raise RewriteRefused(f"{plan.arch}: reader {r} is {type(lin).__name__}, not a linear layer")
            w, b = weight_out_in(lin), bias_or_zeros(lin)
            new_b = b + w @ beta
            set_weight_out_in(lin, w * gamma[None, :])
            if getattr(lin, "bias", None) is not None or bool(beta.abs().max() > 0):
                if set_bias(lin, new_b):
                    added_bias.append(r)
    for name in plan.writers:
        lin = model.get_submodule(name)
        w = weight_out_in(lin)
        set_weight_out_in(lin, w - w.mean(dim=0, keepdim=True))
        if getattr(lin, "bias", None) is not None:
            b = bias_or_zeros(lin)
            set_bias(lin, b - b.mean())
    for name in plan.embeddings:
        emb = model.get_submodule(name)
        w = emb.weight.detach().double()
        with torch.no_grad():
            emb.weight.copy_((w - w.mean(dim=1, keepdim=True)).to(emb.weight.dtype))
    for name, _ in plan.norms:
        _set_module(model, name, _rmsnorm_like(model.get_submodule(name)))
    record = {
        "mode": "exact",
        "arch": plan.arch,
        "norms": [n for n, _ in plan.norms],
        "eps": {n: model.get_submodule(n).variance_epsilon for n, _ in plan.norms},
        "added_bias": added_bias,
        "untied_head": untied,
    }
    setattr(model.config, CONFIG_KEY, record)
    return record


def swap_approximate(model: nn.Module) -> dict:
    """Replace every LayerNorm by RMSNorm(weight=gamma), dropping centring and beta.

    Not exact: the model needs healing. Used only when the config asks for ``approximate``."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    eps = {}
    for name in names:
        norm = model.get_submodule(name)
        gamma, _ = _norm_params(norm)
        new = _rmsnorm_like(norm, gamma)
        _set_module(model, name, new)
        eps[name] = new.variance_epsilon
    record = {"mode": "approximate", "arch": model.config.model_type, "norms": names, "eps": eps,
              "added_bias": [], "untied_head": False}
    setattr(model.config, CONFIG_KEY, record)
    return record


def apply_structure(model: nn.Module, record: dict) -> list[str]:
    """Give a model loaded as its stock class the layout a rewrite left: RMSNorms (keeping the
    loaded norm weight), added biases (zeros until loaded), an untied head. Returns the
    parameter names the stock class could not load."""
    for name in record["norms"]:
        norm = model.get_submodule(name)
        if not isinstance(norm, nn.LayerNorm):  # already restored: keep this idempotent
            continue
        weight = norm.weight.detach() if norm.weight is not None else None
        device = weight.device if weight is not None else torch.device("cpu")
        with torch.device(device):  # "meta" when a checkpoint loader builds the skeleton first
            new = LlamaRMSNorm(norm.normalized_shape[-1], eps=record["eps"][name])
        if weight is not None:
            new = new.to(weight.dtype)
            if not weight.is_meta:
                with torch.no_grad():
                    new.weight.copy_(weight)
        _set_module(model, name, new)
    head = model.get_output_embeddings()
    if record.get("untied_head") and head.weight is model.get_input_embeddings().weight:
        head.weight = nn.Parameter(head.weight.detach().clone())
    for name in record["added_bias"]:
        lin = model.get_submodule(name)
        if getattr(lin, "bias", None) is not None:
            continue
        out = lin.weight.shape[0] if isinstance(lin, nn.Linear) else lin.weight.shape[1]
        if lin.weight.is_meta:
            lin.bias = nn.Parameter(torch.empty(out, dtype=lin.weight.dtype, device="meta"))
        else:
            set_bias(lin, torch.zeros(out, dtype=torch.float64))
    return [f"{n}.bias" for n in record["added_bias"]]


def _file_to_model_keys(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """Map checkpoint keys to model keys with transformers' own renamings (e.g. GPT-NeoX saves
    ``lm_head`` as ``embed_out``). Falls back to identity if that internal API moves."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key

        transforms = get_model_conversion_mapping(model)
        ren = [t for t in transforms if isinstance(t, WeightRenaming)]
        conv = [t for t in transforms if not isinstance(t, WeightRenaming)]
        meta = model.state_dict()
        return {k: rename_source_key(k, ren, conv, model.base_model_prefix, meta)[0] for k in keys}
    except Exception:  # pragma: no cover - depends on transformers internals
        return {k: k for k in keys}


def load_rewritten(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Load a model saved with ``save_pretrained`` after the rmsnorm stage.

    ``AutoModelForCausalLM.from_pretrained`` alone rebuilds LayerNorms and drops the biases
    the fold added (it warns about unexpected keys); this loads through it, swaps in the
    recorded structure and then loads those extra tensors from the checkpoint."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from transformers.utils import logging as hf_logging

    path = Path(path)
    prev = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists exactly the keys fixed up below
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    finally:
        hf_logging.set_verbosity(prev)
    record = getattr(model.config, CONFIG_KEY, None)
    if record is None:
        raise ValueError(f"{path}: config.json has no {CONFIG_KEY!r}; this model was not rewritten by the rmsnorm stage")
    extra = set(apply_structure(model, record))
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    params = dict(model.named_parameters())
    found = set()
    for f in files:
        with safe_open(str(path / f), framework="pt") as fh:
            mapping = _file_to_model_keys(model, list(fh.keys()))
            for src, dst in mapping.items():
                if dst in extra:
                    with torch.no_grad():
                        params[dst].copy_(fh.get_tensor(src).to(params[dst].dtype))
                    found.add(dst)
    if extra - found:
        raise ValueError(f"{path}: checkpoint lacks the rewritten tensors {sorted(extra - found)[:5]}")
    return model.eval()
