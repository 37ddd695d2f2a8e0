"""TorchChat target: a directory that pytorch/torchchat runs as it is.

``model.pth`` + ``params.json`` + tokenizer for its eager path (``--checkpoint-path``), a
``model.pte`` for phones (``--pte-path``, built by :mod:`export.executorch.exporter`) and a ``model.pt2``
for desktops (``--aoti-package-path``, :mod:`export.torchchat.aoti`), with ``RUN.md`` giving the commands.
Each file is loaded back and measured on its own report row: the ``.pth`` through an
independent Meta-layout Llama (:mod:`export.torchchat.meta_llama`), the ``.pte`` in ExecuTorch, the
``.pt2`` through ``torch._inductor.aoti_load_package``.

Only Llama-layout models map (see :mod:`export.torchchat.layout`); others are refused from
their config before any stage runs.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence

import torch
from pydantic import Field

from export.base import (
    EXECUTORCH_TOOLCHAIN,
    Exporter,
    ExportError,
    ExportOptions,
    ExportResult,
    eos_token_ids,
    package_versions,
)
from export.decoding.runtime import Runner
from export.torchchat.layout import config_problems, meta_state_dict, torchchat_params
from export.torchchat.runmd import quantization_summary, render_run_md, torchchat_quantize
from targets.atomic import atomic_dir, sha256_file
from targets.profile import load_target

PTH, PARAMS, PTE, PT2, RUN_MD, MANIFEST = "model.pth", "params.json", "model.pte", "model.pt2", "RUN.md", "manifest.json"
#: a chat template for tokenizers without one: torchchat's HF-tokenizer path refuses to start without any
PLAIN_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


class TorchChatOptions(ExportOptions):
    """The ``torchchat`` block of a pipeline YAML."""

    #: the pipeline fills ``max_seq_len`` from the target profile (a custom one's included)
    max_seq_len_from_profile: ClassVar[bool] = True

    max_seq_len: int | None = Field(
        None, ge=2, description="context of the .pte/.pt2 KV caches and params.json's max_seq_length; "
        "null takes the target profile's",
    )
    pte: bool = Field(True, description="also write model.pte (ExecuTorch, XNNPACK) for torchchat's mobile path")
    pt2: bool = Field(True, description="also write model.pt2 (AOTInductor) for torchchat's desktop path")
    quantized_pth: Literal["dequantize", "refuse"] = Field(
        "dequantize", description="a quantized model's model.pth: dequantize (float32 weights on the quantization "
        "grid, with the matching --quantize config in RUN.md) or refuse the export",
    )
    verify_tokens: int = Field(
        16, ge=0, description="probe tokens on which the Meta-layout forward of model.pth must match the HF model "
        "before the export is accepted (float models only); 0 skips the probe",
    )
    tolerance: float = Field(1e-4, gt=0, description="largest max-abs logit difference the probe accepts")
    tokenizer_type: int | None = Field(
        None, ge=0, description="tokenizer_type written into the .pte/.pt2 metadata (2 = SentencePiece, "
        "3 = tiktoken/BPE); null infers it from the tokenizer",
    )


def _max_seq_len(opts: TorchChatOptions) -> int:
    if opts.max_seq_len is not None:
        return opts.max_seq_len
    return load_target("torchchat").max_seq_len


def _write_tokenizer(tokenizer: Any, out_dir: Path) -> dict:  # out_dir: the staging directory
    """tokenizer.model for SentencePiece tokenizers, else tokenizer.json + a tokenizer_config.json
    torchchat's HFTokenizer reads (bos/eos as strings, chat template inline)."""
    vocab = str(getattr(tokenizer, "vocab_file", None) or getattr(tokenizer, "init_kwargs", {}).get("vocab_file") or "")
    bos = getattr(tokenizer, "bos_token_id", None)
    try:
        probe = tokenizer("a").input_ids
        prepend = bos is not None and list(probe[:1]) == [bos]
    except Exception:
        prepend = bos is not None
    if vocab.endswith(".model") and Path(vocab).is_file():
        shutil.copyfile(vocab, out_dir / "tokenizer.model")
        return {"kind": "sentencepiece", "file": "tokenizer.model", "files": ["tokenizer.model"], "type": 2,
                "prepend_bos": prepend}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ExportError(f"{type(tokenizer).__name__} has neither a SentencePiece .model file nor a tokenizer.json "
                          "backend; torchchat loads one of those (or tiktoken)")
    backend.save(str(out_dir / "tokenizer.json"))
    eos = tokenizer.eos_token or tokenizer.bos_token
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: torchchat takes one string
        template = template.get("default") or next(iter(template.values()), None)
    config = {"bos_token": tokenizer.bos_token or eos, "eos_token": eos, "chat_template": template or PLAIN_CHAT_TEMPLATE}
    for key in ("pad_token", "unk_token"):
        if getattr(tokenizer, key, None):
            config[key] = getattr(tokenizer, key)
    if config["eos_token"] is None or backend.token_to_id(config["eos_token"]) is None:
        raise ExportError("the tokenizer has no end-of-sequence token in its vocabulary; torchchat's HF tokenizer "
                          "needs BOS and EOS tokens")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"kind": "hf", "file": "tokenizer.json", "files": ["tokenizer.json", "tokenizer_config.json"], "type": 3,
            "prepend_bos": prepend, "chat_template": "the tokenizer's" if template else "plain (the tokenizer has none)"}


def _check_shapes(sd: dict[str, torch.Tensor], params: dict) -> None:
    """params.json must describe every tensor: torchchat builds one shape for all layers, so a
    model whose layers differ (e.g. pruned unevenly) cannot be expressed."""
    from export.torchchat.meta_llama import MetaLlama, parse_params

    p = parse_params(dict(params))  # the loader rules torchchat applies; raises ParamsError
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in MetaLlama(p, cache_len=2).state_dict().items()}
    for key, tensor in sd.items():
        if key in want and tuple(tensor.shape) != want[key]:
            raise ExportError(f"{key} has shape {tuple(tensor.shape)} but params.json implies {want[key]}: torchchat "
                              "builds every layer with the same shapes, so this model cannot be expressed")


def _probe(model: torch.nn.Module, pth: Path, params: Path, n: int, calibration: Sequence[torch.Tensor]) -> dict:
    """Max |logit difference| between the HF model and the Meta-layout forward of the written files."""
    from export.torchchat.meta_llama import load_checkpoint

    ids = calibration[0][:n].long() if calibration and calibration[0].numel() >= n else \
        torch.randint(0, model.get_input_embeddings().num_embeddings, (n,), generator=torch.Generator().manual_seed(0))
    meta = load_checkpoint(pth, params, cache_len=n)
    with torch.inference_mode():
        ref = model(input_ids=ids[None]).logits[0].float()
        got = meta(ids[None], torch.arange(n))[0].float()
    return {"tokens": n, "max_abs_diff": float((ref - got).abs().max()), "logit_scale": float(ref.abs().max())}


class TorchChatExporter(Exporter):
    name = "torchchat"
    options_model = TorchChatOptions
    suffixes = (".pth", ".pt2", ".pte")

    def check_model(self, config: Any, options: ExportOptions) -> list[str]:
        """Llama layout (torchchat's Transformer), then what the ExecuTorch exporter needs for the .pte."""
        opts = options if isinstance(options, TorchChatOptions) else TorchChatOptions.model_validate(options or {})
        n = _max_seq_len(opts)
        problems = config_problems(config, n)
        if problems:
            return problems  # the .pte's checks would only restate them
        limit = getattr(config, "max_position_embeddings", None)
        if limit is not None and n > limit:
            problems.append(f"max_seq_len={n} exceeds the model's max_position_embeddings={limit}")
        if opts.pte:
            from export.executorch import ExecuTorchExporter, ExecuTorchOptions

            et = ExecuTorchExporter().check_model(config, ExecuTorchOptions(max_seq_len=n))
            problems += [f"model.pte: {p} (or set export.torchchat.pte: false to skip the .pte)"
                         for p in et if "max_position_embeddings" not in p]
        return problems

    def export(self, model: torch.nn.Module, tokenizer: Any, out_dir: Path, options: ExportOptions | dict | None = None,
               *, calibration: Sequence[torch.Tensor] = (), log=print) -> ExportResult:
        """Write model.pth, params.json, the tokenizer, model.pte, model.pt2, RUN.md and manifest.json.

        The directory is built beside ``out_dir`` and swapped in whole (``atomic_dir``) once every
        file loads and the manifest (written last) lists their sha256: ``out_dir`` always holds
        either the previous complete export or the new one.
        """
        opts = options if isinstance(options, TorchChatOptions) else TorchChatOptions.model_validate(options or {})
        out_dir = Path(out_dir)
        n = _max_seq_len(opts)
        problems = config_problems(model.config, n)
        if problems:
            raise ExportError("torchchat cannot run this model: " + "; ".join(problems))
        summary = quantization_summary(model)
        if summary["quantized"] and opts.quantized_pth == "refuse":
            raise ExportError(f"the model is quantized ({summary['linear']}) and quantized_pth is 'refuse': "
                              "torchchat's .pth holds plain tensors only")
        quantize, quant_notes = torchchat_quantize(summary)
        with atomic_dir(out_dir) as tmp:
            t0 = time.perf_counter()
            tok = _write_tokenizer(tokenizer, tmp)
            tokenizer_type = opts.tokenizer_type if opts.tokenizer_type is not None else tok["type"]
            sd = meta_state_dict(model)
            vocab = int(sd["tok_embeddings.weight"].shape[0])
            params = torchchat_params(model.config, vocab_size=vocab, max_seq_len=n, tied="output.weight" not in sd,
                                      tokenizer=tok["kind"], prepend_bos=tok["prepend_bos"])
            _check_shapes(sd, params)
            torch.save(sd, tmp / PTH)
            del sd
            (tmp / PARAMS).write_text(json.dumps(params, indent=2) + "\n")
            pth_details: dict[str, Any] = {"format": "torchchat .pth (Meta layout)", "params": params,
                                           "quantization": {k: v for k, v in summary.items() if k != "modules"},
                                           "torchchat_quantize": quantize, "tokenizer": tok["file"]}
            if summary["quantized"]:
                pth_details["note"] = ("weights de-quantized to float32 with float activations: this row measures "
                                       "the .pth as stored; torchchat re-quantizes it with the --quantize in RUN.md")
            probe = None
            if opts.verify_tokens and not summary["quantized"]:
                probe = _probe(model, tmp / PTH, tmp / PARAMS, min(opts.verify_tokens, n), calibration)
                probe["tolerance"] = opts.tolerance
                pth_details["probe"] = probe
                log(f"torchchat: model.pth through the Meta-layout forward: max |Δlogit| {probe['max_abs_diff']:.2e}")
                if not probe["max_abs_diff"] <= opts.tolerance:
                    raise ExportError(f"model.pth does not reproduce the model: max |logit difference| "
                                      f"{probe['max_abs_diff']:.3g} > tolerance {opts.tolerance:g} on "
                                      f"{probe['tokens']} tokens")
            pth_details["export_s"] = round(time.perf_counter() - t0, 2)

            extra_details, files = {}, {"pth": PTH, "params": PARAMS}
            pte_meta = pt2_meta = None
            if opts.pte:
                extra_details["pte"], pte_meta = self._write_pte(model, tokenizer, tmp, n, tokenizer_type, log)
                files["pte"] = PTE
            if opts.pt2:
                meta = self._metadata(model, tokenizer, n, vocab, tokenizer_type)
                extra_details["pt2"], pt2_meta = self._write_pt2(model, tmp, n, meta, log)
                files["pt2"] = PT2
            (tmp / RUN_MD).write_text(render_run_md(
                files=files, params=params, tokenizer_kind=tok["kind"], tokenizer_file=tok["file"], quantize=quantize,
                quant_notes=quant_notes, summary=summary, pte_meta=pte_meta, pt2_meta=pt2_meta, probe=probe,
                max_seq_len=n, plain_chat_template=str(tok.get("chat_template", "")).startswith("plain")))
            names = [PTH, PARAMS, *tok["files"], RUN_MD, *(files[k] for k in ("pte", "pt2") if k in files)]
            config = model.config
            manifest = {
                "format": "torchchat",
                "artifact": PTH,
                "model": getattr(config, "name_or_path", None) or getattr(config, "model_type", "unknown"),
                "architecture": (getattr(config, "architectures", None) or [type(model).__name__])[0],
                "max_seq_len": n,
                "params": params,
                "tokenizer": {"kind": tok["kind"], "file": tok["file"], "tokenizer_type": tokenizer_type,
                              "chat_template": tok.get("chat_template")},
                "quantization": pth_details["quantization"],
                "torchchat_quantize": quantize,
                "files": {f: {"bytes": (tmp / f).stat().st_size, "sha256": sha256_file(tmp / f)} for f in names},
                "toolchain": package_versions(*EXECUTORCH_TOOLCHAIN),
                "options": opts.model_dump(),
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str) + "\n")
            pth_details["size_bytes"] = (tmp / PTH).stat().st_size
        extra = {k: out_dir / files[k] for k in ("pte", "pt2") if k in files}
        return ExportResult(artifact=out_dir / PTH, files=[out_dir / f for f in [*names, MANIFEST]], manifest=manifest,
                            details=pth_details, extra_artifacts=extra, extra_details=extra_details)

    @staticmethod
    def _metadata(model, tokenizer, n: int, vocab: int, tokenizer_type: int) -> dict:
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None:
            bos = getattr(model.config, "bos_token_id", None)
        return {"tokenizer_type": tokenizer_type, "get_max_seq_len": n, "get_vocab_size": vocab,
                "get_bos_id": int(bos) if bos is not None else -1,
                "get_eos_ids": ",".join(str(i) for i in (eos_token_ids(model, tokenizer) or [-1]))}

    @staticmethod
    def _write_pte(model, tokenizer, tmp: Path, n: int, tokenizer_type: int, log) -> tuple[dict, dict]:
        from export.executorch import ExecuTorchOptions, ExecuTorchRunner, lower_to_pte

        t0 = time.perf_counter()
        data, details = lower_to_pte(model, tokenizer, ExecuTorchOptions(max_seq_len=n, tokenizer_type=tokenizer_type),
                                     log=log)
        (tmp / PTE).write_bytes(data)
        meta = dict(ExecuTorchRunner(tmp / PTE).meta)  # the program must load before it ships
        needed = ("tokenizer_type", "get_max_seq_len", "get_vocab_size", "get_bos_id", "get_eos_ids")
        missing = [k for k in needed if k not in meta]
        wrong = {k: meta.get(k) for k, v in (("tokenizer_type", tokenizer_type), ("get_max_seq_len", n))
                 if meta.get(k) != v}
        if missing or wrong:
            raise ExportError(f"{PTE} lacks torchchat's metadata methods {missing} or has wrong values {wrong}")
        details.update(export_s=round(time.perf_counter() - t0, 2), size_bytes=(tmp / PTE).stat().st_size)
        return details, meta

    @staticmethod
    def _write_pt2(model, tmp: Path, n: int, meta: dict, log) -> tuple[dict, dict]:
        from export.torchchat.aoti import AOTIRunner, compile_package

        t0 = time.perf_counter()
        details = compile_package(model, tmp / PT2, max_seq_len=n, metadata=meta, log=log)
        loaded = dict(AOTIRunner(tmp / PT2).meta)  # the package must load before it ships
        if loaded.get("tokenizer_type") != str(meta["tokenizer_type"]) or "AOTI_DEVICE_KEY" not in loaded:
            raise ExportError(f"{PT2} lacks the tokenizer_type/AOTI_DEVICE_KEY metadata torchchat's runner reads")
        details.update(export_s=round(time.perf_counter() - t0, 2), size_bytes=(tmp / PT2).stat().st_size,
                       metadata=loaded)
        return details, loaded

    def artifact_in(self, directory: Path) -> Path | None:
        """An export directory (its manifest says torchchat): the .pt2 when written (the fast desktop
        path), else the .pth."""
        directory = Path(directory)
        try:
            fmt = json.loads((directory / MANIFEST).read_text()).get("format")
        except (OSError, ValueError, AttributeError):
            return None
        if fmt != "torchchat":
            return None
        return next((directory / f for f in (PT2, PTH) if (directory / f).is_file()), None)

    def load(self, artifact: Path, **kwargs) -> Runner:
        """``.pth`` -> the Meta-layout reference, ``.pte`` -> ExecuTorch, ``.pt2`` -> AOTInductor;
        an export directory -> :meth:`artifact_in`'s file."""
        path = Path(artifact)
        if path.is_dir():
            found = self.artifact_in(path)
            if found is None:
                raise ExportError(f"{path} is not a torchchat export directory (no {MANIFEST} with "
                                  f"format torchchat beside {PTH} or {PT2})")
            path = found
        if path.suffix == ".pth":
            from export.torchchat.meta_llama import MetaLlamaRunner

            return MetaLlamaRunner(path, **kwargs)
        if path.suffix == ".pte":
            from export.executorch import ExecuTorchRunner

            return ExecuTorchRunner(path, **kwargs)
        if path.suffix == ".pt2":
            from export.torchchat.aoti import AOTIRunner

            return AOTIRunner(path, **kwargs)
        raise ExportError(f"the torchchat exporter loads .pth, .pte and .pt2 files, not {path.name}")
