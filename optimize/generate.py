"""Generate text from a shipped artifact, so users can try exactly what they exported.

A ``.pte`` runs through ExecuTorch's C++ text runner (``TextLLMRunner``, what Android and iOS
apps link) whenever the program and its tokenizer allow it; otherwise, and for ``.onnx``, through
the Python loop over :class:`~export.decoding.runtime.Runner`. Falling back is never silent: the reason is
logged. Both give the same greedy tokens for the same ids (tested).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Literal, TextIO

from export.base import exporter_for_artifact
from export.decoding.runtime import RunnerError, generate_ids
from export.decoding.sampling import Sampling
from export.decoding.speculative import HybridDrafter, ModelDrafter, speculative_generate
from export.decoding.text_stream import TextStream
from optimize.quiet import LogOutput, console

log = logging.getLogger(__name__)

RunnerChoice = Literal["auto", "llm", "python"]
SpeculativeChoice = Literal["off", "ngram", "draft"]
SPECULATIVE_CHOICES = ("off", "ngram", "draft")


def _stderr(msg: str) -> None:
    print(msg, file=console(), flush=True)


def sampling_from(temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                  seed: int | None = None) -> Sampling | None:
    """``optimize run``'s sampling flags as a :class:`~export.decoding.sampling.Sampling` (None: greedy, the
    default); top-k, top-p or a seed without a temperature above 0 are refused rather than ignored."""
    if temperature == 0:
        given = [f for f, v in (("--top-k", top_k), ("--top-p", top_p), ("--seed", seed)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} shape sampling, and --temperature is 0 (greedy decoding, the "
                             "default): give a --temperature above 0 too, for example 0.7")
        return None
    return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


def generate_from_artifact(
    artifact: Path, prompt: str, *, max_new_tokens: int = 64, chat: bool = False, threads: int | None = None,
    stream: TextIO | None | str = "stdout", runner: RunnerChoice = "auto",
    say: Callable[[str], None] | None = _stderr, speculative: SpeculativeChoice = "off",
    sampling: Sampling | None = None,
) -> str:
    """Generate from ``artifact`` (a .pte or .onnx with tokenizer files beside it), greedily unless ``sampling``,
    streaming text to ``stream`` as it is produced (``"stdout"``: the process's stdout at the call; None:
    nowhere); returns the generated text.

    ``runner``: ``auto`` takes ExecuTorch's C++ runner for a .pte when it can (else logs why not and
    uses the Python loop), ``llm`` requires it (a clear error if it cannot), ``python`` skips it.
    ``say`` gets one line with the C++ runner's own timing stats.

    ``speculative="ngram"`` decodes with prompt-lookup drafts verified several at a time
    (:mod:`export.decoding.speculative`) through the artifact's verification path (a ``.pte``'s ``verify``
    method): the same tokens as plain greedy decoding of that artifact, in fewer reads of the
    weights where the answer copies its prompt; ``speculative="draft"`` drafts with the artifact's own
    draft model (the pipeline's ``draft`` block) where prompt lookup has nothing. ``say`` gets the
    drafts' stats. It runs the Python loop (ExecuTorch's C++ runner decodes one token a call), so
    ``runner="llm"`` is refused with it.

    ``sampling`` (:class:`~export.decoding.sampling.Sampling`) samples instead of decoding greedily, in the
    Python loop, where a seed gives the same answer with or without ``speculative`` (drafts are kept
    by the standard rejection rule). ``runner="llm"`` samples in ExecuTorch's C++ runner instead,
    which takes a temperature only: top-k, top-p and a seed are refused there.

    What the native runtimes print themselves (ExecuTorch's cpuinfo lines on file descriptor 2, the
    C++ runner's newline on 1) never reaches the caller's streams: it is kept apart while they run
    and logged at INFO (``optimize -v run``), so the answer and its one timing line are all that shows."""
    owned = None
    if stream == "stdout" or stream is sys.stdout:
        stream = _own_stdout(sys.stdout)
        owned = stream if stream is not sys.stdout else None
    fd, native_log = tempfile.mkstemp(prefix="optimize-run-", suffix=".log")
    os.close(fd)
    try:
        with LogOutput(native_log):
            return _generate(Path(artifact), prompt, max_new_tokens, chat, threads, stream, runner, say, speculative,
                             sampling)
    finally:
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):  # a stream the caller closed meanwhile
                pass
        if owned is not None:
            owned.close()
        chatter = Path(native_log).read_text(encoding="utf-8", errors="replace").strip()
        Path(native_log).unlink(missing_ok=True)
        if chatter:
            log.info("the runtime printed:\n%s", chatter)


def _own_stdout(stream: TextIO) -> TextIO:
    """A stream on this process's stdout that stays there while file descriptor 1 points elsewhere
    (a copy of the descriptor); ``stream`` itself where it is not backed by descriptor 1 (a notebook,
    pytest's capture)."""
    try:
        if stream.fileno() != 1:
            return stream
    except (AttributeError, OSError, ValueError):
        return stream
    stream.flush()
    return os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")


def _generate(artifact: Path, prompt: str, max_new_tokens: int, chat: bool, threads: int | None,
              stream: TextIO | None, runner: RunnerChoice, say: Callable[[str], None] | None,
              speculative: SpeculativeChoice = "off", sampling: Sampling | None = None) -> str:
    from transformers import AutoTokenizer

    if not artifact.exists():  # a file, or an export directory its exporter recognises (onnxruntime-genai)
        raise FileNotFoundError(f"artifact not found: {artifact}")
    if runner not in ("auto", "llm", "python"):
        raise ValueError(f"runner must be auto, llm or python, got {runner!r}")
    if speculative not in SPECULATIVE_CHOICES:
        raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_CHOICES)}, got {speculative!r}")
    if speculative != "off" and runner == "llm":
        raise ValueError("--speculative decodes in the Python loop over the artifact's verify method; ExecuTorch's "
                         "C++ runner decodes one token a call (drop --runner llm, or use --speculative off)")
    if sampling is not None and not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be an export.decoding.sampling.Sampling or None, got {type(sampling).__name__}")
    if sampling is not None and runner == "llm":
        extra = [f for f, v in (("--top-k", sampling.top_k), ("--top-p", sampling.top_p), ("--seed", sampling.seed))
                 if v is not None]
        if extra:
            raise ValueError(f"--runner llm samples in ExecuTorch's C++ runner, which takes a temperature but no "
                             f"{', '.join(extra)}: drop them, or use --runner python (the Python loop has them)")
        if sampling.temperature > 1:
            raise ValueError(f"--runner llm samples in ExecuTorch's C++ runner, which takes a temperature in (0, 1], got "
                             f"{sampling.temperature:g}: use --runner python for a higher one")
    try:
        tok = AutoTokenizer.from_pretrained(artifact if artifact.is_dir() else artifact.parent, local_files_only=True)
    except Exception as exc:
        raise RunnerError(f"no tokenizer files beside {artifact} ({type(exc).__name__}: {exc})") from None
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    exporter = exporter_for_artifact(artifact)
    loaded = exporter.load(artifact, threads=threads) if exporter.name == "executorch" else exporter.load(artifact)
    if chat and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        text, ids = prompt, tok(prompt, add_special_tokens=True)["input_ids"]
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    limit = loaded.max_seq_len
    if limit is not None:
        if len(ids) >= limit:
            raise RunnerError(f"the prompt is {len(ids)} tokens; {artifact.name} holds max_seq_len={limit} "
                              "(prompt + generated); shorten it or export with a larger max_seq_len")
        # ExecuTorch's runner stops with prompt + new = max_seq_len; the loop is held to the same
        max_new_tokens = min(max_new_tokens, limit - len(ids))
    printed = ""

    def write(piece: str) -> None:
        nonlocal printed
        printed += piece
        if stream is not None and piece:
            stream.write(piece)
            stream.flush()

    drafter = None
    if speculative == "draft":  # refused here, before any decoding, where the artifact has no draft
        drafter = HybridDrafter(ModelDrafter(loaded.draft_runner(), vocab_ids=loaded.draft_vocab))
    if speculative != "off":
        loaded = loaded.speculative_runner()  # refused here, before any decoding, where it has none
    if sampling is not None and runner == "auto" and hasattr(loaded, "llm_runner"):
        log.info("sampling in the Python loop: ExecuTorch's C++ runner has no seed, top-k or top-p (--runner llm "
                 "samples there with the temperature alone)")
    if runner == "llm" or (runner == "auto" and speculative == "off" and sampling is None):
        temperature = sampling.temperature if sampling is not None else 0.0
        done = _generate_native(loaded, tok, text, ids, max_new_tokens, write, required=runner == "llm",
                                temperature=temperature)
        if done is not None:
            answer, timing = done
            if stream is not None:
                stream.write("\n")
                stream.flush()  # the answer's line ends before the timing line (one terminal for both)
            if say is not None:
                say(timing)
            return answer
    # what the C++ runner showed before it gave up (it only gives up greedy: sampling there is --runner llm, which
    # never falls back), the loop produces again: only what goes beyond it is written
    skip = len(printed)

    def write_beyond(piece: str) -> None:
        nonlocal skip
        cut = min(skip, len(piece))
        skip -= cut
        write(piece[cut:])

    text_out = TextStream(tok, write_beyond)

    def on_token(t: int) -> None:
        text_out.push(t)

    if speculative == "off":
        generate_ids(loaded, ids, max_new_tokens, sampling=sampling, eos_token_ids=eos, on_token=on_token)
        answer = text_out.finish()
        if stream is not None:
            stream.write("\n")
    else:
        stamps: list[float] = []

        def timed(t: int) -> None:
            stamps.append(time.perf_counter())
            on_token(t)

        _, stats = speculative_generate(loaded, ids, max_new_tokens, drafter=drafter, eos_token_ids=eos,
                                        on_token=timed, sampling=sampling)
        answer = text_out.finish()
        if stream is not None:
            stream.write("\n")
            stream.flush()
        if say is not None:
            say(speculative_line(stats, stamps, speculative if sampling is None else f"{speculative}, sampled"))
    return answer


def speculative_line(stats, stamps: list[float], mode: str = "ngram") -> str:
    """One line of what the drafts did, and the decode rate after the first token."""
    rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 and stamps[-1] > stamps[0] else None
    acc = f"{stats.accepted}/{stats.drafted} drafted tokens accepted" if stats.drafted else "no drafts"
    model = f", {stats.draft_calls} draft model calls" if stats.draft_calls else ""
    cost = stats.call_cost
    # what verification costs on this device decides whether drafts pay: a call of n tokens in one-token steps
    priced = (", calls of " + "/".join(f"{n}" for n in cost) + " tokens cost "
              + "/".join(f"{c:.2f}" for c in cost.values()) + " one-token steps") if cost else ""
    return (f"[speculative {mode}] {stats.tokens} tokens in {stats.calls} calls after the prefill "
            f"({stats.tokens_per_call:.2f} a call), {acc}{model}{priced}, decode {_rate(rate)} tok/s")


def _generate_native(loaded, tok, text: str, ids: list[int], max_new_tokens: int, write: Callable[[str], None], *,
                     required: bool, temperature: float = 0.0) -> tuple[str, str] | None:
    """Generate with ExecuTorch's C++ runner: the answer and the runner's timing line; None (reason
    logged) where it cannot serve this artifact."""
    from export.executorch import LLMRunnerUnavailable

    if not hasattr(loaded, "llm_runner"):
        if required:
            raise RunnerError(f"--runner llm: {loaded.runtime} artifacts have no C++ LLM runner (ExecuTorch .pte only)")
        return None
    try:
        llm = loaded.llm_runner()
        prompt_text, num_bos = llm.prompt_for(tok, ids, text=text)
        text_out = TextStream(tok, write)
        held = False  # a piece several ids give (a special token) holds the stream until the end resolves it

        def on_id(i: int | None) -> None:
            nonlocal held
            held = held or i is None
            if not held:
                text_out.push(i)

        gen = llm.generate(prompt_text, max_new_tokens, num_bos=num_bos, on_id=on_id, temperature=temperature)
        for i in gen.ids[len(text_out.ids):]:
            if i is not None:
                text_out.push(i)
        answer = text_out.finish()
    except LLMRunnerUnavailable as exc:
        if required:
            raise RunnerError(f"ExecuTorch's C++ LLM runner cannot run {loaded.path.name}: {exc}") from None
        log.warning("using the Python loop instead of ExecuTorch's C++ LLM runner: %s", exc)
        return None
    s = gen.stats
    timing = (f"[ExecuTorch TextLLMRunner] prompt {s['prompt_tokens']} tokens, prefill {s['prefill_ms']:.0f} ms, "
              f"decode {_rate(s['decode_tok_s'])} tok/s over {s['generated_tokens']} tokens, "
              f"first token {s['ttft_ms']:.0f} ms")
    return answer, timing


def _rate(x: float | None) -> str:
    return f"{x:.1f}" if x is not None else "-"
