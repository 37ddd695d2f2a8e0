"""One interface over every runtime a model can run in: eager PyTorch, ExecuTorch, ONNX Runtime.

The pipeline's checks (perplexity, agreement, greedy generation, latency) are written once
against :class:`Runner`, so an exported artifact is measured by exactly the code that
measured the eager model before it. A runner is stateful: it holds a KV cache and a position.
"""

from __future__ import annotations

import abc
import copy
from typing import Callable, Iterable

import torch

from export.decoding.sampling import Sampling, TokenSampler


class RunnerError(RuntimeError):
    """An artifact could not be loaded or run; the message names the file and the cause."""


class RunnerInputError(RunnerError, ValueError):
    """The tokens fed to a runner do not fit it (none at all, or more than its KV cache holds).

    A :class:`RunnerError` for the pipeline's handlers and a ``ValueError`` for callers that
    treat it as bad input; every runner raises it from :meth:`Runner.checked_ids`."""


class Runner(abc.ABC):
    """A causal LM in some runtime, driven one chunk of tokens at a time.

    Subclasses implement :meth:`reset` and :meth:`forward`. ``forward`` continues from the
    current position, so ``reset(); forward(prompt); forward([next_token])`` is prefill then
    one decode step, and ``reset(); forward(window)`` scores a window from a clean state.
    """

    #: short runtime label for reports, e.g. "eager", "executorch", "onnxruntime"
    runtime: str = "runner"
    #: largest total sequence (prompt + generated) the runner can hold, or None if unbounded
    max_seq_len: int | None = None
    #: the most tokens one call of speculative_runner()'s verification path takes (None: unbounded)
    verify_tokens: int | None = None
    #: speculative decoding's draft policy for this runner (:class:`export.decoding.speculative.DraftLength`),
    #: kept across generations: the call times it measures are this artifact's
    draft_policy = None

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget the KV cache; the next ``forward`` starts at position 0."""

    @abc.abstractmethod
    def forward(self, ids: torch.Tensor, *, all_logits: bool = True) -> torch.Tensor:
        """Feed token ids (1-D LongTensor of length T) at the current position.

        Returns float32 logits of shape ``[T, vocab]`` when ``all_logits`` else ``[1, vocab]``
        for the last position only. Implementations split long inputs into chunks their
        runtime accepts; the result is the same as one call.
        """

    def checked_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` as a 1-D LongTensor, refused when empty or when the cache cannot take them all.

        Runners call this first in :meth:`forward`, so the message is the same in every runtime."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        t = int(ids.numel())
        if t == 0:
            raise RunnerInputError("forward needs at least one token")
        pos, limit = self.position, self.max_seq_len
        if limit is not None and pos + t > limit:
            where = f"{self.path.name}: " if getattr(self, "path", None) is not None else ""
            raise RunnerInputError(
                f"{where}the KV cache is full: {pos} cached + {t} new tokens exceed max_seq_len={limit} "
                f"({limit - pos} positions left); call reset() or export with a larger max_seq_len")
        return ids

    @staticmethod
    def in_chunks(ids: torch.Tensor, chunk: int | None, all_logits: bool,
                  call: Callable[[torch.Tensor, bool], torch.Tensor]) -> torch.Tensor:
        """``call`` on ``ids`` in pieces of at most ``chunk`` tokens (None: one call), the logits of
        every piece concatenated, or the last position's: a runtime that prefills a long prompt in
        bounded calls returns what one call would."""
        if not chunk or ids.numel() <= chunk:
            return call(ids, all_logits)
        if not all_logits:  # keep only the last piece's row: a full-context prefill holds one chunk's logits
            last = None
            for i in range(0, int(ids.numel()), chunk):
                last = call(ids[i:i + chunk], False)
            return last
        return torch.cat([call(ids[i:i + chunk], True) for i in range(0, int(ids.numel()), chunk)], 0)

    def checked_rows(self, rests: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """``rests`` as one right-padded ``[k, longest]`` LongTensor (pads 0) and each row's length, for
        :meth:`forward_each`; refused, as :meth:`checked_ids` refuses, when a row is empty or the
        longest does not fit after what the cache holds."""
        rows = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in rests]
        lengths = [int(r.numel()) for r in rows]
        if min(lengths) == 0:
            raise RunnerInputError("forward_each needs at least one token in every row")
        pos, limit, longest = self.position, self.max_seq_len, max(lengths)
        if limit is not None and pos + longest > limit:
            where = f"{self.path.name}: " if getattr(self, "path", None) is not None else ""
            raise RunnerInputError(f"{where}the KV cache is full: {pos} cached + {longest} new tokens exceed "
                                   f"max_seq_len={limit}")
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : lengths[i]] = r
        return ids, lengths

    @property
    def position(self) -> int:
        """Tokens held in the cache now."""
        return getattr(self, "_pos", 0)

    def reserve(self, positions: int) -> None:
        """A hint before a generation: it will hold at most ``positions`` tokens (prompt, output and a
        last draft). A runtime whose cache is a buffer allocated per generation sizes it to that instead
        of ``max_seq_len`` (onnxruntime-genai); the others need nothing. Call it before ``reset``."""

    def truncate(self, n: int) -> bool:
        """Keep the first ``n`` cached positions and continue from position ``n``.

        Lets a scorer feed a shared context once and each continuation after it. Returns False
        where this runtime cannot drop positions exactly (the caller then resets and feeds the
        context again); raises for ``n`` outside ``1..position``."""
        if not 0 < n <= self.position:
            raise ValueError(f"truncate({n}): the cache holds {self.position} positions")
        return False

    def forward_each(self, rests: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Logits (``[len(r), vocab]`` each) for every one of ``rests`` fed after what the cache holds
        now, each as if alone, in one batched call; the cache is left as it was. None where this
        runtime has no batched path: the caller feeds them one at a time (``truncate`` in between)."""
        return None

    def scoring_runner(self) -> "Runner":
        """The runner to score log-likelihoods with: this one, or one over the same artifact that
        returns every fed position's logits in a call where this one returns only the last."""
        return self

    def speculative_runner(self) -> "Runner":
        """A runner over the same artifact whose calls of several tokens give, at every position, the
        logits one-token calls give, bit for bit, and whose cache cuts back exactly: what
        :func:`export.decoding.speculative.speculative_generate` needs to keep plain greedy decoding's tokens.
        Refused (:class:`RunnerError`, with the reason) where this runtime has no such path."""
        raise RunnerError(f"{self.runtime} has no verification path whose several-token calls give one-token "
                          "calls' logits bit for bit; speculative decoding would not keep plain greedy's tokens "
                          "(an ExecuTorch .pte exported with verify_tokens has one)")

    def draft_runner(self) -> "Runner":
        """A runner over the artifact's own draft model (what ``--speculative draft`` drafts with), with a
        KV cache of its own; refused (:class:`RunnerError`) where the artifact carries none."""
        raise RunnerError(f"{self.runtime} artifacts here carry no draft model (an ExecuTorch .pte exported with "
                          "the pipeline's draft block has one)")

    #: the draft head's row -> token id where it covers part of the vocabulary (None: all of it, or no draft)
    draft_vocab: list[int] | None = None

    def size_bytes(self) -> int | None:
        """Size of the shipped artifact in bytes, or None if not applicable."""
        return None

    def describe(self) -> dict:
        """Runtime settings for the report (threads, providers, optimization level...)."""
        return {"runtime": self.runtime, "max_seq_len": self.max_seq_len}

    def close(self) -> None:  # pragma: no cover - default no-op
        pass


def checked_prompt(runner: Runner, prompt_ids: Iterable[int] | torch.Tensor, caller: str) -> torch.Tensor:
    """A generation prompt as a 1-D LongTensor, refused when empty or when it leaves no room in the
    runner's cache for a generated token (the same words for every decoding loop)."""
    ids = torch.as_tensor(list(prompt_ids) if not isinstance(prompt_ids, torch.Tensor) else prompt_ids,
                          dtype=torch.long).reshape(-1)
    if ids.numel() == 0:
        raise ValueError(f"{caller} needs a non-empty prompt")
    limit = runner.max_seq_len
    if limit is not None and ids.numel() >= limit:
        raise ValueError(f"prompt of {ids.numel()} tokens does not fit max_seq_len={limit}")
    return ids


def argmax_ids(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of ``logits`` (``[V]`` or ``[T, V]``), the first index on ties as
    ``torch.argmax`` gives it (NaN counts as the largest in both), computed by numpy on this thread.

    Why not ``torch.argmax``: over a vocabulary-wide row torch splits the reduction across its OpenMP
    pool, and the woken workers then spin for a core while the runtime's next call runs on its own
    threads. SmolLM2's ``.pte``, 2 cores, position 300 (2026-12-07): a 4-token ``verify`` call took
    16.0-16.6 ms after a torch argmax of the previous call's logits against 11.3-11.5 ms after this
    one, and a one-token ``forward`` 6.6-7.1 ms against 6.1-6.4 ms."""
    rows = logits.detach().to("cpu", torch.float32).numpy()
    if rows.ndim == 1:
        return [int(rows.argmax())]
    return rows.reshape(-1, rows.shape[-1]).argmax(-1).tolist()


def greedy_generate(
    runner: Runner,
    prompt_ids: Iterable[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_ids: Iterable[int] = (),
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Greedy decode ``max_new_tokens`` after ``prompt_ids``; returns only the new ids.

    Stops early on an EOS id or when the runner's ``max_seq_len`` is reached.
    ``on_token`` is called with each new id as it is produced (for streaming output).
    """
    return generate_ids(runner, prompt_ids, max_new_tokens, eos_token_ids=eos_token_ids, on_token=on_token)


def generate_ids(
    runner: Runner,
    prompt_ids: Iterable[int] | torch.Tensor,
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    eos_token_ids: Iterable[int] = (),
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Decode ``max_new_tokens`` after ``prompt_ids``, greedily (``sampling`` None) or sampled
    (:class:`export.decoding.sampling.Sampling`: one draw per token from its seed, so
    :func:`export.decoding.speculative.speculative_generate` with the same ``sampling`` emits the same tokens);
    returns only the new ids. Stops as :func:`greedy_generate` does."""
    ids = checked_prompt(runner, prompt_ids, "greedy_generate" if sampling is None else "generate_ids")
    choose = (lambda row: argmax_ids(row)[0]) if sampling is None else TokenSampler(sampling).choose
    eos = set(int(e) for e in eos_token_ids)
    limit = runner.max_seq_len
    runner.reset()
    logits = runner.forward(ids, all_logits=False)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = choose(logits[-1])
        out.append(nxt)
        if on_token is not None:
            on_token(nxt)
        if nxt in eos:
            break
        if limit is not None and runner.position >= limit:
            break
        logits = runner.forward(torch.tensor([nxt], dtype=torch.long), all_logits=False)
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two token sequences differ (the shorter one's length where one is a prefix
    of the other), or None where they are equal."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return min(len(a), len(b)) if at is None and len(a) != len(b) else at


class EagerRunner(Runner):
    """A Hugging Face causal LM in eager PyTorch, with a DynamicCache.

    Used for the baseline and every stage's checks, and as the reference that exported
    runners are compared against.
    """

    runtime = "eager"

    def __init__(self, model: torch.nn.Module, max_seq_len: int | None = None):
        self.model = model
        self.max_seq_len = max_seq_len
        self._cache = None
        self._pos = 0

    def reset(self) -> None:
        self._cache = None
        self._pos = 0

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, *, all_logits: bool = True) -> torch.Tensor:
        from transformers import DynamicCache

        ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
        t = ids.shape[1]
        if self._cache is None:
            self._cache = DynamicCache(config=getattr(self.model, "config", None))
        device = next(self.model.parameters()).device
        pos = torch.arange(self._pos, self._pos + t, device=device).unsqueeze(0)
        out = self.model(
            input_ids=ids.to(device),
            position_ids=pos,
            cache_position=pos[0],
            past_key_values=self._cache,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
        self._cache = out.past_key_values
        self._pos += t
        return out.logits[0].float()

    def _plain_cache(self) -> bool:
        """Whether every layer keeps every position (no sliding window, no linear attention)."""
        layers = getattr(self._cache, "layers", None)
        return layers is not None and all(type(layer).__name__ == "DynamicLayer" for layer in layers)

    def truncate(self, n: int) -> bool:
        """Crop the DynamicCache; a sliding-window or linear-attention layer cannot give back what it
        dropped, so such caches answer False."""
        if not 0 < n <= self.position:
            return super().truncate(n)
        if not self._plain_cache():
            return False
        if n < self._pos:  # a negative count removes that many positions (every transformers version)
            self._cache.crop(n - self._pos)
        self._pos = n
        return True

    @torch.inference_mode()
    def forward_each(self, rests: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The choices of one context as one batch: the cache copied once per choice, the choices
        right-padded (a pad only follows the tokens it could disturb, and causal attention keeps it
        from reaching back), every row at the same positions."""
        if self._cache is None or len(rests) < 2 or not self._plain_cache():
            return None
        ids, lengths = self.checked_rows(rests)
        longest = ids.shape[1]
        device = next(self.model.parameters()).device
        cache = copy.deepcopy(self._cache)
        cache.batch_repeat_interleave(len(rests))
        pos = torch.arange(self._pos, self._pos + longest, device=device)
        out = self.model(input_ids=ids.to(device), position_ids=pos.unsqueeze(0).expand(len(rests), -1),
                         cache_position=pos, past_key_values=cache, use_cache=True)
        return [out.logits[i, : lengths[i]].float() for i in range(len(rests))]
