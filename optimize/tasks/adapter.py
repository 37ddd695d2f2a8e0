"""An ``lm_eval.api.model.LM`` over any :class:`export.decoding.runtime.Runner`.

Every runtime the project exports to (eager PyTorch, ExecuTorch ``.pte``, ONNX Runtime, TorchChat)
has a Runner, so one adapter scores lm-eval's tasks in each of them, from the runtime's own logits.
Tokenization and request handling follow lm-eval's ``HFLM`` (``TemplateLM._encode_pair``: trailing
spaces of the context move to the continuation; an empty context is the BOS, else EOS, token;
inputs are truncated from the left to ``max_length + 1`` tokens and the last one dropped), so the
log-likelihoods equal HFLM's on the same model (tests/optimize/tasks/test_adapter.py).

How a request is fed: the context with ``all_logits=False`` (one chunked prefill; a runtime that
can skip the output projection for those positions does), then the continuation with
``all_logits=True``. The choices of one multiple-choice item share their context: it is fed once,
then the choices go as one batch where the runtime has a batched path (``Runner.forward_each``:
eager), else one at a time with the runner cut back to the context (``Runner.truncate``) in between. A ``.pte`` exported with
``logits: last`` is scored through its ``forward_all`` method when it has one
(``scoring_method``), else the continuation goes one token a call. Identical continuations of one
context (boolq's "yes"/"no" are one token: both read the context's last logits) share one run.

Contexts are taken in token order, so those that share a beginning (a few-shot prefix, a task's
description) come one after another: the runner is cut back to the shared tokens and fed only the
rest (``stats["reused"]`` counts the tokens not fed again). ``generate_until`` decodes greedily
through the runner, as lm-eval's ``HFLM`` does through ``model.generate`` (the same context
encoding and truncation, stop sequences and ``max_gen_toks``; the text cut at the first stop
sequence), so the strings equal HFLM's wherever the greedy tokens do.
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
    """lm-eval's LM interface over a Runner: ``loglikelihood``, ``loglikelihood_rolling`` and
    ``generate_until`` (greedy).

    ``max_length``: tokens a request may hold (left-truncated beyond it); default the runner's
    ``max_seq_len``, else 2048 as HFLM. ``add_bos_token`` as HFLM's (None: the tokenizer's default).
    ``eos_token_ids``: ids that end a generation (default the tokenizer's EOS; HFLM's ``generate``
    stops on the model's ``generation_config`` EOS ids, so pass those for a model that has more).
    ``max_gen_toks``: the default when a task names none (HFLM's 256).
    """

    backend = "causal"

    def __init__(self, runner, tokenizer, *, max_length: int | None = None, add_bos_token: bool | None = None,
                 progress: bool = False, eos_token_ids: list[int] | None = None, max_gen_toks: int = 256):
        super().__init__()
        #: the runner, or one over the same artifact that returns every position's logits per call
        self.runner = runner.scoring_runner()
        self.tokenizer = tokenizer
        self.add_bos_token = add_bos_token
        limit = getattr(runner, "max_seq_len", None)
        self._max_length = int(max_length or limit or DEFAULT_MAX_LENGTH)
        if limit is not None and self._max_length > limit:
            self._max_length = int(limit)
        self.progress = progress
        self.max_gen_toks = int(max_gen_toks)
        eos = eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id]
        self.eos_token_ids = {int(e) for e in eos if e is not None}
        #: the tokens the runner holds now (None: unknown), so a context that shares them is cut back to them
        self._held: list[int] | None = None
        #: runner calls and tokens fed, for the report
        self.stats = {"requests": 0, "contexts": 0, "runs": 0, "tokens": 0, "reused": 0, "generated": 0,
                      "truncated": 0, "method": getattr(self.runner, "method", None)}

    def _truncated(self, what: str) -> None:
        """Count a request cut from the left (as HFLM cuts it); warn once, the count goes in the report."""
        if not self.stats["truncated"]:
            log.warning("%s (as lm-eval's HFLM truncates; further ones are counted in details.tasks.truncated)", what)
        self.stats["truncated"] += 1

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
    def _prefill(self, prefix: list[int]) -> torch.Tensor:
        """Feed ``prefix`` (``all_logits=False``) and return its last logits; the tokens it shares with
        what the runner holds are kept (the runner cut back to them) where the runtime can."""
        r = self.runner
        held = self._held or []
        k = 0
        for a, b in zip(held, prefix):
            if a != b:
                break
            k += 1
        k = min(k, len(prefix) - 1)  # at least one token is fed: its logits are the answer
        if k > 0 and r.truncate(k):
            self.stats["reused"] += k
        else:
            r.reset()
            k = 0
        self._held = None  # until the call below returns
        last = r.forward(torch.tensor(prefix[k:], dtype=torch.long), all_logits=False)
        self.stats["tokens"] += len(prefix) - k
        self._held = list(prefix)
        return last

    def _continue(self, prefix: list[int], rest: list[int], fresh: bool) -> torch.Tensor:
        """Logits for ``rest`` fed after ``prefix`` (``[len(rest), V]``). ``fresh``: the runner holds
        exactly ``prefix`` now; else it is cut back to it (or, where it cannot be, fed it again)."""
        r = self.runner
        if not fresh and not r.truncate(len(prefix)):
            self._held = None
            r.reset()
            r.forward(torch.tensor(prefix, dtype=torch.long), all_logits=False)
            self.stats["tokens"] += len(prefix)
        self.stats["runs"] += 1
        self.stats["tokens"] += len(rest)
        self._held = None
        out = r.forward(torch.tensor(rest, dtype=torch.long), all_logits=True)
        self._held = list(prefix) + list(rest)
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation), whether every continuation token is the argmax)`` per request.

        Requests are grouped by the tokens before their continuation's last context position (the
        question a multiple-choice item asks once per choice): that prefix is fed once, and each
        distinct continuation after it, the runner cut back to the prefix in between
        (``Runner.truncate``; where a runtime cannot, the prefix is fed again)."""
        from tqdm.auto import tqdm

        groups: dict[tuple[int, ...], dict[tuple[int, ...], list[int]]] = {}
        conts = []
        for i, (_, ctx, cont) in enumerate(requests):
            if not ctx or not cont:
                raise ValueError("a loglikelihood request needs a non-empty context and continuation "
                                 f"(got {len(ctx)} and {len(cont)} tokens)")
            if len(cont) > self.max_length:
                raise ValueError(f"a continuation of {len(cont)} tokens exceeds max_length={self.max_length}")
            whole = ctx + cont
            if len(whole) > self.max_length + 1:
                self._truncated(f"a request of {len(whole)} tokens exceeds max_length={self.max_length}; "
                                f"{len(whole) - self.max_length - 1} dropped from the left")
            inp = whole[-(self.max_length + 1):][:-1]
            # logits at the prefix's last position predict cont[0]; cont[:-1] then gives the rest
            cut = len(inp) - len(cont) + 1
            groups.setdefault(tuple(inp[:cut]), {}).setdefault(tuple(inp[cut:]), []).append(i)
            conts.append(cont)
        out: list[tuple[float, bool] | None] = [None] * len(requests)
        # in token order: contexts that share a beginning (a few-shot prefix) follow one another
        order = sorted(groups)
        r = self.runner
        for prefix in tqdm(order, desc=f"{getattr(r, 'runtime', 'runner')} loglikelihood",
                           disable=disable_tqdm or not self.progress):
            last = self._prefill(list(prefix))
            self.stats["contexts"] += 1
            fresh = True
            rests = [rest for rest in groups[prefix] if rest]
            batched = r.forward_each([torch.tensor(x, dtype=torch.long) for x in rests]) if len(rests) > 1 else None
            if batched is not None:  # the runtime scored every choice in one call
                self.stats["runs"] += 1
                self.stats["tokens"] += sum(len(x) for x in rests)
                batched = dict(zip(rests, batched))
            for rest, idx in groups[prefix].items():
                logits = last
                if rest and batched is not None:
                    logits = torch.cat([last, batched[rest]], 0)
                elif rest:
                    logits = torch.cat([last, self._continue(list(prefix), list(rest), fresh)], 0)
                    fresh = False
                # float32, as lm-eval's HFLM: a float64 log-softmax differs from HFLM's by up to ~4e-4
                # nats on SmolLM2's 49k vocabulary (HFLM's own rounding); the sums are taken in float64
                logp = torch.log_softmax(logits.float(), dim=-1)
                for i in idx:
                    target = torch.tensor(conts[i], dtype=torch.long)
                    ll = float(logp.gather(1, target[:, None]).double().sum())
                    greedy = bool((logp.argmax(-1) == target).all())
                    out[i] = (ll, greedy)
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], (ll, greedy))
        self.stats["requests"] += len(requests)
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

    def _encode_context(self, context: str) -> list[int]:
        """A generation context encoded as HFLM's ``tok_batch_encode`` does (for a batch of one)."""
        kw: dict = {}
        if has_bos_prefix(context, getattr(self.tokenizer, "bos_token", None)):
            kw = {"add_special_tokens": False}
        elif self.add_bos_token is not None:
            kw = {"add_special_tokens": self.add_bos_token}
        return list(self.tokenizer(context, **kw)["input_ids"])

    def _greedy(self, ids: list[int], max_new: int, until: list[str]) -> list[int]:
        """Greedy tokens after ``ids``, until an EOS id, a stop sequence in the decoded text,
        ``max_new`` tokens or the runner's ``max_seq_len``."""
        r = self.runner
        limit = getattr(r, "max_seq_len", None)
        logits = self._prefill(ids)
        out: list[int] = []
        stops = [u for u in until if u]
        while len(out) < max_new:
            nxt = int(torch.argmax(logits[-1]).item())
            out.append(nxt)
            if nxt in self.eos_token_ids:
                break
            if stops and any(u in self.tok_decode(out) for u in stops):
                break
            if limit is not None and len(ids) + len(out) >= limit:
                break
            self._held = None
            logits = r.forward(torch.tensor([nxt], dtype=torch.long), all_logits=False)
            self._held = ids + out
        self.stats["generated"] += len(out)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generation through the runner, one request at a time, contexts in token order
        (shared few-shot prefixes are cut back to, not fed again). A request that asks for sampling
        is refused: the runtime's generation here is greedy."""
        from tqdm.auto import tqdm
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        prepared = []
        for context, gen_kwargs in [req.args for req in requests]:
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample"):
                raise ValueError(f"a generate_until request asks for sampling ({gen_kwargs}); generation in the "
                                 "runtime is greedy: set do_sample: false in the task's generation_kwargs")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            max_ctx = self.max_length - max_gen
            if max_ctx <= 0:
                raise ValueError(f"max_gen_toks={max_gen} leaves no room for a context in max_length={self.max_length}")
            ids = self._encode_context(context)
            if len(ids) > max_ctx:
                self._truncated(f"a generation context of {len(ids)} tokens exceeds max_length - max_gen_toks = "
                                f"{max_ctx}; dropped from the left")
            prepared.append((ids[-max_ctx:], max_gen, until, context, gen_kwargs))
        results: list[str | None] = [None] * len(prepared)
        order = sorted(range(len(prepared)), key=lambda i: prepared[i][0])
        r = self.runner
        for i in tqdm(order, desc=f"{getattr(r, 'runtime', 'runner')} generate_until",
                      disable=disable_tqdm or not self.progress):
            ids, max_gen, until, context, gen_kwargs = prepared[i]
            self.stats["contexts"] += 1
            toks = self._greedy(ids, max_gen, until)
            text = postprocess_generated_text(self.tok_decode(toks), until, None)
            results[i] = text
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        self.stats["requests"] += len(requests)
        return results  # type: ignore[return-value]


def loglikelihoods(lm: RunnerLM, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """``lm.loglikelihood`` on plain ``(context, continuation)`` pairs (no lm-eval Instances needed)."""
    from lm_eval.api.instance import Instance

    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    return lm.loglikelihood(reqs, disable_tqdm=True)


__all__: list[Any] = ["RunnerLM", "loglikelihoods"]
