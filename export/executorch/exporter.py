"""ExecuTorch target: a decoder-only LM as a ``.pte`` with a static KV cache, delegated to XNNPACK.

Attention and the KV cache run through ExecuTorch's LLM custom ops (``llama::custom_sdpa``,
``llama::update_cache``; ring buffers for sliding-window layers) wired in by
:mod:`export.executorch.llm`; everything else (projections, RMSNorm, MLP, lm_head) is
delegated to XNNPACK. ``forward(tokens[1, T], input_pos[T])`` serves both prefill (up to
``get_max_seq_len`` tokens a call: the whole cache, or a sliding window) and decode and returns
logits for every fed position, so one program is used for generation and for perplexity.
Metadata methods (``get_max_seq_len``, ``get_max_context_len``, ``get_vocab_size``,
``get_bos_id``, ``get_eos_ids``, ``tokenizer_type``...) let ExecuTorch's C++ text runner,
TorchChat and :class:`ExecuTorchRunner` size themselves from the file alone.

Quantization: a model that an earlier stage quantized with torchao is exported as given
(``quantize: none``); users who skip that stage can ask for 8da4w/8da8w here. int8
weight-only is refused: lowered to XNNPACK it returns wrong logits (see the regression test).
:meth:`ExecuTorchExporter.check_model` refuses at validation what this path cannot export.
"""

from __future__ import annotations

import copy
import json
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from targets.atomic import atomic_dir, sha256_file
from targets.moe import dense_experts
from export.base import EXECUTORCH_TOOLCHAIN, DraftSpec, ExportError, ExportOptions, ExportResult, Exporter
from export.base import eos_token_ids, package_versions
from export.executorch.inspection import _check_custom_ops, _delegation, _program_calls
from export.executorch.options import ExecuTorchOptions, _resolve_max_seq_len, model_problems
from export.executorch.quant import apply_quantization, _is_lm_head, _refuse_weight_only, exported_linear_schemes
from export.executorch.runner import SCORING_METHOD, VERIFY_METHOD, ExecuTorchRunner
from export.precision import (
    check_mix,
    linear_scheme,
    mix_details,
    module_schemes,
    quantization_mix,
)

PTE_NAME = "model.pte"
#: external weights (``weights: external``): ``<tag>.ptd`` beside the program
PTD_TAG = "model"
PTD_NAME = f"{PTD_TAG}.ptd"
MANIFEST_NAME = "manifest.json"


# ---------------------------------------------------------------------------------------------
# export


def _tokenizer_type(tokenizer: Any) -> int:
    """TorchChat's convention: 2 for a SentencePiece model file, 3 for tiktoken/BPE (tokenizer.json)."""
    vocab_file = str(getattr(tokenizer, "vocab_file", "") or "")
    return 2 if vocab_file.endswith(".model") else 3


def _cast_floats(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast plain floating parameters and buffers to ``dtype`` (quantized weights keep their own)."""
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if type(p) in (torch.Tensor, torch.nn.Parameter) and p.is_floating_point() and p.dtype != dtype:
                setattr(mod, name, torch.nn.Parameter(p.detach().to(dtype), requires_grad=False))
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is not None and type(b) is torch.Tensor and b.is_floating_point() and b.dtype != dtype:
                mod._buffers[name] = b.to(dtype)


def _metadata(model, tokenizer, opts: ExecuTorchOptions, n: int, chunk: int, plan) -> dict:
    config = model.config
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        bos = getattr(config, "bos_token_id", None)
    meta = {
        # ExecuTorch's LLM runners: get_max_seq_len = most tokens one forward takes (the prefill
        # chunk), get_max_context_len = KV-cache positions
        "get_max_seq_len": chunk,
        "get_max_context_len": n,
        "get_max_prefill_chunk": chunk,
        "get_vocab_size": int(model.get_input_embeddings().num_embeddings),
        "get_bos_id": int(bos) if bos is not None else -1,
        "get_eos_ids": eos_token_ids(model, tokenizer) or [-1],
        "use_kv_cache": True,
        "enable_dynamic_shape": True,
        "use_sdpa_with_kv_cache": True,
        "tokenizer_type": opts.tokenizer_type if opts.tokenizer_type is not None else _tokenizer_type(tokenizer),
    }
    if plan.windows:
        meta["sliding_window"] = min(plan.windows)
    return meta



def _export_decoder(decoder, chunk: int, plan, eager_schemes: dict, rows: int = 1
                    ) -> tuple[torch.export.ExportedProgram, dict]:
    """torch.export one decoder wrapper and run the graph passes every method gets (see lower_program)."""
    from export.executorch.delegable import split_as_slices, static_reshapes
    from export.executorch.fusion import merge_duplicate_linears
    from export.executorch.head_layout import cancel_head_transposes
    from export.executorch.joint_rope import rope_q_and_k_together

    seq = torch.export.Dim("seq_len", min=1, max=chunk)
    example = min(4, chunk)
    try:
        with torch.no_grad():
            ep = torch.export.export(
                decoder.eval(),
                (torch.zeros(1, example, dtype=torch.long), torch.arange(example)),
                dynamic_shapes=({1: seq}, {0: seq}),
                strict=True,
            )
    except Exception as exc:
        raise ExportError(f"torch.export of {type(decoder.model).__name__} with ExecuTorch's LLM ops failed: "
                          f"{exc}") from exc
    passes = {"reshapes": static_reshapes(ep), "splits": split_as_slices(ep), "custom_ops": _check_custom_ops(ep, plan, rows)}
    passes["graph_schemes"] = exported_linear_schemes(ep)
    check_mix(eager_schemes, passes["graph_schemes"])
    # after the scheme check (which reads every member's own linear): one GEMM per fused group
    passes["merged"] = merge_duplicate_linears(ep)
    # q, k and v stay [B, T, H, D] from the projections to the cache ops (export/executorch/head_layout.py)
    passes["transposes"] = cancel_head_transposes(ep)
    passes["joint_rope"] = rope_q_and_k_together(ep)  # then one RoPE chain for both (export/executorch/joint_rope.py)
    return ep, passes


def lower_to_pte(model: torch.nn.Module, tokenizer: Any, opts: ExecuTorchOptions, *, log=print,
                 **draft) -> tuple[bytes, dict]:
    """One self-contained program: :func:`lower_program` with the weights embedded (``draft`` and
    ``draft_vocab`` passed through).

    Returns the program bytes and details (delegation, custom ops, quantization mix, timings).
    """
    if opts.weights != "embedded":
        raise ExportError("lower_to_pte returns one self-contained program; weights: external needs lower_program")
    pte, _, details = lower_program(model, tokenizer, opts, log=log, **draft)
    return pte, details


#: (embedding scheme, lm_head scheme) of a tied pair whose bytes are identical in model.ptd
SHARED_PAIRS = (("fp32", "fp32"), ("int8", "8da8w"))


def _tag_weights_external(ep: torch.export.ExportedProgram) -> None:
    """Send every parameter and constant to the external data file, the delegated ones too
    (XNNPACK reads the tag from its weight nodes): the data file stores identical bytes once."""
    sig = ep.graph_signature
    consts = set(sig.inputs_to_parameters) | set(sig.inputs_to_lifted_tensor_constants)
    tagged = set()
    for node in ep.graph.nodes:
        # a quantized weight reaches XNNPACK as the dequantize node over its int8/int4 data, and
        # XNNPACK reads the tag from that node: everything computed from constants alone is tagged
        inputs = node.all_input_nodes
        if (node.op == "placeholder" and node.name in consts) or (
                node.op == "call_function" and inputs and all(i in tagged for i in inputs)):
            node.meta.setdefault("custom", {})["delegate_constant_tag"] = PTD_TAG
            tagged.add(node)


def _prepared(model: torch.nn.Module, opts: ExecuTorchOptions, dtype: torch.dtype,
              head_ids: list[int] | None = None) -> tuple[torch.nn.Module, dict]:
    """A copy of ``model`` ready to trace: experts dense, floats cast, quantized as ``opts`` asks
    (``head_ids``: first restricted to those output rows, a draft's partial vocabulary), RMSNorm and
    tanh-GELU in XNNPACK's ops, projections fused; with what was done, for the details."""
    from export.executorch.delegable import swap_rms_norms, swap_tanh_gelus
    from export.executorch.draft import restrict_head
    from export.executorch.fusion import fuse_projections

    # Work on a copy: quantize_, the norm swap and the attention switch mutate the module, and
    # the pipeline keeps using the model it handed us.
    model = copy.deepcopy(model).eval()
    # a mixture of experts runs every expert on every token, weighted by its routing weight (0 where
    # not routed): the same function, with no data-dependent shapes for torch.export (targets/moe.py)
    experts = dense_experts(model)
    _cast_floats(model, dtype)
    if head_ids is not None:
        restrict_head(model, head_ids)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    decided = apply_quantization(model, opts)
    _refuse_weight_only(model)
    facts = {"experts": experts, "tied": tied, "decided": decided, "mix": quantization_mix(model),
             "eager_schemes": module_schemes(model)}
    facts["norms"] = swap_rms_norms(model)
    facts["gelus"] = swap_tanh_gelus(model)
    facts["fusion"] = fuse_projections(model) if opts.fuse_projections else None
    return model, facts


def lower_program(model: torch.nn.Module, tokenizer: Any, opts: ExecuTorchOptions, *,
                  draft: torch.nn.Module | None = None, draft_vocab: list[int] | None = None,
                  log=print) -> tuple[bytes, bytes | None, dict]:
    """Quantize a copy of ``model`` as ``opts`` asks, swap in ExecuTorch's LLM ops, export, lower.

    Attention and the KV cache go through ``llama::custom_sdpa`` / ``llama::update_cache``
    (:mod:`export.executorch.llm`); everything else is delegated to XNNPACK. ``draft`` (a small model
    sharing the tokenizer) becomes the ``draft`` method beside ``verify`` (``draft_vocab``: its head's
    token ids, a partial vocabulary; :mod:`export.executorch.draft`). Returns the program, the external
    weights (``weights: external``, else None) and details.
    """
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    from export.executorch.draft import DRAFT_METHOD, DRAFT_VOCAB_META, DraftDecoder, own_bytes
    from export.executorch.llm import ExecuTorchDecoder, _text_config, plan_layers
    from export.executorch.xnnpack_boundaries import count_residual_adds
    from export.executorch.lowering_cost import (applicable_passes_only, in_place_legalize,
                                                  no_op_decompositions_skipped, without_provenance)
    from export.executorch.xnnpack_slices import dynamic_slices, partitioner_configs

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_input_embeddings"):
        raise ExportError("the ExecuTorch exporter takes a Hugging Face causal LM (a PreTrainedModel with a config)")
    n = _resolve_max_seq_len(opts)
    problems = model_problems(config, opts)
    if problems:
        raise ExportError("; ".join(problems))
    plan = plan_layers(config, n)
    dtype = getattr(torch, opts.dtype)
    if draft is not None and not opts.verify_tokens:
        raise ExportError("a draft model is verified by the verify method: set verify_tokens (for example 5)")
    model, facts = _prepared(model, opts, dtype)
    experts, tied, decided, mix, eager_schemes, norms, gelus, fusion = (
        facts[k] for k in ("experts", "tied", "decided", "mix", "eager_schemes", "norms", "gelus", "fusion"))

    timings = {}
    t0 = time.perf_counter()
    chunk = plan.max_chunk
    log(f"executorch: torch.export (max_seq_len={n}, prefill chunk {chunk}, linear layers: {mix})")
    ep, passes = _export_decoder(ExecuTorchDecoder(model, plan, dtype=dtype, last_logits=opts.logits == "last"),
                                 chunk, plan, eager_schemes)
    programs = {"forward": ep}
    scoring = bool(opts.scoring_method) and opts.logits == "last"
    if scoring:  # same weights (stored once: XNNPACK keys them by sha256, the emitter dedups constants)
        programs[SCORING_METHOD], _ = _export_decoder(
            ExecuTorchDecoder(model, plan, dtype=dtype, last_logits=False).eval(), chunk, plan, eager_schemes)
    rows = opts.verify_tokens
    if rows:  # speculative decoding's verification calls, on forward's cache (shared mutable buffers below)
        programs[VERIFY_METHOD], _ = _export_decoder(
            ExecuTorchDecoder(model, plan, dtype=dtype, verify_rows=rows).eval(), rows, plan, eager_schemes, rows)
    drafted = None
    if draft is not None:  # its own cache (buffers named draft.*), every constant it shares with the target stored once
        problems = model_problems(draft.config, opts)
        if problems:
            raise ExportError("draft model: " + "; ".join(problems))
        dmodel, dfacts = _prepared(draft, opts, dtype, head_ids=draft_vocab)
        dplan = plan_layers(dmodel.config, n)
        programs[DRAFT_METHOD], dpasses = _export_decoder(
            DraftDecoder(ExecuTorchDecoder(dmodel, dplan, dtype=dtype, last_logits=True)).eval(), chunk, dplan,
            dfacts["eager_schemes"])
        drafted = {"method": DRAFT_METHOD, "layers": len(dplan.layers), "linear": dfacts["mix"],
                   "vocab": len(draft_vocab) if draft_vocab is not None else None, **own_bytes(dmodel, model)}
        del dmodel
    timings["torch_export_s"] = time.perf_counter() - t0
    reshapes, splits, custom_ops, graph_schemes, merged, transposes, joint_rope = (
        passes[k] for k in ("reshapes", "splits", "custom_ops", "graph_schemes", "merged", "transposes", "joint_rope"))
    meta = _metadata(model, tokenizer, opts, n, chunk, plan)
    if draft_vocab is not None:
        meta[DRAFT_VOCAB_META] = [int(t) for t in draft_vocab]
    external = opts.weights == "external"
    if external:
        for program in programs.values():
            _tag_weights_external(program)
    # each layer as three delegates, split at its residual adds (export/executorch/xnnpack_boundaries.py)
    hidden = getattr(_text_config(config), "hidden_size", None) if opts.split_layers else None
    log("executorch: lowering to XNNPACK (minutes for a full-size model)")
    t0 = time.perf_counter()
    skipped: dict[str, int] = {}
    decompositions_skipped: list[int] = []
    try:
        # a fused projection's split stays inside XNNPACK under a dynamic length; each delegate runs
        # only the XNNPACK passes that can apply to it, and no pass copies provenance histories
        # (export/executorch/lowering_cost.py: the same program, about a quarter less time)
        with dynamic_slices(), applicable_passes_only(skipped), without_provenance(), in_place_legalize(), \
                no_op_decompositions_skipped(decompositions_skipped):
            edge = to_edge_transform_and_lower(
                programs if len(programs) > 1 else ep,
                partitioner=[XnnpackPartitioner(configs=partitioner_configs(hidden))],
                compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True),
                constant_methods=meta,
            )
        delegation = _delegation(edge.exported_program().graph_module)
        if rows:
            delegation[VERIFY_METHOD] = _delegation(edge.exported_program(VERIFY_METHOD).graph_module)
        if drafted is not None:
            delegation[DRAFT_METHOD] = _delegation(edge.exported_program(DRAFT_METHOD).graph_module)
        boundaries = count_residual_adds(edge.exported_program().graph_module, hidden) if hidden else 0
        # quant fusion turns torchao's dequantize+embedding into quantized_decomposed::embedding_*;
        # graph inputs are not planned into the arena (the runner owns them)
        with without_provenance():
            prog = edge.to_executorch(ExecutorchBackendConfig(
                do_quant_fusion_and_const_prop=True,
                # verify continues forward's cache: the methods' KV buffers are one allocation
                memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, share_mutable_buffers=bool(rows)),
                external_constants=(lambda node: PTD_TAG) if external else False,
            ))
        data = bytes(prog.buffer)
        ptd = _external_data(prog) if external else None
        delegation.update(_program_calls(prog))
        if rows:
            delegation[VERIFY_METHOD].update(_program_calls(prog, VERIFY_METHOD))
        if drafted is not None:
            delegation[DRAFT_METHOD].update(_program_calls(prog, DRAFT_METHOD))
    except Exception as exc:
        raise ExportError(f"lowering to ExecuTorch/XNNPACK failed: {exc}") from exc
    timings["lower_s"] = time.perf_counter() - t0
    log(f"executorch: {delegation['delegated_fraction']:.1%} of ops delegated to XNNPACK; "
        f"portable: {delegation['portable_ops']}")
    emb_scheme = linear_scheme(model.get_input_embeddings().weight).replace("wo", "")
    details = {"delegation": delegation,
               "llm_ops": {**custom_ops, "rms_norm_swapped": norms["swapped"], "rms_norm_kept": norms["kept"],
                           "tanh_gelu_swapped": gelus,
                           "static_reshapes": reshapes, "splits_as_slices": splits, "logits": opts.logits,
                           "scoring_method": SCORING_METHOD if scoring else None,
                           "verify_method": {"name": VERIFY_METHOD, "max_tokens": rows} if rows else None,
                           "draft_method": drafted,
                           "fused_projections": fusion, "merged_linears": merged,
                           "residual_boundaries": boundaries, "head_transposes_removed": transposes,
                           "joint_rope_layers": joint_rope, "xnnpack_passes_skipped": skipped,
                           "decompositions_skipped": len(decompositions_skipped),
                           "prefill_chunk": chunk, "sliding_windows": plan.windows, "dense_experts": len(experts),
                           "ring_layers": sum(p.ring for p in plan.layers)},
               "quantization": {"linear": mix, "embedding": emb_scheme, **decided,
                                "exported_linear": mix_details(graph_schemes)},
               "metadata": meta, "timings": timings,
               "weights": {"where": opts.weights, "pte_bytes": len(data), "ptd_bytes": len(ptd) if ptd else 0,
                           "tied_embedding": _tied_note(tied, emb_scheme, eager_schemes, opts.weights)}}
    return data, ptd, details


def _tied_note(tied: bool, emb_scheme: str, schemes: dict[str, str], weights: str) -> str | None:
    """How a tied embedding / lm_head pair is stored, and why twice when it is (for the report).

    With ``weights: external`` model.ptd keeps identical bytes once: an fp32 pair is identical, and so is
    an int8 table beside an 8da8w lm_head (both torchao's symmetric per-row int8 of the same weights;
    XNNPACK serializes the int8 data as it is). An int4 pair is not: XNNPACK packs its nibbles its own way."""
    if not tied:
        return None
    head = next((v for f, v in schemes.items() if _is_lm_head(f)), "fp32")
    if (emb_scheme, head) not in SHARED_PAIRS:
        return (f"stored twice: the embedding is {emb_scheme} (a table lookup) and lm_head {head} (a matmul), "
                "different bytes; the quantized table is what keeps the size down")
    if weights == "external":
        return f"stored once: model.ptd holds the identical {emb_scheme} bytes of the lookup table and lm_head once"
    return ("stored twice: a single .pte keeps the table as a program constant for the lookup and XNNPACK packs "
            "its own copy for lm_head; weights: external stores it once in model.ptd")


def _external_data(prog) -> bytes:
    with tempfile.TemporaryDirectory(prefix="et-ptd-") as tdir:
        prog.write_tensor_data_to_file(tdir)
        files = sorted(Path(tdir).glob("*.ptd"))
        if [f.name for f in files] != [PTD_NAME]:
            raise ExportError(f"expected one external data file {PTD_NAME}, ExecuTorch wrote {[f.name for f in files]}")
        return files[0].read_bytes()


class ExecuTorchExporter(Exporter):
    name = "executorch"
    options_model = ExecuTorchOptions
    suffixes = (".pte",)
    supports_draft = True

    def export(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        out_dir: Path,
        options: ExportOptions | dict | None = None,
        *,
        calibration: Sequence[torch.Tensor] = (),
        draft: DraftSpec | None = None,
        log=print,
    ) -> ExportResult:
        """Write ``model.pte``, the tokenizer files and ``manifest.json`` into ``out_dir``.

        The directory is built beside ``out_dir`` and swapped in whole (``atomic_dir``) once the
        program loads and the manifest (written last) lists every file's sha256: at every
        instant ``out_dir`` holds either the previous complete export with its manifest or the
        new one. ``calibration`` is unused: torchao's schemes here are dynamic. ``draft`` becomes
        the program's ``draft`` method (:mod:`export.executorch.draft`).
        """
        opts = options if isinstance(options, ExecuTorchOptions) else ExecuTorchOptions.model_validate(options or {})
        out_dir = Path(out_dir)
        extra = {}
        if draft is not None:
            from export.executorch.draft import vocabulary

            vocab = int(model.get_input_embeddings().num_embeddings)
            extra = {"draft": draft.model,
                     "draft_vocab": vocabulary(draft.token_counts, vocab, opts.draft_vocab,
                                               keep=eos_token_ids(model, tokenizer)) if opts.draft_vocab else None}
        if opts.weights == "embedded":
            (data, details), ptd = lower_to_pte(model, tokenizer, opts, log=log, **extra), None
        else:
            data, ptd, details = lower_program(model, tokenizer, opts, log=log, **extra)
        config = getattr(model, "config", None)
        with atomic_dir(out_dir) as tmp:
            (tmp / PTE_NAME).write_bytes(data)
            if ptd is not None:
                (tmp / PTD_NAME).write_bytes(ptd)
            tokenizer.save_pretrained(tmp)
            written = sorted(f for f in tmp.iterdir() if f.is_file())
            runner = ExecuTorchRunner(tmp / PTE_NAME)  # the artifact must load before we call it shipped
            manifest = {
                "format": "executorch",
                "artifact": PTE_NAME,
                "model": getattr(config, "name_or_path", None) or getattr(config, "model_type", "unknown"),
                "architecture": (getattr(config, "architectures", None) or [type(model).__name__])[0],
                "schemes": {
                    "quantize_option": opts.quantize,
                    "lm_head": opts.lm_head,
                    "group_size": opts.group_size if "8da4w" in details["quantization"]["linear"] else None,
                    **details["quantization"],
                },
                "backend": "xnnpack",
                "max_seq_len": runner.max_seq_len,
                "max_prefill_chunk": runner.max_chunk,
                "vocab_size": runner.vocab_size,
                "llm_ops": details["llm_ops"],
                "delegation": details["delegation"],
                "weights": opts.weights,
                "tied_embedding": details["weights"]["tied_embedding"],
                "size_bytes": (tmp / PTE_NAME).stat().st_size + (len(ptd) if ptd is not None else 0),
                "files": {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in written},
                "toolchain": package_versions(*EXECUTORCH_TOOLCHAIN),
                "options": opts.model_dump(),
            }
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
            del runner
        pte = out_dir / PTE_NAME
        details["runtime"] = ExecuTorchRunner(pte).describe()
        details["size_bytes"] = manifest["size_bytes"]
        details["toolchain"] = manifest["toolchain"]
        files = [out_dir / f.name for f in written] + [out_dir / MANIFEST_NAME]
        return ExportResult(artifact=pte, files=files, manifest=manifest, details=details)

    def check_model(self, config: Any, options: ExportOptions) -> list[str]:
        """Refuse at validation what cannot export: architectures outside the custom-op path,
        max_seq_len beyond max_position_embeddings, layer kinds or attention soft-capping that
        ``llama::custom_sdpa`` cannot run, group sizes that do not divide the layers."""
        opts = options if isinstance(options, ExecuTorchOptions) else ExecuTorchOptions.model_validate(options or {})
        return model_problems(config, opts)

    def load(self, artifact: Path, **kwargs) -> ExecuTorchRunner:
        """Load a ``.pte`` as a runner; ``threads=N`` resizes ExecuTorch's threadpool."""
        return ExecuTorchRunner(artifact, **kwargs)
