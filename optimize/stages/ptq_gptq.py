"""GPTQ for ``ptq_int8``: running it with the stage's settings (:class:`GptqOptions`), and
installing its integers and scales as the torchao tensors round-to-nearest would have produced
(so the .pte lowers to XNNPACK unchanged).

The algorithm itself lives in :mod:`optimize.quant.gptq` (one layer) and
:mod:`optimize.quant.gptq_sequential` (a model, block by block); this module is the stage's glue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from optimize.quant.fakequant import scheme_for
from optimize.quant.gptq import grid_values
from optimize.quant.gptq_sequential import gptq_model
from optimize.quant.host_independent import resolve
from optimize.stage_api import StageContext
from optimize.stages.ptq_config import GptqOptions, Ptq8Config

if TYPE_CHECKING:
    from optimize.quant.gptq import GptqLayerResult


def _weight_scheme(cfg: Ptq8Config, int8: bool):
    return scheme_for("8da8w", None) if int8 or cfg.scheme == "8da8w" else scheme_for("8da4w", cfg.effective_group_size)


#: rows of a weight de-quantized at a time when :func:`install_integers` checks its integers (float32:
#: a 128256 x 2048 output head is 1 GiB a copy, and the whole-matrix check took about three of them)
INSTALL_ROWS = 4096


def install_integers(module: nn.Linear, q: torch.Tensor, scale: torch.Tensor, bits: int, source: str = "GPTQ") -> None:
    """Put integer weights and their symmetric scales into the module as torchao's
    ``IntxUnpackedToInt8Tensor``: the layout round-to-nearest produces, which ExecuTorch lowers to
    XNNPACK unchanged (GPTQ's result, or a source checkpoint's own grid).

    The tensor is the one ``IntxUnpackedToInt8Tensor.from_hp(q * scale, custom_scale=scale,
    custom_zero_point=0)`` builds, field for field: its integers are torchao's own
    ``quantize_affine`` of the de-quantized values, and that must give ``q`` back exactly (else the
    .pte would drift from what was calibrated), so the round trip is checked, but
    :data:`INSTALL_ROWS` rows at a time. Why: ``from_hp`` on the whole matrix holds the float32
    de-quantized weight and its temporaries at once, about 3 GiB for a 1B model's 128256-row
    output head, which set ``ptq_int8``'s peak RSS on the CPU; the integers are then ``q`` itself."""
    from torchao.quantization import IntxUnpackedToInt8Tensor
    from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS, quantize_affine

    target = torch.int4 if bits == 4 else torch.int8
    qmin, qmax = _DTYPE_TO_QVALUE_BOUNDS[target]
    groups = scale.shape[1]
    block = (1, q.shape[1] // groups)
    # built in float32: dividing a bf16 weight by a bf16 scale moves integers off the grid (a
    # compute_dtype bfloat16 run); the integers are what the .pte runs, so only the scale is cast
    scale32 = scale.float()
    zero = torch.zeros_like(scale, dtype=torch.int8)
    changed = 0
    for r0 in range(0, q.shape[0], INSTALL_ROWS):
        rows = slice(r0, r0 + INSTALL_ROWS)
        deq = grid_values(q[rows], scale32[rows])
        back = quantize_affine(deq, block, scale32[rows], zero[rows], output_dtype=torch.int8, quant_min=qmin,
                               quant_max=qmax)
        changed += int((back != q[rows].to(back.device)).sum())
    if changed:  # the grid must survive the round trip exactly, or the .pte drifts
        raise RuntimeError(f"{source} integers changed when building the torchao tensor ({changed} values)")
    qdata = q.to(torch.int8)
    if qdata is q and (not q.is_contiguous() or q.untyped_storage().nbytes() != q.numel()):
        qdata = q.clone(memory_format=torch.contiguous_format)  # its own storage, as from_hp's (not a view of stacked q/k/v rows)
    t = IntxUnpackedToInt8Tensor(qdata=qdata, scale=scale32, zero_point=zero, target_dtype=target, block_size=block,
                                 dtype=torch.float32, activation_quantization="int8_asym_per_token")
    if module.weight.dtype != torch.float32:
        t = t.to(module.weight.dtype)  # the scale (and the output) in the model's dtype; qdata unchanged
    module.weight = nn.Parameter(t, requires_grad=False)


def quantize_gptq(model: nn.Module, cfg: Ptq8Config, ctx: StageContext, four: list[str], eight: list[str]) -> dict:
    """Run GPTQ over the int4 (``four``) and int8 (``eight``) Linears and install the results;
    returns the details for the report."""
    if not ctx.calibration:
        raise ValueError("ptq_int8: algorithm gptq needs calibration text; set data.calibration_tokens > 0")
    opts = cfg.gptq or GptqOptions()
    targets = {n: _weight_scheme(cfg, False) for n in four} | {n: _weight_scheme(cfg, True) for n in eight}
    was_training = model.training
    model.eval()
    calib_dtype = resolve(model, opts.calibration_dtype, ctx.device)
    ctx.progress(phase="gptq", event="begin")

    def install(name: str, r: GptqLayerResult) -> None:  # as soon as GPTQ is done with the layer
        install_integers(model.get_submodule(name), r.q, r.scale, targets[name].bits)

    res = gptq_model(model, targets, ctx.calibration[: opts.calibration_windows], damp=opts.damp,
                     block_size=opts.block_size, act_order=opts.act_order, scale_init=opts.scale_init, log=ctx.log,
                     device=ctx.device, progress=ctx.progress, calibration_dtype=calib_dtype, install=install,
                     blocks_cache=ctx.cache_dir / "gptq" if ctx.cache_dir is not None else None)
    ctx.progress(phase="gptq", event="end")
    model.train(was_training)
    summary = res.summary()
    ctx.details["gptq_timing"] = res.timing()
    if opts.damp == "auto" and ctx.log:
        ctx.log(f"gptq damp auto: layers per chosen damp {summary['damp_counts']}")
    used = calib_dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return {**summary, **opts.model_dump(), "calibration_dtype_used": str(used).removeprefix("torch.")}
