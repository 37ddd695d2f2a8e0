"""Sequential GPTQ over a model: block by block in model order, each block calibrated on what
the blocks before it, already quantized, output.

The per-layer algorithm is :mod:`optimize.quant.gptq`; this module feeds it: Hessians from
forward hooks (:mod:`optimize.quant.calibration_hooks`), the Linears that read one input solved together
(:func:`shared_input_groups`), the calibration windows carried from block to block
(:class:`~optimize.quant.block_inputs.BlockChain`), one block at a time on a compute device, and
each result handed to the caller as soon as nothing reads its float weight again.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from optimize.device import model_device, on_device
from optimize.quant.block_inputs import BlockChain
from optimize.quant.calibration_hooks import HessianCollector, StopAfterLastInput, StopForward
from optimize.quant.fakequant import WeightScheme
from optimize.quant.gptq import Damp, GptqLayerResult, ScaleInit, gptq_layers
from optimize.quant.gptq_cache import GptqBlockCache
from optimize.quant.gptq_rows import row_graphs
from optimize.quant.host_independent import calibrating_in, casts
from optimize.resources import release_free_heap
from targets.moe import expert_linears
from train.model_parts import block_of, decoder_blocks


def _install_cached_blocks(model: nn.Module, hit, chain: BlockChain, result: GptqRunResult, home: torch.device,
                           release, log) -> None:
    """An earlier run's GPTQ of the same blocks (:mod:`optimize.quant.gptq_cache`): its grid values go
    into the weights and its hidden states after the last block into the chain, as if computed here."""
    for name, res in hit.layers.items():
        res.dequantize_into(model.get_submodule(name).weight.data)
        result.layers[name] = res.to(home)
    chain.hidden = [h.to(device=c.device, dtype=c.dtype) for h, c in zip(hit.hidden, chain.hidden)]
    result.tokens, result.steps, result.blocks_cache = hit.tokens, list(hit.steps), "reused"
    if release is not None:
        release(dict(hit.layers))
    if log:
        log(f"gptq: the {len(hit.layers)} decoder-block layers reused from an earlier run of the same blocks "
            "(stage cache)")


def _untie(model: nn.Module, names: list[str]) -> None:
    """Give each target Linear its own weight if it shares one (a tied lm_head shares the embedding)."""
    owners: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    for n in names:
        lin = model.get_submodule(n)
        if owners.get(id(lin.weight), 0) > 1:
            lin.weight = nn.Parameter(lin.weight.detach().clone(), requires_grad=lin.weight.requires_grad)


@dataclass
class GptqRunResult:
    layers: dict[str, GptqLayerResult] = field(default_factory=dict)
    tokens: int = 0
    #: the blocks (or "outside blocks") calibrated, in order
    steps: list[str] = field(default_factory=list)
    #: seconds in the calibration forwards (Hessians) and in GPTQ's solves, summed over the blocks
    calibrate_s: float = 0.0
    solve_s: float = 0.0
    #: :meth:`RowGraphs.summary` where the column loop ran as CUDA graphs
    cuda_graphs: dict | None = None
    #: what the blocks' cache did (:mod:`optimize.quant.gptq_cache`): "reused", "stored", or None without one
    blocks_cache: str | None = None
    #: a mixture of experts: the calibration tokens routed to each expert Linear; one that got none is
    #: solved with an identity Hessian, which makes GPTQ round to nearest
    expert_tokens: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict:
        rtn = [r.rel_error_rtn for r in self.layers.values()]
        gq = [r.rel_error_gptq for r in self.layers.values()]
        n = max(len(rtn), 1)
        return {
            "layers": len(self.layers),
            "calibration_tokens": self.tokens,
            "mean_rel_output_error_rtn": round(sum(rtn) / n, 6),
            "mean_rel_output_error_gptq": round(sum(gq) / n, 6),
            "output_error_reduction": round(1.0 - sum(gq) / max(sum(rtn), 1e-30), 4),
            "damp_counts": _counts(r.damp for r in self.layers.values()),
            **({"expert_linears": len(self.expert_tokens),
                "expert_linears_without_tokens": sorted(n for n, t in self.expert_tokens.items() if not t),
                "expert_tokens_min_max": [min(self.expert_tokens.values()), max(self.expert_tokens.values())]}
               if self.expert_tokens else {}),
            "damp_by_projection": {kind: _counts(r.damp for n, r in self.layers.items() if n.rsplit(".", 1)[-1] == kind)
                                   for kind in sorted({n.rsplit(".", 1)[-1] for n in self.layers})},
        }

    def timing(self) -> dict:
        """Where the run's time went (apart from :meth:`summary`, whose figures repeat run to run)."""
        return {"calibrate_s": round(self.calibrate_s, 2), "solve_s": round(self.solve_s, 2),
                **({"cuda_graphs": self.cuda_graphs} if self.cuda_graphs else {}),
                **({"blocks_cache": self.blocks_cache} if self.blocks_cache else {})}


def shared_input_groups(names: list[str], hessians: dict[str, torch.Tensor],
                        targets: dict[str, WeightScheme]) -> list[list[str]]:
    """``names`` grouped by identical Hessian and scheme, in first-seen order: the Linears that
    read one input (q/k/v, gate/up) accumulated the very same ``x^T x`` sums, so equality is exact."""
    groups: list[list[str]] = []
    for name in names:
        for group in groups:
            first = group[0]
            if targets[first] == targets[name] and torch.equal(hessians[first], hessians[name]):
                group.append(name)
                break
        else:
            groups.append([name])
    return groups


def _clock(device: torch.device) -> float:
    """Wall time after the device's queued work (CUDA runs ahead of the host)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _counts(values) -> dict[str, int]:
    """How many layers used each damping fraction, smallest first (keys as ``f"{d:g}"``)."""
    out: dict[float, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return {f"{k:g}": out[k] for k in sorted(out)}


@torch.no_grad()
def gptq_model(
    model: nn.Module,
    targets: dict[str, WeightScheme],
    windows: list[torch.Tensor],
    *,
    damp: Damp = 0.01,
    block_size: int = 128,
    act_order: bool = True,
    scale_init: ScaleInit = "absmax",
    log: Callable[[str], None] | None = None,
    device: torch.device | None = None,
    progress: Callable[..., None] | None = None,
    calibration_dtype: torch.dtype | None = None,
    install: Callable[[str, GptqLayerResult], None] | None = None,
    blocks_cache: Path | None = None,
) -> GptqRunResult:
    """Sequential GPTQ over the named Linears, with the calibration forward in ``calibration_dtype``.

    ``install(name, result)`` puts a Linear's integers into the model (the caller's runtime
    tensors); every target gets it once. On the block chain it runs as soon as no later
    calibration forward reads the Linear's weight (its block has fed the next one), so the model's
    float weights and GPTQ's integers are never both held for every layer at once (a 1B-class
    model's run on the CPU peaked at 5.45 GiB instead of 6.35). Where the model is cast for the
    calibration, or each block calibrates from the model's input, it runs at the end.

    ``calibration_dtype`` (e.g. float64): the model is cast to it for the calibration forwards
    and back to its own dtype afterwards (both casts exact: fp32/bf16 values are float64 values,
    and the installed weights are GPTQ's grid values). Why: in fp32 the activations that build the
    Hessians differ in their last bits between the CPU's vector paths (``ATEN_CPU_CAPABILITY``
    default/avx2/avx512), GPTQ's rounding decisions follow them, and 19% of SmolLM2's int4 weights
    (its first six blocks) came out different between two paths of one machine; with the forward
    in float64, none did (:mod:`optimize.quant.host_independent`). See :func:`_gptq_model` for the
    algorithm.

    ``blocks_cache`` (a directory): the decoder blocks' results are reused from there when an earlier
    run quantized the same blocks of the same model on the same windows, and kept there otherwise
    (:mod:`optimize.quant.gptq_cache`); only the head is then calibrated and solved.
    """
    installed: set[str] = set()

    def release(done: dict[str, GptqLayerResult]) -> None:
        for name, res in done.items():
            install(name, res)
            installed.add(name)

    cast = casts(model, calibration_dtype)
    # float64 for the norms, attention and activations, float32 for the Linears' products
    # (host_independent.linears_in: the same on every ATen path, in about half the time)
    with row_graphs() as graphs, calibrating_in(model, calibration_dtype):
        result = _gptq_model(model, targets, windows, damp=damp, block_size=block_size, act_order=act_order,
                             scale_init=scale_init, log=log, device=device, progress=progress,
                             release=release if install is not None and not cast else None,
                             blocks_cache=blocks_cache)
    if graphs.captured or graphs.disabled:
        result.cuda_graphs = graphs.summary()
    if install is not None:
        release({name: res for name, res in result.layers.items() if name not in installed})
    return result


def _gptq_model(
    model: nn.Module,
    targets: dict[str, WeightScheme],
    windows: list[torch.Tensor],
    *,
    damp: Damp = 0.01,
    block_size: int = 128,
    act_order: bool = True,
    scale_init: ScaleInit = "absmax",
    log: Callable[[str], None] | None = None,
    device: torch.device | None = None,
    progress: Callable[..., None] | None = None,
    release: Callable[[dict[str, GptqLayerResult]], None] | None = None,
    blocks_cache: Path | None = None,
) -> GptqRunResult:
    """Sequential GPTQ over the named Linears (name -> scheme), block by block in model order.

    Each decoder block calibrates on what the blocks before it, already quantized, output for
    the calibration windows (cached between blocks by
    :class:`~optimize.quant.block_inputs.BlockChain`, so each block runs twice per window: once
    to calibrate, once quantized to feed the next; the head then reads the chain's last outputs;
    models whose blocks do not simply feed each other run the model prefix again for every
    block, as before); the block's Linears are then quantized from the
    Hessians of the inputs they received, and their fp32 weights replaced by the de-quantized
    GPTQ values (exactly on the grid), so later blocks calibrate on what the quantized model
    computes. Linears outside the decoder blocks (``lm_head``) come last.
    The caller turns the returned integers and scales into its runtime's tensors.

    ``device`` is where the blocks compute. With the chain, a model kept elsewhere (a large model
    on the CPU, the GPU as ``device``) has one decoder block at a time moved there, together
    with the carried hidden states, and back once it is quantized; what lies outside the blocks
    (and the slower path without the chain) runs where the model is. None, or the model's own
    device: everything runs where the model is. The windows are moved to the model.
    ``release`` gets each step's results once no later forward reads their weights (on the chain
    only; see :func:`gptq_model`). A tied target (``lm_head``) is untied when its turn comes, so
    the copy is not held while the blocks are solved.
    """
    if not windows:
        raise ValueError("GPTQ needs calibration windows (ctx.calibration is empty)")
    home = model_device(model)
    windows = [w.to(home) for w in windows]
    blocks = [name for name, _ in decoder_blocks(model)]
    stages: dict[str | None, list[str]] = {}
    for name in targets:
        stages.setdefault(block_of(name, blocks), []).append(name)
    order = [b for b in blocks if b in stages] + ([None] if None in stages else [])
    result = GptqRunResult()
    # a mixture of experts' Linears run on the tokens routed to them (targets/moe.py): their Hessians
    # are their own tokens' (maybe none)
    routed = set(expert_linears(model))

    def calibrate_and_quantize(names: list[str], feeds: list[Callable[[], None]], label: str) -> None:
        """Feed the windows (one callable each) with Hessian hooks on ``names``, then GPTQ them."""
        t_feed = _clock(device or home)
        collector = HessianCollector(model, names, targets[names[0]] if targets[names[0]].act_int8 else None)
        stopper = StopAfterLastInput(model, names)
        try:
            for feed in feeds:
                stopper.window(feed)
        finally:
            stopper.close()
            collector.close()
        result.tokens = max(result.tokens, max(collector.tokens.values(), default=0))
        for name in names:
            if name in routed:
                result.expert_tokens[name] = collector.tokens.get(name, 0)
            if name in collector.h:
                continue
            if name not in routed:
                raise ValueError(f"GPTQ: {name} received no input during calibration (is it used in forward?)")
            # an expert no calibration token was routed to: no data weights its errors, and with
            # H = I GPTQ rounds to nearest (a zero Hessian would zero its "dead" columns instead)
            lin = model.get_submodule(name)
            collector.h[name] = torch.eye(lin.in_features, dtype=torch.float64, device=lin.weight.device)
        t0 = _clock(device or home)
        result.calibrate_s += t0 - t_feed
        # GPTQ each group of Linears that read one input (q/k/v, gate/up) from its Hessian; install
        # the de-quantized grid values
        _untie(model, names)
        for group in shared_input_groups(names, collector.h, targets):
            lins = [model.get_submodule(name) for name in group]
            hessian = collector.h.pop(group[0])
            for name in group[1:]:
                del collector.h[name]
            outs = gptq_layers([lin.weight for lin in lins], hessian, targets[group[0]], damp=damp,
                               block_size=block_size, act_order=act_order, scale_init=scale_init,
                               consume_hessian=damp != "auto")
            del hessian
            for name, lin, res in zip(group, lins, outs):
                res.dequantize_into(lin.weight.data)
                result.layers[name] = res.to(home)  # kept beside the model, not on the block's compute device
        result.solve_s += _clock(device or home) - t0
        if log:
            log(f"gptq {len(result.steps) + 1}/{len(order)} {label}: {len(names)} layers")
        if progress:  # a bar (step = block) on a terminal, an event for a run_pipeline callback
            progress(len(result.steps) + 1, len(order), phase="gptq", message=str(label), layers=len(names))
        result.steps.append(label)

    chain = BlockChain.capture(model, blocks, windows) if blocks and any(b is not None for b in order) else None
    if chain is not None and not chain.ok:
        if log:
            log(f"gptq: {chain.why}; calibrating each block from the model's input instead (slower)")
        chain = None
    rest = order
    if chain is not None:
        # each block calibrates on the cached outputs of the (already quantized) blocks before it:
        # two forwards of that block per window instead of a forward through every earlier block
        outside = None in stages
        chain.to(device or home)
        in_blocks = {n: s for n, s in targets.items() if block_of(n, blocks) is not None}
        cache = None
        if blocks_cache is not None and in_blocks:
            cache = GptqBlockCache.for_run(blocks_cache, model, windows, in_blocks,
                                           {"damp": damp, "block_size": block_size, "act_order": act_order,
                                            "scale_init": scale_init}, device)
        with cache.lock() if cache is not None and cache.key is not None else contextlib.nullcontext():
            hit = cache.load() if cache is not None else None
            if hit is not None:
                _install_cached_blocks(model, hit, chain, result, home, release, log)
            else:
                for i, block in enumerate(blocks):
                    with on_device(chain.mods[i], device):
                        if block in stages:
                            calibrate_and_quantize(stages[block], [lambda i=i, j=j: chain.run_block(i, j)
                                                                   for j in range(len(windows))], block)
                        if i < len(blocks) - 1 or outside:
                            chain.advance(i)
                    if release is not None and block in stages:  # the next block has its input: nothing reads these again
                        release({name: result.layers[name] for name in stages[block]})
                    release_free_heap()  # the block's Hessians and row chunks, before the next block's
                if cache is not None and cache.key is not None and outside:
                    cache.store({n: result.layers[n] for n in in_blocks}, chain.hidden, result.tokens, result.steps)
                    result.blocks_cache = "stored"
        if outside:
            # the Linears outside the blocks (lm_head) read what the quantized blocks output: the
            # blocks answer from the chain, so only the embedding, final norm and head run again
            def feed_from_chain(j: int, w: torch.Tensor) -> None:
                with chain.replay(j):
                    model(w.view(1, -1), use_cache=False)

            calibrate_and_quantize(stages[None], [lambda j=j, w=w: feed_from_chain(j, w) for j, w in enumerate(windows)],
                                   "outside blocks")
            if release is not None:
                release({name: result.layers[name] for name in stages[None]})
        rest = []
    for block in rest:
        stop = None
        if block is not None and block != blocks[-1]:
            def _halt(_m, _a, _o):
                raise StopForward
            stop = model.get_submodule(block).register_forward_hook(_halt)

        def feed_from_input(w: torch.Tensor) -> None:
            try:
                model(w.view(1, -1))
            except StopForward:
                pass

        try:
            calibrate_and_quantize(stages[block], [lambda w=w: feed_from_input(w) for w in windows],
                                   block or "outside blocks")
        finally:
            if stop is not None:
                stop.remove()
    return result
