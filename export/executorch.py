"""ExecuTorch target: a decoder-only LM as a ``.pte`` with a static KV cache, delegated to XNNPACK.

``forward(tokens[1, T], input_pos[T])`` serves both prefill and decode and returns logits for
every fed position, so one program is used for generation and for perplexity. Metadata
methods (``get_max_seq_len``, ``get_vocab_size``, ``get_bos_id``, ``get_eos_ids``,
``tokenizer_type``...) let ExecuTorch/TorchChat runners and :class:`ExecuTorchRunner` size
themselves from the file alone.

Quantization: a model that an earlier stage quantized with torchao is exported as given
(``quantize: none``); users who skip that stage can ask for 8da4w/8da8w here. int8
weight-only is refused: lowered to XNNPACK it returns wrong logits (see the regression test).
"""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from pydantic import Field

from targets.atomic import atomic_path, atomic_write_json, sha256_file
from export.base import ExportError, ExportOptions, ExportResult, Exporter
from export.executorch_runtime import ExecuTorchRunner
from export.linear_schemes import (
    check_mix,
    exported_linear_schemes,
    linear_scheme,
    mix_details,
    module_schemes,
    quantization_mix,
)

PTE_NAME = "model.pte"
MANIFEST_NAME = "manifest.json"


class ExecuTorchOptions(ExportOptions):
    """The ``executorch`` block of a pipeline YAML."""

    quantize: Literal["none", "8da4w", "8da8w"] = Field(
        "none",
        description="exporter-side quantization of nn.Linear layers: none (export the model as given, "
        "including weights an earlier ptq stage quantized), 8da4w (int8 dynamic activations, int4 "
        "group-wise weights) or 8da8w (int8 dynamic activations, int8 per-channel weights)",
    )
    group_size: int = Field(
        32, gt=0, description="weight group size for 8da4w; must divide every quantized layer's in_features"
    )
    lm_head: Literal["same", "fp32", "8da8w"] = Field(
        "same",
        description="precision of the output projection when quantize is set: same as the other layers, "
        "fp32, or 8da8w (int4 on lm_head costs most of 8da4w's perplexity loss)",
    )
    embedding_quantize: Literal["int8", "int4"] | None = Field(
        None,
        description="weight-only quantization of the token embedding table (portable quantized "
        "embedding kernel): int8 per row or int4 group-wise; null keeps it fp32",
    )
    embedding_group_size: int = Field(
        32, gt=0, description="group size for int4 embedding quantization; must divide hidden_size"
    )
    max_seq_len: int | None = Field(
        None, ge=2, description="KV-cache length (prompt + generation); null takes the target profile's"
    )
    dtype: Literal["float32"] = Field(
        "float32", description="activation/weight dtype of the program; only float32 is verified on XNNPACK here"
    )
    tokenizer_type: int | None = Field(
        None,
        ge=0,
        description="value of the tokenizer_type metadata method read by TorchChat's runner "
        "(2 = SentencePiece, 3 = tiktoken/BPE); null infers it from the tokenizer",
    )


# ---------------------------------------------------------------------------------------------
# quantization


def _is_lm_head(fqn: str) -> bool:
    return fqn == "lm_head" or fqn.endswith(".lm_head")


def _refuse_weight_only(model: torch.nn.Module) -> None:
    bad = [f for f, m in model.named_modules() if isinstance(m, torch.nn.Linear) and linear_scheme(m.weight).endswith("wo")]
    if bad:
        raise ExportError(
            f"{len(bad)} Linear layers (e.g. {bad[0]}) hold weight-only quantized weights "
            f"({linear_scheme(dict(model.named_modules())[bad[0]].weight)}); lowered to XNNPACK, int8 "
            "weight-only returns wrong logits (executorch 1.4.1/1.5.1). Use 8da8w or 8da4w instead."
        )


def _apply_quantization(model: torch.nn.Module, opts: ExecuTorchOptions) -> None:
    from torchao.quantization import (
        Int8DynamicActivationIntxWeightConfig,
        IntxWeightOnlyConfig,
        PerAxis,
        PerGroup,
        quantize_,
    )

    cfg_8da8w = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8, weight_granularity=PerAxis(0))
    if opts.quantize != "none":
        already = {s for s in quantization_mix(model) if s != "fp32"}
        if already:
            raise ExportError(
                f"quantize={opts.quantize!r} but the model is already quantized ({', '.join(sorted(already))}); "
                "set quantize: none to export it as given"
            )
        main = (
            Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(opts.group_size))
            if opts.quantize == "8da4w"
            else cfg_8da8w
        )
        head = {"same": main, "fp32": None, "8da8w": cfg_8da8w}[opts.lm_head]
        targets = {
            fqn: m
            for fqn, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and (head is not None or not _is_lm_head(fqn))
        }
        if opts.quantize == "8da4w":
            odd = [
                f"{f} (in_features={m.in_features})"
                for f, m in targets.items()
                if m.in_features % opts.group_size and (head is main or not _is_lm_head(f))
            ]
            if odd:
                raise ExportError(
                    f"group_size={opts.group_size} does not divide the in_features of {len(odd)} layers, "
                    f"e.g. {odd[0]}; choose a group_size that divides them (e.g. 32)"
                )
        quantize_(model, main, lambda m, fqn: fqn in targets and not _is_lm_head(fqn))
        if head is not None:
            quantize_(model, head, lambda m, fqn: fqn in targets and _is_lm_head(fqn))
    if opts.embedding_quantize is not None:
        emb = model.get_input_embeddings()
        if linear_scheme(emb.weight) != "fp32":
            raise ExportError(
                f"embedding_quantize={opts.embedding_quantize!r} but the embedding is already quantized "
                f"({linear_scheme(emb.weight)}); set embedding_quantize: null to export it as given"
            )
        if opts.embedding_quantize == "int4" and emb.embedding_dim % opts.embedding_group_size:
            raise ExportError(
                f"embedding_group_size={opts.embedding_group_size} does not divide the embedding width "
                f"{emb.embedding_dim}; choose one that does (e.g. 32)"
            )
        cfg = (
            IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
            if opts.embedding_quantize == "int8"
            else IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(opts.embedding_group_size))
        )
        quantize_(model, cfg, lambda m, fqn: m is emb)


# ---------------------------------------------------------------------------------------------
# export


def _toolchain() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for pkg in ("torch", "executorch", "torchao", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _tokenizer_type(tokenizer: Any) -> int:
    """TorchChat's convention: 2 for a SentencePiece model file, 3 for tiktoken/BPE (tokenizer.json)."""
    vocab_file = str(getattr(tokenizer, "vocab_file", "") or "")
    return 2 if vocab_file.endswith(".model") else 3


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        e = getattr(src, "eos_token_id", None)
        ids.update([e] if isinstance(e, int) else (e or []))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(int(i) for i in ids)


def _delegation(gm: torch.fx.GraphModule) -> dict:
    from executorch.devtools.backend_debug import get_delegation_info

    info = get_delegation_info(gm)
    total = info.num_delegated_nodes + info.num_non_delegated_nodes
    fallback = {
        op: b.non_delegated
        for op, b in sorted(info.delegation_by_operator.items())
        if b.non_delegated and op not in ("getitem", "sym_size")
    }
    return {
        "delegated_fraction": info.num_delegated_nodes / total if total else 0.0,
        "delegated_nodes": info.num_delegated_nodes,
        "portable_nodes": info.num_non_delegated_nodes,
        "delegated_subgraphs": info.num_delegated_subgraphs,
        "portable_ops": fallback,
    }


def _resolve_max_seq_len(opts: ExecuTorchOptions) -> int:
    if opts.max_seq_len is not None:
        return opts.max_seq_len
    from targets.profile import load_target

    return load_target("executorch").max_seq_len


def lower_to_pte(model: torch.nn.Module, tokenizer: Any, opts: ExecuTorchOptions, *, log=print) -> tuple[bytes, dict]:
    """Quantize a copy of ``model`` as ``opts`` asks, export it with a static cache, lower it.

    Returns the program bytes and details (delegation, quantization mix, timings).
    """
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_input_embeddings"):
        raise ExportError("the ExecuTorch exporter takes a Hugging Face causal LM (a PreTrainedModel with a config)")
    n = _resolve_max_seq_len(opts)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and n > limit:
        raise ExportError(f"max_seq_len={n} exceeds the model's max_position_embeddings={limit}")
    # Work on a copy: quantize_ and the static-cache wrapper mutate the module and its
    # generation_config, and the pipeline keeps using the model it handed us.
    model = copy.deepcopy(model).eval().float() if opts.quantize != "none" else copy.deepcopy(model).eval()
    _apply_quantization(model, opts)
    _refuse_weight_only(model)
    mix = quantization_mix(model)
    model.config.use_cache = True
    model.generation_config.use_cache = True
    model.generation_config.cache_implementation = "static"

    timings = {}
    t0 = time.perf_counter()
    wrapper = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=n)
    seq = torch.export.Dim("seq_len", max=n - 1)
    example = torch.zeros(1, 4, dtype=torch.long)
    log(f"executorch: torch.export (max_seq_len={n}, linear layers: {mix})")
    try:
        with torch.no_grad():
            ep = wrapper.export(
                input_ids=example,
                cache_position=torch.arange(4),
                dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}},
                strict=True,
            )
    except Exception as exc:
        raise ExportError(f"torch.export of {type(model).__name__} with a static cache failed: {exc}") from exc
    timings["torch_export_s"] = time.perf_counter() - t0
    graph_schemes = exported_linear_schemes(ep)
    check_mix(module_schemes(model), graph_schemes)
    vocab = int(model.get_input_embeddings().num_embeddings)
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        bos = getattr(config, "bos_token_id", None)
    meta = {
        "get_max_seq_len": n,
        "get_max_context_len": n,
        "get_max_prefill_chunk": n - 1,
        "get_vocab_size": vocab,
        "get_bos_id": int(bos) if bos is not None else -1,
        "get_eos_ids": _eos_ids(model, tokenizer) or [-1],
        "use_kv_cache": True,
        "enable_dynamic_shape": True,
        "use_sdpa_with_kv_cache": False,
        "tokenizer_type": opts.tokenizer_type if opts.tokenizer_type is not None else _tokenizer_type(tokenizer),
    }
    log("executorch: lowering to XNNPACK (minutes for a full-size model)")
    t0 = time.perf_counter()
    try:
        edge = to_edge_transform_and_lower(
            ep,
            partitioner=[XnnpackPartitioner()],
            compile_config=EdgeCompileConfig(_check_ir_validity=False),
            constant_methods=meta,
        )
        delegation = _delegation(edge.exported_program().graph_module)
        # quant fusion turns torchao's dequantize+embedding into quantized_decomposed::embedding_*
        prog = edge.to_executorch(ExecutorchBackendConfig(do_quant_fusion_and_const_prop=True))
        data = bytes(prog.buffer)
    except Exception as exc:
        raise ExportError(f"lowering to ExecuTorch/XNNPACK failed: {exc}") from exc
    timings["lower_s"] = time.perf_counter() - t0
    log(f"executorch: {delegation['delegated_fraction']:.1%} of ops delegated to XNNPACK; "
        f"portable: {delegation['portable_ops']}")
    emb_scheme = linear_scheme(model.get_input_embeddings().weight).replace("wo", "")
    details = {"delegation": delegation,
               "quantization": {"linear": mix, "embedding": emb_scheme, "exported_linear": mix_details(graph_schemes)},
               "metadata": meta, "timings": timings}
    return data, details


class ExecuTorchExporter(Exporter):
    name = "executorch"
    options_model = ExecuTorchOptions
    suffixes = (".pte",)

    def export(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        out_dir: Path,
        options: ExportOptions | dict | None = None,
        *,
        calibration: Sequence[torch.Tensor] = (),
        log=print,
    ) -> ExportResult:
        """Write ``model.pte``, the tokenizer files and ``manifest.json`` into ``out_dir``.

        Each file is written atomically; the manifest comes last, so a directory with a
        manifest is complete. ``calibration`` is unused: torchao's schemes here are dynamic.
        """
        opts = options if isinstance(options, ExecuTorchOptions) else ExecuTorchOptions.model_validate(options or {})
        out_dir = Path(out_dir)
        data, details = lower_to_pte(model, tokenizer, opts, log=log)
        pte = out_dir / PTE_NAME
        with atomic_path(pte) as tmp:
            tmp.write_bytes(data)
        files = [pte]
        with tempfile.TemporaryDirectory(prefix=".tokenizer.", dir=out_dir) as tdir:
            tokenizer.save_pretrained(tdir)
            for src in sorted(Path(tdir).iterdir()):
                if src.is_file():
                    with atomic_path(out_dir / src.name) as tmp:
                        tmp.write_bytes(src.read_bytes())
                    files.append(out_dir / src.name)

        runner = ExecuTorchRunner(pte)  # the artifact must load before we call it shipped
        details["runtime"] = runner.describe()
        config = getattr(model, "config", None)
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
            "delegation": details["delegation"],
            "size_bytes": pte.stat().st_size,
            "files": {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in files},
            "toolchain": _toolchain(),
            "options": opts.model_dump(),
        }
        atomic_write_json(out_dir / MANIFEST_NAME, manifest)
        files.append(out_dir / MANIFEST_NAME)
        details["size_bytes"] = manifest["size_bytes"]
        details["toolchain"] = manifest["toolchain"]
        return ExportResult(artifact=pte, files=files, manifest=manifest, details=details)

    def load(self, artifact: Path, **kwargs) -> ExecuTorchRunner:
        """Load a ``.pte`` as a runner; ``threads=N`` resizes ExecuTorch's threadpool."""
        return ExecuTorchRunner(artifact, **kwargs)
