"""The teacher's own answers as training text: what a student that must predict the teacher's greedy
tokens (a speculative-decoding draft) learns best from.

Distilling on the run's text (CPython's documentation, by default) teaches a student the teacher's
next-token distribution on documentation; a draft is judged on the teacher's *answers*: an
instruct model's replies, in its own style. So ``distill`` with ``data: teacher_answers`` (or
``both``) first has the teacher answer prompts made from the run's training text, greedily, and
trains on prompt + answer. Measured on SmolLM2-135M with a 6-block draft (docs/executorch.md): after
200 steps on the documentation, the draft agreed with the target's greedy answers on 33% / 25% / 17%
of the tokens of extraction / summary / chat prompts; 150 more steps on 240 such answers raised that
to 44% / 38% / 23%.

Prompts: spans of the training text (never the evaluation span), each wrapped in one of a few
instructions (explain, summarise, quote, continue) and, where the tokenizer has one, the chat
template, as ``optimize run --chat`` sends them. Generation is batched (left-padded) greedy decoding
in eager torch, ``new_tokens`` at most, stopped at the tokenizer's end-of-sequence token. The
stream is kept in the stage's work directory, so a resumed run does not generate it again.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Callable

import torch
from pydantic import Field

from targets.config_base import Strict

INSTRUCTIONS = (
    "Explain this:\n{text}",
    "Summarize the following in two sentences.\n{text}",
    "Passage:\n{text}\n\nWhat does the passage say? Answer briefly.",
    "Passage:\n{text}\n\nQuote its first sentence, then explain it.",
    "Continue this text:\n{text}",
    "Write a short note for a beginner about this:\n{text}",
)


class TeacherAnswers(Strict):
    """How many answers the teacher writes for ``data: teacher_answers``."""

    prompts: int = Field(240, ge=1, description="prompts made from the training text (each one answer)")
    prompt_tokens: int = Field(96, ge=8, description="tokens of training text in each prompt")
    new_tokens: int = Field(128, ge=1, description="longest answer, tokens (greedy; the end-of-sequence token stops it)")
    batch_size: int = Field(32, ge=1, description="prompts answered together (left-padded)")


def _prompts(tokenizer, train_ids: torch.Tensor, cfg: TeacherAnswers, seed: int) -> list[str]:
    rng = random.Random(seed)
    n = int(train_ids.numel())
    if n < cfg.prompt_tokens:
        raise ValueError(f"teacher_answers: the training text has {n} tokens, fewer than prompt_tokens={cfg.prompt_tokens}")
    chat = bool(getattr(tokenizer, "chat_template", None))
    out = []
    for i in range(cfg.prompts):
        start = rng.randrange(0, n - cfg.prompt_tokens + 1)
        text = tokenizer.decode(train_ids[start:start + cfg.prompt_tokens].tolist(), skip_special_tokens=True)
        prompt = INSTRUCTIONS[i % len(INSTRUCTIONS)].format(text=text.strip())
        if chat:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                   tokenize=False)
        out.append(prompt)
    return out


def teacher_answers(teacher: torch.nn.Module, tokenizer, train_ids: torch.Tensor, cfg: TeacherAnswers, *,
                    seed: int = 0, work_dir: Path | None = None, log: Callable[[str], None] = print,
                    progress: Callable[..., None] | None = None) -> torch.Tensor:
    """Prompt + greedy answer token ids of every prompt, concatenated (each answer ends at the end-of-sequence
    token where the teacher gave one); cached under ``work_dir``, keyed by the teacher's weights' shapes,
    the text, the settings and the seed."""
    eos = tokenizer.eos_token_id
    key = hashlib.sha256(json.dumps([cfg.model_dump(), seed, int(train_ids.numel()), int(train_ids.sum()),
                                     type(teacher).__name__, sum(p.numel() for p in teacher.parameters())],
                                    sort_keys=True).encode()).hexdigest()[:12]
    cache = Path(work_dir) / f"teacher-answers-{key}.pt" if work_dir is not None else None
    if cache is not None and cache.is_file():
        log(f"teacher answers: reusing {cache.name}")
        return torch.load(cache, weights_only=True)
    prompts = _prompts(tokenizer, train_ids, cfg, seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    side = tokenizer.padding_side
    device = next(teacher.parameters()).device
    pieces: list[torch.Tensor] = []
    tokenizer.padding_side = "left"
    try:
        for i in range(0, len(prompts), cfg.batch_size):
            batch = prompts[i:i + cfg.batch_size]
            enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in batch]
            width = max(map(len, enc))
            ids = torch.full((len(enc), width), pad, dtype=torch.long)
            mask = torch.zeros((len(enc), width), dtype=torch.long)
            for j, e in enumerate(enc):
                ids[j, width - len(e):] = torch.tensor(e)
                mask[j, width - len(e):] = 1
            with torch.no_grad():
                out = teacher.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                       max_new_tokens=cfg.new_tokens, pad_token_id=pad, eos_token_id=eos)
            for j, e in enumerate(enc):
                answer = out[j, width:].tolist()
                if eos is not None and eos in answer:
                    answer = answer[: answer.index(eos) + 1]
                pieces.append(torch.tensor(e + answer, dtype=torch.long))
            if progress is not None:
                progress(min(i + cfg.batch_size, len(prompts)), len(prompts), phase="generate")
    finally:
        tokenizer.padding_side = side
    stream = torch.cat(pieces)
    log(f"teacher answers: {len(prompts)} prompts answered, {stream.numel()} tokens")
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".partial")
        torch.save(stream, tmp)
        tmp.replace(cache)
    return stream
