"""Generate text from a shipped artifact, so users can try exactly what they exported."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from export.base import exporter_for_artifact
from export.runtime import RunnerError, greedy_generate


def generate_from_artifact(
    artifact: Path, prompt: str, *, max_new_tokens: int = 64, chat: bool = False, threads: int | None = None,
    stream: TextIO | None = sys.stdout,
) -> str:
    """Greedy-generate from ``artifact`` (a .pte or .onnx with tokenizer files beside it),
    streaming text to ``stream`` as it is produced; returns the generated text."""
    from transformers import AutoTokenizer

    artifact = Path(artifact)
    if not artifact.is_file():
        raise FileNotFoundError(f"artifact not found: {artifact}")
    try:
        tok = AutoTokenizer.from_pretrained(artifact.parent, local_files_only=True)
    except Exception as exc:
        raise RunnerError(f"no tokenizer files beside {artifact} ({type(exc).__name__}: {exc})") from None
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    runner = exporter_for_artifact(artifact).load(artifact)
    if chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding, not a list of ids
            ids = ids["input_ids"]
    else:
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    produced: list[int] = []
    printed = ""

    def on_token(t: int) -> None:
        nonlocal printed
        produced.append(t)
        text = tok.decode(produced, skip_special_tokens=True)
        if stream is not None and text.startswith(printed):
            stream.write(text[len(printed):])
            stream.flush()
        printed = text

    greedy_generate(runner, ids, max_new_tokens, eos_token_ids=eos, on_token=on_token)
    if stream is not None:
        stream.write("\n")
    return tok.decode(produced, skip_special_tokens=True)
