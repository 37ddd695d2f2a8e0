"""GPTQ for ``ptq_int8``: running it with the stage's settings (:class:`GptqOptions`), and
installing its integers and scales as the torchao tensors round-to-nearest would have produced
(so the .pte lowers to XNNPACK unchanged).

The algorithm itself lives in :mod:`optimize.quant.gptq`; this module is the stage's glue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from optimize.stage_api import StageContext
from optimize.stages.ptq_config import GptqOptions, Ptq8Config

if TYPE_CHECKING:
    from optimize.quant.gptq import GptqLayerResult


def _weight_scheme(cfg: Ptq8Config, int8: bool):
    from optimize.quant.fakequant import scheme_for

    return scheme_for("8da8w", None) if int8 or cfg.scheme == "8da8w" else scheme_for("8da4w", cfg.effective_group_size)


def install_integers(module: nn.Linear, q: torch.Tensor, scale: torch.Tensor, bits: int, source: str = "GPTQ") -> None:
    """Put integer weights and their symmetric scales into the module as torchao's
    ``IntxUnpackedToInt8Tensor``: the layout round-to-nearest produces, which ExecuTorch lowers to
    XNNPACK unchanged (GPTQ's result, or a source checkpoint's own grid)."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    deq = (q.float().unflatten(-1, (scale.shape[1], -1)) * scale.float().unsqueeze(-1)).flatten(-2)
    # built in float32: dividing a bf16 weight by a bf16 scale moves integers off the grid (a
    # compute_dtype bfloat16 run); the integers are what the .pte runs, so only the scale is cast
    t = IntxUnpackedToInt8Tensor.from_hp(
        deq, (1, q.shape[1] // scale.shape[1]), torch.int4 if bits == 4 else torch.int8,
        activation_quantization="int8_asym_per_token", intx_choose_qparams_algorithm=None,
        custom_scale=scale.float(), custom_zero_point=torch.zeros_like(scale, dtype=torch.int8),
    )
    if not torch.equal(t.qdata, q.to(t.qdata.device)):  # the grid must survive the round trip exactly, or the .pte drifts
        raise RuntimeError(f"{source} integers changed when building the torchao tensor ({(t.qdata != q).sum()} values)")
    if module.weight.dtype != torch.float32:
        t = t.to(module.weight.dtype)  # the scale (and the output) in the model's dtype; qdata unchanged
    module.weight = nn.Parameter(t, requires_grad=False)


def quantize_gptq(model: nn.Module, cfg: Ptq8Config, ctx: StageContext, four: list[str], eight: list[str]) -> dict:
    """Run GPTQ over the int4 (``four``) and int8 (``eight``) Linears and install the results;
    returns the details for the report."""
    from optimize.quant.gptq import gptq_model
    from optimize.quant.host_independent import resolve

    if not ctx.calibration:
        raise ValueError("ptq_int8: algorithm gptq needs calibration text; set data.calibration_tokens > 0")
    opts = cfg.gptq or GptqOptions()
    targets = {n: _weight_scheme(cfg, False) for n in four} | {n: _weight_scheme(cfg, True) for n in eight}
    was_training = model.training
    model.eval()
    calib_dtype = resolve(model, opts.calibration_dtype, ctx.device)
    ctx.progress(phase="gptq", event="begin")
    res = gptq_model(model, targets, ctx.calibration[: opts.calibration_windows], damp=opts.damp,
                     block_size=opts.block_size, act_order=opts.act_order, scale_init=opts.scale_init, log=ctx.log,
                     device=ctx.device, progress=ctx.progress, calibration_dtype=calib_dtype)
    ctx.progress(phase="gptq", event="end")
    model.train(was_training)
    summary = res.summary()
    if opts.damp == "auto" and ctx.log:
        ctx.log(f"gptq damp auto: layers per chosen damp {summary['damp_counts']}")
    for name, r in res.layers.items():
        install_integers(model.get_submodule(name), r.q, r.scale, targets[name].bits)
    used = calib_dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {**summary, **opts.model_dump(), "calibration_dtype_used": str(used).removeprefix("torch.")}
