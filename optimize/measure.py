"""Measurements of a pipeline run: a model in eager mode after each stage, and an exported
artifact in its runtime, against the baseline (perplexity, logit agreement, parity and greedy
tokens against eager, size, latency).

Why apart from :mod:`optimize.pipeline`: the runner decides what runs and what is gated; this
module decides what a row's numbers are, and is what a test calls to check one row's figures.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from export.decoding.runtime import EagerRunner, Runner, first_divergence, greedy_generate
from export.verify import greedy_match, logits_parity
from optimize.checks import baseline_cache
from optimize.checks.accuracy import BaselineLogits, evaluate
from optimize.checks.latency import measure_latency, torch_threads
from optimize.checks.size import parameter_count, serialized_bytes
from optimize.config import PipelineConfigBase
from optimize.report import Metrics, StageRow
from optimize.tasks.evaluate import evaluate_tasks

MIB = 1024 * 1024


@dataclass
class RunState:
    """What a run's measurements need: its config, data windows, prompt and the baseline to compare with."""

    cfg: PipelineConfigBase
    run_dir: Path
    profile: Any
    tokenizer: Any
    eval_windows: list[torch.Tensor]
    calibration: list[torch.Tensor]
    train_ids: torch.Tensor
    prompt: torch.Tensor
    baseline_logits: BaselineLogits = field(default_factory=BaselineLogits)
    baseline_metrics: Metrics | None = None
    quantized: bool = False
    #: hash of the config up to the last stage: what the exported model is (keys the export cache)
    model_digest: str = ""
    say: Callable[[str], None] = print


def measure_baseline(state: RunState, model: torch.nn.Module) -> tuple[Metrics, dict]:
    """The model as loaded: :func:`measure_eager` keeping its log-probabilities as the baseline,
    or, with ``checks.baseline_cache``, the accuracy an earlier run measured on the very same
    model and text (:mod:`optimize.checks.baseline_cache`); latency is always measured. Returns
    the metrics and what the cache did (empty when it is off)."""
    cfg = state.cfg
    if not (cfg.checks.accuracy and cfg.checks.baseline_cache):
        return measure_eager(state, model, keep_baseline=True, timed=True), {}
    key = baseline_cache.baseline_key(model, state.eval_windows, threads=cfg.checks.latency.threads)
    if key is None:
        state.say("baseline cache: the model has tensors without plain bytes to key it by; measuring")
        return measure_eager(state, model, keep_baseline=True, timed=True), {"used": False, "reason": "unkeyable"}
    hit = baseline_cache.load(key, state.baseline_logits)
    if hit is None:
        m = measure_eager(state, model, keep_baseline=True, timed=True)
        path = baseline_cache.store(key, state.baseline_logits, m.perplexity, m.eval_tokens)
        return m, {"used": False, "key": key, "stored": str(path)}
    state.say(f"baseline: perplexity and log-probabilities reused from {hit.path} (same weights, text and toolchain)")
    m = Metrics(params=parameter_count(model), size_mb=serialized_bytes(model) / MIB, perplexity=hit.perplexity,
                eval_tokens=hit.tokens, top1_agreement=1.0, kl_divergence=0.0, perplexity_delta_pct=0.0)
    if cfg.checks.latency.enabled:
        fill_latency(m, EagerRunner(model), state)
    return m, {"used": True, "key": key, "path": str(hit.path)}


def measure_eager(state: RunState, model: torch.nn.Module, *, keep_baseline: bool = False, timed: bool = True) -> Metrics:
    cfg = state.cfg
    runner = EagerRunner(model)
    m = Metrics(params=parameter_count(model), size_mb=serialized_bytes(model) / MIB)
    if cfg.checks.accuracy:
        with torch_threads(cfg.checks.latency.threads):
            acc = evaluate(runner, state.eval_windows, None if keep_baseline else state.baseline_logits,
                           keep=state.baseline_logits if keep_baseline else None,
                           desc="baseline" if keep_baseline else "eval")
        m.perplexity, m.eval_tokens = acc.perplexity, acc.tokens
        m.top1_agreement = 1.0 if keep_baseline else acc.top1_agreement
        m.kl_divergence = 0.0 if keep_baseline else acc.kl_divergence
        if state.baseline_metrics is not None and state.baseline_metrics.perplexity:
            m.perplexity_delta_pct = 100.0 * (acc.perplexity / state.baseline_metrics.perplexity - 1.0)
        elif keep_baseline:
            m.perplexity_delta_pct = 0.0
    lat = cfg.checks.latency
    if lat.enabled and timed:
        fill_latency(m, runner, state)
    return m


def fill_latency(m: Metrics, runner: Runner, state: RunState) -> None:
    lat = state.cfg.checks.latency
    res = measure_latency(runner, state.prompt, lat.decode_tokens, runs=lat.runs, warmup=lat.warmup, threads=lat.threads)
    m.prefill_ms, m.prefill_tokens = res["prefill_ms"], res["prefill_tokens"]
    m.decode_tok_s, m.decode_tokens = res["decode_tok_s"], res["decode_tokens"]


def measure_runner(state: RunState, model: torch.nn.Module, runner: Runner, details: dict) -> Metrics:
    """Accuracy against the baseline, parity and greedy agreement with eager, size and latency."""
    cfg = state.cfg
    m = Metrics(params=parameter_count(model))
    size = runner.size_bytes()
    m.size_mb = size / MIB if size is not None else None
    details["runtime"] = runner.describe()
    eager = EagerRunner(model)
    with torch_threads(cfg.checks.latency.threads):
        if cfg.checks.accuracy:
            acc = evaluate(runner, state.eval_windows, state.baseline_logits, desc=runner.runtime)
            m.perplexity, m.eval_tokens = acc.perplexity, acc.tokens
            m.top1_agreement, m.kl_divergence = acc.top1_agreement, acc.kl_divergence
            m.perplexity_delta_pct = 100.0 * (acc.perplexity / state.baseline_metrics.perplexity - 1.0)
            details["parity_vs_eager"] = logits_parity(eager, runner, [w[:-1] for w in state.eval_windows[:1]])
        if cfg.checks.generate_tokens:
            details["greedy"] = greedy_compare(eager, runner, state)
            spec = speculative_compare(runner, state)
            if spec is not None:
                details["speculative"] = spec
                for how, r in (("prompt lookup", spec), ("draft model", spec.get("draft"))):
                    if r is not None:
                        state.say(f"speculative decoding ({how} through {spec['method']}): {r['tokens']} tokens "
                                  f"{'equal' if r['match'] else 'DIFFER from'} plain greedy, "
                                  f"{r['tokens_per_call']:.2f} a call")
    if cfg.checks.latency.enabled:
        fill_latency(m, runner, state)
        if hasattr(runner, "llm_runner_report"):  # a .pte: also through the C++ runner that apps embed
            lat = cfg.checks.latency
            rep = details["llm_runner"] = runner.llm_runner_report(
                state.prompt, state.tokenizer, greedy_tokens=max(1, cfg.checks.generate_tokens),
                decode_tokens=lat.decode_tokens, runs=lat.runs, warmup=lat.warmup)
            if rep["used"]:
                s = rep["stats"]
                state.say(f"ExecuTorch C++ runner: greedy {'matches' if rep['greedy']['match'] else 'DIFFERS from'} "
                          f"the Python loop; prefill {s['prefill_ms']:.0f} ms ({s['prompt_tokens']} tokens), "
                          f"decode {s['decode_tok_s'] or 0:.1f} tok/s")
    return m


def speculative_compare(runner: Runner, state: RunState) -> dict | None:
    """Where the artifact has a verification path (a ``.pte`` exported with ``verify_tokens``): prompt
    lookup through it against plain greedy decoding of the same artifact, on the greedy check's prompt
    said twice (so lookup has spans to copy), for at least 64 tokens. None where it has none."""
    from export.decoding.runtime import RunnerError
    from export.decoding.speculative import DraftLength, speculative_generate

    try:
        fast = runner.speculative_runner()
    except RunnerError:
        return None
    head = state.prompt[: min(32, state.prompt.numel())].tolist()

    def compare(prompt: list[int], **kw) -> dict:
        n = max(64, 4 * state.cfg.checks.generate_tokens)
        if runner.max_seq_len is not None:
            n = min(n, runner.max_seq_len - len(prompt))
        plain = greedy_generate(runner, prompt, n)
        got, stats = speculative_generate(fast, prompt, n, **kw)
        diverged = first_divergence(got, plain)
        return {"tokens": len(plain), "match": diverged is None, "diverged_at": diverged, **stats.as_dict()}

    out = {"method": "verify", "verify_tokens": fast.verify_tokens,
           **compare(head * 2, draft=DraftLength(measure=False))}
    drafter = model_drafter(runner)
    if drafter is not None:  # the draft method on the prompt as it is: open text, the draft model's case
        out["draft"] = compare(head, drafter=drafter, draft=DraftLength(measure=False))
        out["draft"]["method"] = "draft"
    return out


def model_drafter(runner: Runner):
    """A :class:`~export.decoding.drafters.ModelDrafter` over the artifact's own draft model (a ``.pte``'s
    ``draft`` method), or None where it has none."""
    from export.decoding.runtime import RunnerError
    from export.decoding.speculative import ModelDrafter

    try:
        return ModelDrafter(runner.draft_runner(), vocab_ids=runner.draft_vocab)
    except RunnerError:
        return None


def greedy_compare(eager: Runner, runner: Runner, state: RunState) -> dict:
    """Greedy tokens from eager and from the runtime, with where (if anywhere) they diverge."""
    n = state.cfg.checks.generate_tokens
    res = greedy_match(eager, runner, state.prompt[: min(32, state.prompt.numel())], n)
    return {
        "tokens": n,
        "match": res["match"],
        "diverged_at": res["diverged_at"],
        "eager_text": state.tokenizer.decode(res["ref_ids"]),
        "runtime_text": state.tokenizer.decode(res["test_ids"]),
    }


def score_tasks(state: RunState, runner: Runner, details: dict, model: torch.nn.Module | None = None) -> dict:
    """checks.tasks on one row, in the runner's runtime: ``{task or group: TaskScore}`` (each named one
    followed by its members); what ran goes in ``details["tasks"]`` (lm-eval version, runner calls,
    tokens fed, tokens reused from a shared prefix, tokens generated, seconds)."""
    tc = state.cfg.checks.tasks
    max_length = tc.max_length or runner.max_seq_len
    config = getattr(model, "config", None) if model is not None else None
    if max_length is None and config is not None:  # eager: the model's own context, as lm-eval's HF model reads it
        max_length = getattr(config, "max_position_embeddings", None)
    eos = _eos_ids(state, model)
    with torch_threads(state.cfg.checks.latency.threads):
        scores, facts = evaluate_tasks(runner, state.tokenizer, tc.names, include_path=tc.include_path,
                                       limit=tc.limit, num_fewshot=tc.num_fewshot, max_length=max_length,
                                       eos_token_ids=eos)
    details["tasks"] = facts
    return {s.task: s for s in scores}


def _eos_ids(state: RunState, model: torch.nn.Module | None) -> list[int]:
    """Ids that end a generation: the tokenizer's EOS and the model's generation_config EOS ids (what
    lm-eval's HFLM stops on through ``generate``)."""
    ids = [state.tokenizer.eos_token_id]
    gen = getattr(model, "generation_config", None) if model is not None else None
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids += list(extra) if isinstance(extra, (list, tuple)) else [extra]
    return sorted({int(i) for i in ids if i is not None})


def score_row_tasks(state: RunState, row: StageRow, model: torch.nn.Module, runner: Runner | None = None) -> None:
    """checks.tasks on this row when it is selected: eager rows through EagerRunner on the model,
    export rows through the artifact's own runner."""
    tasks = state.cfg.checks.tasks
    if not tasks.enabled or not tasks.selects(row.index, row.name, row.kind):
        return
    runner = runner or EagerRunner(model)
    state.say(f"{row.name}: scoring {', '.join(tasks.names)} in {runner.runtime}"
              + (f" (first {tasks.limit} items each)" if tasks.limit else ""))
    row.metrics.tasks = score_tasks(state, runner, row.details, model)
    state.say(f"{row.name}: " + ", ".join(f"{t} {s.metric} {s.score:.4g}" for t, s in row.metrics.tasks.items()
                                          if s.score is not None and s.parent is None))


def checks_key(cfg: PipelineConfigBase) -> str:
    """What a row's measurements depend on besides its model or artifact: the checks and the data
    (an export reused with other checks, a stage reused from the stage cache, is measured again)."""
    key = {"checks": cfg.checks.model_dump(mode="json"), "data": cfg.data.model_dump(mode="json")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

