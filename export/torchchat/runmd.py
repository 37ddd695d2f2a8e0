"""What a TorchChat user needs beside the files: the ``--quantize`` JSON that matches the
stages' quantization, and ``RUN.md`` with the exact commands.

TorchChat's ``.pth`` loader takes plain tensors only (it builds ``nn.Linear`` modules and loads
strictly with ``weights_only=True``), and quantizes at load time from ``--quantize``. So a
quantized model's ``model.pth`` holds its weights de-quantized to float32, which sit on the
quantization grid, and ``RUN.md`` carries the ``--quantize`` config that re-creates the scheme;
the ``.pte`` and ``.pt2`` keep the real quantized weights.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn

from export.precision import linear_scheme


def _group(w: torch.Tensor) -> int | None:
    block = getattr(w, "block_size", None)
    return int(block[-1]) if block else None


def quantization_summary(model: nn.Module) -> dict[str, Any]:
    """Schemes of every Linear (with 8da4w group sizes) and of the token embedding."""
    linears = {f: m for f, m in model.named_modules() if isinstance(m, nn.Linear)}
    schemes = {f: linear_scheme(m.weight) for f, m in linears.items()}
    groups = sorted({_group(linears[f].weight) for f, s in schemes.items() if s == "8da4w"} - {None})
    emb = model.get_input_embeddings().weight
    emb_scheme = linear_scheme(emb).replace("wo", "")
    return {"linear": dict(Counter(schemes.values())), "modules": schemes, "group_sizes": groups,
            "embedding": emb_scheme, "embedding_group": _group(emb) if emb_scheme != "fp32" else None,
            "quantized": any(s != "fp32" for s in schemes.values()) or emb_scheme != "fp32"}


def torchchat_quantize(summary: dict[str, Any]) -> tuple[dict | None, list[str]]:
    """TorchChat's ``--quantize`` JSON closest to the model's schemes, and notes on what differs."""
    counts = {s: n for s, n in summary["linear"].items() if s != "fp32"}
    config: dict[str, Any] = {}
    notes: list[str] = []
    if counts:
        main = max(counts, key=counts.get)
        if main == "8da4w":
            g = summary["group_sizes"][0] if summary["group_sizes"] else 32
            config["linear:a8w4dq"] = {"groupsize": g}
            if len(summary["group_sizes"]) > 1:
                notes.append(f"layers use several group sizes {summary['group_sizes']}; --quantize takes one ({g})")
        elif main == "8da8w":
            config["linear:int8"] = {"bitwidth": 8, "groupsize": 0}
            notes.append("torchchat has no portable int8-activation/int8-weight mode (linear:a8wxdq needs its "
                         "torchao experimental build); linear:int8 keeps the same per-channel int8 weights with "
                         "float activations, which is what the .pth row of the report measures")
        elif main == "int8wo":
            config["linear:int8"] = {"bitwidth": 8, "groupsize": 0}
        else:
            notes.append(f"scheme {main} has no torchchat --quantize equivalent; the .pth runs it de-quantized")
        others = {s: n for s, n in summary["linear"].items() if s != main}
        if others:
            mix = ", ".join(f"{n} {s}" for s, n in sorted(others.items()))
            notes.append(f"the stages left a mix ({mix} besides {counts[main]} {main}); torchchat's --quantize applies "
                         "one scheme to every Linear, output projection included, so it cannot reproduce the mix. "
                         "The .pte and .pt2 keep it exactly")
    if summary["embedding"] in ("int8", "int4"):
        bits = 8 if summary["embedding"] == "int8" else 4
        config["embedding"] = {"bitwidth": bits, "groupsize": summary["embedding_group"] or 0}
    return (config or None), notes


def render_run_md(*, files: dict[str, str], params: dict, tokenizer_kind: str, tokenizer_file: str,
                  quantize: dict | None, quant_notes: list[str], summary: dict, pte_meta: dict | None,
                  pt2_meta: dict | None, probe: dict | None, max_seq_len: int, plain_chat_template: bool = False) -> str:
    """RUN.md: which file is what, and the torchchat commands that run each."""
    import json

    q = f" --quantize '{json.dumps(quantize)}'" if quantize else ""
    common = (f"--checkpoint-path $M/{files['pth']} --params-path $M/{files['params']} "
              f"--tokenizer-path $M/{tokenizer_file} --device cpu --dtype fp32")
    lines = ["# Running this model with TorchChat", "",
             "Written by edge-optimize's `torchchat` exporter. TorchChat (github.com/pytorch/torchchat; not on "
             "PyPI) loads these files as they are: no conversion step.", "",
             "| file | what | torchchat flag |", "|---|---|---|",
             f"| `{files['pth']}` | Meta-layout Llama checkpoint, float32 plain tensors | `--checkpoint-path` |",
             f"| `{files['params']}` | model shape (`{json.dumps(params)}`) | `--params-path` |",
             f"| `{tokenizer_file}` | {'SentencePiece model' if tokenizer_kind == 'sentencepiece' else 'Hugging Face tokenizer (with tokenizer_config.json beside it)'} | `--tokenizer-path` |"]
    if "pte" in files:
        lines.append(f"| `{files['pte']}` | ExecuTorch program for phones (XNNPACK), KV cache of {max_seq_len} | `--pte-path` |")
    if "pt2" in files:
        isa = (pt2_meta or {}).get("AOTI_CPU_ISA", "?")
        lines.append(f"| `{files['pt2']}` | AOTInductor package for desktop CPUs (compiled for x86_64 Linux, {isa}), "
                     f"KV cache of {max_seq_len} | `--aoti-package-path` |")
    lines += ["", "From a torchchat checkout, with `M` set to this directory:", "", "```sh", "M=$(pwd)  # this directory",
              "# eager PyTorch from the .pth", f"python3 torchchat.py generate {common}{q} --temperature 0 --prompt \"Hello\""]
    if "pt2" in files:
        lines += ["# desktop: the AOTInductor package (torchchat still reads the .pth/params for the model config)",
                  f"python3 torchchat.py generate {common} --aoti-package-path $M/{files['pt2']} --temperature 0 --prompt \"Hello\""]
    if "pte" in files:
        lines += ["# the ExecuTorch program, run on the desktop through ExecuTorch's Python bindings",
                  f"python3 torchchat.py generate {common} --pte-path $M/{files['pte']} --temperature 0 --prompt \"Hello\""]
    lines += ["# interactive chat (uses the tokenizer's chat template)", f"python3 torchchat.py chat {common}{q}",
              "# re-export with torchchat itself, from the .pth", f"python3 torchchat.py export {common}{q} "
              f"--output-pte-path $M/torchchat_export.pte", "```", ""]
    if tokenizer_kind == "sentencepiece":
        lines += ["Native runners (built with `torchchat/utils/scripts/build_native.sh aoti|et`):", "", "```sh"]
        if "pt2" in files:
            lines.append(f"./cmake-out/aoti_run $M/{files['pt2']} -z $M/{tokenizer_file} -t 0 -i \"Hello\"")
        if "pte" in files:
            lines.append(f"./cmake-out/et_run $M/{files['pte']} -z $M/{tokenizer_file} -l 2 -t 0 -i \"Hello\"")
        lines += ["```", ""]
    else:
        lines += ["torchchat's native runners (`aoti_run`, `et_run`) load SentencePiece and tiktoken tokenizers only; "
                  "with this Hugging Face `tokenizer.json` use the Python commands above (ExecuTorch's own LLM runner "
                  "reads `tokenizer.json` and this `.pte`'s metadata directly).", ""]
    lines += ["## Notes", "",
              f"- `max_seq_length` in params.json is {max_seq_len}, the KV-cache length of the .pte and .pt2: "
              "torchchat never generates past it (raise `max_seq_len` in the export options for a longer context).",
              "- With `--aoti-package-path` or `--pte-path` torchchat prefills one token at a time; its Python "
              "`--pte-path` loader also caps the context at 128 tokens.",
              "- `--dtype fp32` reproduces the verified numbers; torchchat's default `fast` may pick a 16-bit type."]
    if plain_chat_template:
        lines.append("- The tokenizer had no chat template, and torchchat's Hugging Face tokenizer path refuses to start "
                     "without one: tokenizer_config.json carries a plain one that concatenates the messages.")
    if pt2_meta:
        lines.append("- The .pt2 holds machine code for the CPU it was compiled on; on another CPU/OS re-run the "
                     "export, or build one from the .pth with `torchchat.py export --output-aoti-package-path`.")
    lines += ["", "## Quantization", ""]
    if summary["quantized"]:
        lines += [f"The stages quantized this model (Linear layers: {summary['linear']}; embedding: "
                  f"{summary['embedding']}). `{files['pth']}` cannot carry torchao's quantized tensors (torchchat "
                  "loads plain tensors and quantizes at load time), so it holds the quantized weights de-quantized "
                  "to float32: values on the quantization grid, which `--quantize` maps back to integers.", ""]
        lines += ([f"`--quantize '{json.dumps(quantize)}'` re-creates the scheme (used in the commands above)."]
                  if quantize else ["No torchchat `--quantize` mode matches; the .pth runs de-quantized."])
        lines += [f"- {n}" for n in quant_notes]
        lines += ["- The .pte and .pt2 keep the real quantized weights: no `--quantize` with them."]
    else:
        lines.append("The model is float32; torchchat can still quantize the .pth at load time, e.g. "
                     "`--quantize '{\"linear:a8w4dq\": {\"groupsize\": 32}}'` (8-bit dynamic activations, 4-bit weights).")
    lines += ["", "## Verification", ""]
    if probe:
        lines.append(f"- `{files['pth']}` run by an independent Meta-layout Llama (edge-optimize's "
                     f"`export.torchchat.meta_llama`) against the Hugging Face model on {probe['tokens']} tokens: max |logit "
                     f"difference| {probe['max_abs_diff']:.2e} (tolerance {probe['tolerance']:.0e}).")
    if pte_meta:
        lines.append(f"- `{files['pte']}` metadata: " + ", ".join(f"{k}={v}" for k, v in sorted(pte_meta.items())))
    lines.append("- Perplexity, agreement with the eager model, size and latency of each file are rows "
                 "`export:torchchat`, `export:torchchat:pte` and `export:torchchat:pt2` of the run's report.")
    return "\n".join(lines) + "\n"
