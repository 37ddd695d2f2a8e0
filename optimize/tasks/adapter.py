"""An ``lm_eval.api.model.LM`` over any :class:`export.runtime.Runner`.

Every runtime the project exports to (eager PyTorch, ExecuTorch ``.pte``, ONNX Runtime, TorchChat)
has a Runner, so one adapter scores lm-eval's tasks in each of them, from the runtime's own logits.
Tokenization and request handling follow lm-eval's ``HFLM`` (``TemplateLM._encode_pair``: trailing
spaces of the context move to the continuation; an empty context is the BOS, else EOS, token;
inputs are truncated from the left to ``max_length + 1`` tokens and the last one dropped), so the
log-likelihoods equal HFLM's on the same model (tests/optimize/tasks/test_adapter.py).

How a request is fed: ``reset()``, then the tokens before the continuation with
``all_logits=False`` (one chunked prefill; a runtime that can skip the output projection for those
positions does), then the continuation's positions with ``all_logits=True``. A ``.pte`` exported
with ``logits: last`` thus takes the context in chunks and only the continuation's few tokens one
at a time. Requests whose fed tokens are identical (one-token continuations of one context, e.g.
boolq's "yes"/"no") share one run.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from optimize.tasks.data import require_lm_eval

require_lm_eval()

from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix  # noqa: E402

log = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 2048


class RunnerLM(TemplateLM):
    """lm-eval's LM interface over a Runner: ``loglikelihood`` and ``loglikelihood_rolling``.

    ``max_length``: tokens a request may hold (left-truncated beyond it); default the runner's
    ``max_seq_len``, else 2048 as HFLM. ``add_bos_token`` as HFLM's (None: the tokenizer's default).
    """

    backend = "causal"

    def __init__(self, runner, tokenizer, *, max_length: int | None = None, add_bos_token: bool | None = None,
                 progress: bool = False):
        super().__init__()
        self.runner = runner
        self.tokenizer = tokenizer
        self.add_bos_token = add_bos_token
        limit = getattr(runner, "max_seq_len", None)
        self._max_length = int(max_length or limit or DEFAULT_MAX_LENGTH)
        if limit is not None and self._max_length > limit:
            self._max_length = int(limit)
        self.progress = progress
        #: runner calls and tokens fed, for the report
        self.stats = {"requests": 0, "runs": 0, "tokens": 0}

    # -- tokens, as HFLM -------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        kw = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            kw["add_special_tokens"] = False
        enc = self.tokenizer.encode(string, **kw)
        return enc[-left_truncate_len:] if left_truncate_len else enc

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # -- scoring -------------------------------------------------------------------------------
    def _run(self, inp: list[int], start: int) -> torch.Tensor:
        """Log-probabilities (float32) at positions ``start..len(inp)-1`` of ``inp`` fed from a clean state."""
        r = self.runner
        r.reset()
        if start > 0:
            r.forward(torch.tensor(inp[:start], dtype=torch.long), all_logits=False)
        logits = r.forward(torch.tensor(inp[start:], dtype=torch.long), all_logits=True)
        self.stats["runs"] += 1
        self.stats["tokens"] += len(inp)
        # float32, as lm-eval's HFLM: a float64 log-softmax differs from HFLM's by up to ~4e-4 nats on
        # SmolLM2's 49k vocabulary (HFLM's own rounding); the sums are taken in float64
        return torch.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation), whether every continuation token is the argmax)`` per request."""
        from tqdm.auto import tqdm

        prepared = []
        for _, ctx, cont in requests:
            if not ctx or not cont:
                raise ValueError("a loglikelihood request needs a non-empty context and continuation "
                                 f"(got {len(ctx)} and {len(cont)} tokens)")
            if len(cont) > self.max_length:
                raise ValueError(f"a continuation of {len(cont)} tokens exceeds max_length={self.max_length}")
            whole = ctx + cont
            if len(whole) > self.max_length + 1:
                log.warning("request of %d tokens exceeds max_length=%d; truncating %d from the left",
                            len(whole), self.max_length, len(whole) - self.max_length - 1)
            inp = whole[-(self.max_length + 1):][:-1]
            prepared.append((tuple(inp), cont))
        # identical inputs share a run; the run starts returning logits at the earliest needed position
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (inp, _) in enumerate(prepared):
            groups.setdefault(inp, []).append(i)
        out: list[tuple[float, bool] | None] = [None] * len(prepared)
        order = sorted(groups, key=lambda t: -len(t))  # longest first: a too-long input fails early
        for inp in tqdm(order, desc=f"{getattr(self.runner, 'runtime', 'runner')} loglikelihood",
                        disable=disable_tqdm or not self.progress):
            idx = groups[inp]
            start = min(len(inp) - len(prepared[i][1]) for i in idx)
            logp = self._run(list(inp), start)
            for i in idx:
                cont = prepared[i][1]
                lo = len(inp) - len(cont) - start
                rows = logp[lo: lo + len(cont)]
                target = torch.tensor(cont, dtype=torch.long)
                ll = float(rows.gather(1, target[:, None]).double().sum())
                greedy = bool((rows.argmax(-1) == target).all())
                out[i] = (ll, greedy)
                self.cache_hook.add_partial("loglikelihood", requests[i][0], (ll, greedy))
        self.stats["requests"] += len(prepared)
        return out  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood in disjoint windows of ``max_length`` (HFLM's windows)."""
        from lm_eval import utils

        results = []
        for (string,) in [req.args for req in requests]:
            windows = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows], disable_tqdm=True)
            total = sum(s for s, _ in scores)
            results.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return results

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        raise NotImplementedError(
            "RunnerLM scores log-likelihood tasks only (multiple choice, perplexity); generation tasks "
            "(generate_until) are not supported: use optimize run for generation")


def loglikelihoods(lm: RunnerLM, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """``lm.loglikelihood`` on plain ``(context, continuation)`` pairs (no lm-eval Instances needed)."""
    from lm_eval.api.instance import Instance

    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    return lm.loglikelihood(reqs, disable_tqdm=True)


__all__: list[Any] = ["RunnerLM", "loglikelihoods"]
