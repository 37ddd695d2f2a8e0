"""ExecuTorch's C++ text runner (TextLLMRunner) against our Python loop over the same .pte, the
fallback when it cannot be used, and the Python runner's prefill/position limits.

One tiny fp32 export (about 30 s) is shared by the module; SmolLM2's tokenizer, so the C++
tokenizer reads a real byte-level BPE ``tokenizer.json``. The program carries the ``verify`` method
(``verify_tokens``) beside ``forward``: ExecuTorch's C++ runner must still run it plainly, and
``optimize run --speculative ngram`` must give the plain answer."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from export.executorch.exporter import ExecuTorchExporter
from export.executorch.llm_runner import LLMRunnerUnavailable, unavailable_reason
from export.executorch.runner import ExecuTorchRunner
from export.decoding.runtime import EagerRunner, RunnerError, greedy_generate
from optimize.generate import generate_from_artifact

# initializer_range 0.2 makes greedy decoding vary token to token (a broken cache cannot hide)
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024, tie_word_embeddings=True,
            rope_theta=100000.0, initializer_range=0.2)
MAX_SEQ_LEN = 48
PROMPT = "The quick brown fox jumps over the lazy dog. def main(): return 1"

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def tiny():
    from targets.sources import RandomSource, load_model

    return load_model(RandomSource(config=dict(TINY), seed=0))


@pytest.fixture(scope="module")
def pte(tiny, tmp_path_factory):
    """The program carries verify and a draft method (its first layer, as the draft block's depth prune
    would leave it) beside forward: ExecuTorch's C++ runner must still run it plainly."""
    import copy

    from export.base import DraftSpec

    draft = copy.deepcopy(tiny.model)
    draft.model.layers = draft.model.layers[:1]
    draft.config.num_hidden_layers = 1
    out = tmp_path_factory.mktemp("et_runner")
    res = ExecuTorchExporter().export(tiny.model, tiny.tokenizer, out, {"max_seq_len": MAX_SEQ_LEN, "verify_tokens": 5},
                                      draft=DraftSpec(draft), log=lambda *a: None)
    return res.artifact


@pytest.mark.slow
def test_llm_runner_greedy_equals_python_loop_and_reports_stats(pte, tiny):
    runner = ExecuTorchRunner(pte)
    assert runner.describe()["llm_runner"] == {"usable": True}
    assert {"forward", "verify", "draft"} <= set(runner.describe()["methods"])
    ids = tiny.tokenizer(PROMPT)["input_ids"]
    rep = runner.llm_runner_report(ids, tiny.tokenizer, greedy_tokens=20, decode_tokens=8, runs=2, warmup=1)
    assert rep["used"], rep
    g = rep["greedy"]
    assert g["tokens"] == 20 and None not in g["llm_runner_ids"]
    assert g["llm_runner_ids"] == g["python_loop_ids"] and g["match"]
    # the Python loop itself equals eager greedy on these ids (so both equal the model)
    assert g["python_loop_ids"] == greedy_generate(EagerRunner(tiny.model), ids, 20)
    s = rep["stats"]
    assert s["prompt_tokens"] == len(ids) and s["generated_tokens"] == 8 and s["runs"] == 2
    assert s["prefill_ms"] >= 0 and s["ttft_ms"] >= s["prefill_ms"] - 1e-9


@pytest.mark.slow
def test_llm_runner_ids_cross_prefill_and_run_to_the_cache_limit(pte, tiny):
    """A prompt near max_seq_len: the runner's prefill and decode up to the last position match the loop."""
    runner = ExecuTorchRunner(pte)
    llm = runner.llm_runner()
    ids = tiny.tokenizer((PROMPT + " ") * 3)["input_ids"][:40]
    text, num_bos = llm.prompt_for(tiny.tokenizer, ids)
    gen = llm.generate(text, 100, num_bos=num_bos)
    assert gen.prompt_ids == ids
    # the runner stops with prompt + new = max_seq_len
    assert len(gen.ids) == MAX_SEQ_LEN - len(ids)
    assert gen.ids == greedy_generate(runner, ids, len(gen.ids))


@pytest.mark.slow
def test_optimize_run_uses_the_llm_runner_and_streams_the_loops_text(pte, capsys):
    text = generate_from_artifact(pte, PROMPT, max_new_tokens=12, runner="llm", stream=None)
    assert "[ExecuTorch TextLLMRunner] prompt" in capsys.readouterr().err
    assert text and text == generate_from_artifact(pte, PROMPT, max_new_tokens=12, runner="python", stream=None)
    # chat template: special tokens written out as text must come back as the same ids
    chat = generate_from_artifact(pte, "What is the capital of France?", max_new_tokens=30, chat=True, runner="llm",
                                  stream=None)
    assert chat == generate_from_artifact(pte, "What is the capital of France?", max_new_tokens=30, chat=True,
                                          runner="python", stream=None)


@pytest.mark.slow
def test_optimize_run_speculative_gives_the_plain_answer(pte, capsys):
    """--speculative ngram: the Python loop through verify, the same text as plain decoding, and one line
    of what the drafts did; with --runner llm it is refused in one line (exit 2), before decoding."""
    from optimize.cli import main

    prompt = PROMPT + " " + PROMPT  # a prompt that repeats itself gives lookup something to draft from
    plain = generate_from_artifact(pte, prompt, max_new_tokens=20, runner="python", stream=None)
    capsys.readouterr()
    fast = generate_from_artifact(pte, prompt, max_new_tokens=20, speculative="ngram", stream=None)
    assert fast == plain and fast
    err = capsys.readouterr().err
    assert "[speculative ngram]" in err and "tokens in" in err and "TextLLMRunner" not in err
    assert main(["run", str(pte), "--prompt", "hi", "--speculative", "ngram", "--runner", "llm"]) == 2
    assert "drop --runner llm" in capsys.readouterr().err
    # the program's draft model drafts where lookup finds nothing: the same answer again
    assert generate_from_artifact(pte, prompt, max_new_tokens=20, speculative="draft", stream=None) == plain
    assert "[speculative draft]" in capsys.readouterr().err
    with pytest.raises(ValueError, match="speculative must be one of off, ngram, draft, got 'model'"):
        generate_from_artifact(pte, "hi", speculative="model", stream=None)


@pytest.mark.slow
def test_optimize_run_samples_the_seeds_answer_speculative_or_not(pte, capsys):
    """--temperature/--seed: the Python loop's sampled answer is the same with --speculative ngram (the
    standard rejection rule, one draw per token); --runner llm samples in the C++ runner with the
    temperature alone, and refuses a seed in one line (exit 2)."""
    from optimize.cli import main

    prompt = PROMPT + " " + PROMPT
    flags = ["--max-new-tokens", "20", "--temperature", "0.3", "--top-p", "0.9"]
    answers = {}
    for seed in ("1", "2"):
        for mode in ("off", "ngram"):
            assert main(["run", str(pte), "--prompt", prompt, *flags, "--seed", seed, "--speculative", mode]) == 0
            out = capsys.readouterr()
            answers[seed, mode] = out.out.strip()
            assert ("[speculative ngram, sampled]" in out.err) == (mode == "ngram")
        assert answers[seed, "off"] == answers[seed, "ngram"] and answers[seed, "off"]
    assert answers["1", "off"] != answers["2", "off"]  # the seed chose the answer
    # unseeded: what holds for every draw (any token, half a character included, crosses into Python)
    assert main(["run", str(pte), "--prompt", prompt, "--max-new-tokens", "8", "--temperature", "0.7",
                 "--runner", "llm"]) == 0
    out = capsys.readouterr()
    assert "[ExecuTorch TextLLMRunner] prompt" in out.err and out.out.endswith("\n")
    assert main(["run", str(pte), "--prompt", "hi", "--temperature", "0.7", "--seed", "1", "--runner", "llm"]) == 2
    assert "no --seed: drop them, or use --runner python" in capsys.readouterr().err


@pytest.mark.slow
def test_pipeline_verification_reports_the_llm_runner(pte, tiny):
    """The export row's verification runs the .pte through the C++ runner too: its greedy tokens
    against the Python loop's and its own stats land in the row's details beside the loop's figures."""
    from optimize.config import load_config
    from optimize.measure import RunState, measure_runner

    cfg = load_config({"version": 1, "name": "t", "model": {"source": "random", "config": dict(TINY)}, "stages": [],
                       "checks": {"accuracy": False, "generate_tokens": 6,
                                  "latency": {"prompt_tokens": 16, "decode_tokens": 4, "runs": 1, "warmup": 0}}},
                      check_model=False)
    said = []
    state = RunState(cfg=cfg, run_dir=None, profile=None, tokenizer=tiny.tokenizer, eval_windows=[], calibration=[],
                      train_ids=torch.zeros(0, dtype=torch.long), prompt=torch.tensor(tiny.tokenizer(PROMPT)["input_ids"]),
                      say=said.append)
    details: dict = {}
    metrics = measure_runner(state, tiny.model, ExecuTorchRunner(pte), details)
    rep = details["llm_runner"]
    assert rep["used"] and rep["greedy"]["match"] and rep["greedy"]["tokens"] == 6, rep
    assert rep["stats"]["generated_tokens"] == 4 and metrics.decode_tok_s is not None
    assert details["greedy"]["match"]  # the Python loop against eager, as before
    assert any("ExecuTorch C++ runner: greedy matches the Python loop" in s for s in said), said
    # the program carries verify: prompt lookup through it is checked against plain greedy of the program
    spec = details["speculative"]
    assert spec["match"] and spec["method"] == "verify" and spec["verify_tokens"] == 5, spec
    said_twice = 2 * min(32, state.prompt.numel())
    assert spec["tokens"] == min(64, MAX_SEQ_LEN - said_twice) and spec["calls"] <= spec["tokens"]
    assert any("speculative decoding (prompt lookup through verify)" in s for s in said), said
    # and the program's draft model through it, on the prompt as it is
    assert spec["draft"]["match"] and spec["draft"]["draft_calls"] > 0, spec["draft"]


@pytest.mark.slow
def test_unsupported_tokenizer_falls_back_with_a_logged_reason(pte, tmp_path, caplog):
    """The C++ tokenizer refuses a Lowercase normalizer (transformers accepts it): auto falls back and
    says why; llm refuses with the same reason."""
    for f in pte.parent.iterdir():
        if f.is_file():
            shutil.copy(f, tmp_path / f.name)
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    tj["normalizer"] = {"type": "Lowercase"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj))
    with caplog.at_level(logging.WARNING, logger="optimize.generate"):
        out = generate_from_artifact(tmp_path / pte.name, PROMPT, max_new_tokens=6, stream=None)
    assert "instead of ExecuTorch's C++ LLM runner" in caplog.text and "Lowercase" in caplog.text
    assert out == generate_from_artifact(tmp_path / pte.name, PROMPT, max_new_tokens=6, runner="python", stream=None)
    with pytest.raises(RunnerError, match="C\\+\\+ LLM runner cannot run .*Lowercase"):
        generate_from_artifact(tmp_path / pte.name, PROMPT, max_new_tokens=6, runner="llm", stream=None)
    rep = ExecuTorchRunner(tmp_path / pte.name).llm_runner_report([1, 2, 3], None)
    assert rep["used"] is False and "Lowercase" in rep["reason"]


def test_unavailable_reasons():
    assert "get_max_seq_len" in unavailable_reason(["forward"], 2, None)
    assert "3 inputs" in unavailable_reason(["forward", "get_max_seq_len"], 3, None)
    assert "no tokenizer file" in unavailable_reason(["forward", "get_max_seq_len"], 2, None)


@pytest.mark.slow
def test_prefill_of_max_seq_len_tokens_in_chunks_and_a_full_cache_is_a_clear_error(pte, tiny):
    runner = ExecuTorchRunner(pte)
    # from get_max_prefill_chunk and forward's input bound: the whole cache in one call (the custom-op
    # program's sequence dim is bounded by max_seq_len itself, not max_seq_len - 1)
    assert runner.max_chunk == MAX_SEQ_LEN
    ids = torch.randint(0, TINY["vocab_size"], (MAX_SEQ_LEN,), generator=torch.Generator().manual_seed(3))
    whole = runner.forward(ids)
    assert runner.position == MAX_SEQ_LEN and whole.shape == (MAX_SEQ_LEN, TINY["vocab_size"])
    ref = EagerRunner(tiny.model).forward(ids)
    assert (whole - ref).abs().max() < 1e-4
    with pytest.raises(RunnerError, match="KV cache is full: 48 cached \\+ 1 new tokens .*0 positions left"):
        runner.forward(ids[:1])
    # smaller chunks (as a program with a smaller get_max_prefill_chunk would need) give the same logits
    runner.reset()
    runner.max_chunk = 5
    assert (runner.forward(ids) - whole).abs().max() < 1e-4
    runner.reset()
    last = runner.forward(ids[:20], all_logits=False)  # in chunks of 5, keeping only a copy of the last row
    assert (last - whole[19:20]).abs().max() < 1e-4 and last.untyped_storage().nbytes() == last.numel() * 4
    runner.reset()
    runner.all_positions = False  # a program that returns only the last position: fed one token at a time
    assert (runner.forward(ids[:7]) - whole[:7]).abs().max() < 1e-4
    assert (runner.forward(ids[7:20], all_logits=False) - whole[19:20]).abs().max() < 1e-4


def test_llm_runner_unavailable_is_a_runtime_error():
    assert issubclass(LLMRunnerUnavailable, RuntimeError)


def test_report_shows_delegation_and_the_llm_runner():
    """The markdown report carries the export row's delegated fraction, the portable ops left and
    the C++ runner's stats with its greedy verdict (or why it was not used)."""
    from optimize.report import Report, StageRow, render_markdown

    used = {"used": True, "stats": {"prefill_ms": 118.0, "prompt_tokens": 128, "decode_tok_s": 301.5},
            "greedy": {"tokens": 16, "match": True, "diverged_at": None}}
    rows = [StageRow(index=0, name="export:executorch", kind="export:executorch", runtime="executorch",
                     details={"delegation": {"delegated_fraction": 0.8123, "delegated_subgraphs": 31,
                                             "delegate_calls": 32,
                                             "portable_ops": {"llama::custom_sdpa.out": 30}},
                              "llm_runner": used}),
            StageRow(index=0, name="export:other", kind="export:other", runtime="executorch",
                     details={"llm_runner": {"used": False, "reason": "no tokenizer file"}})]
    md = render_markdown(Report(name="t", rows=rows))
    assert "## Export runtime" in md
    assert ("- export:executorch: 81.2% of ops delegated (31 subgraphs, 32 delegate calls a forward); portable kernel "
            "calls a forward: llama::custom_sdpa.out 30") in md
    assert ("- export:executorch, ExecuTorch C++ runner (TextLLMRunner): prefill 118 ms for 128 tokens, decode 301.5 "
            "tok/s; greedy 16 tokens equal the Python loop's") in md
    assert "- export:other, ExecuTorch C++ runner not used: no tokenizer file" in md


@pytest.mark.slow  # lowers a program of its own (about 15 s)
def test_programs_run_at_one_torch_thread_and_eager_keeps_its_own(pte, tiny):
    """The Python loop and the C++ runner call ExecuTorch with libtorch at one intra-op thread
    (export/executorch/blas_threads.py: threaded MKL inside custom_sdpa fights XNNPACK), and restore the
    caller's count afterwards."""
    runner = ExecuTorchRunner(pte)
    seen = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            attr = getattr(self.inner, name)
            if name not in ("execute", "generate"):
                return attr

            def call(*a, **k):
                seen.append((name, torch.get_num_threads()))
                return attr(*a, **k)
            return call

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner._method = Spy(runner._method)
        runner.forward(torch.tensor([5, 6, 7]))
        assert torch.get_num_threads() == 2
        llm = runner.llm_runner()
        llm._runner = Spy(llm._runner)
        llm.generate(PROMPT, 2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert ("execute", 1) in seen and ("generate", 1) in seen and all(n == 1 for _, n in seen), seen


@pytest.mark.slow  # the module's `pte`
def test_the_chat_end_marker_streamed_as_text_is_the_eos_id_not_text(pte, tiny):
    """TextLLMRunner streams an added special token (SmolLM2's <|im_end|>, its EOS) as its literal
    text, which the C++ tokenizer's decode does not give back: it must still count as the EOS (never
    shown, never part of the answer). The other pieces are the tokens' own spellings, one id each."""
    llm = ExecuTorchRunner(pte).llm_runner()
    assert 2 in llm.eos_ids
    words = [*tiny.tokenizer.convert_tokens_to_ids(["ĠParis", "."]), 10391, 233]  # 10391 233: わ, split
    pieces = tiny.tokenizer.convert_ids_to_tokens(words)
    assert llm._resolve_ids([*pieces, "<|im_end|>"], ended_early=True) == [*words, 2]
    assert llm.decode([*words, 2]) == " Paris.わ<|im_end|>"


@pytest.mark.slow  # the module's `pte`
def test_optimize_run_prints_the_answer_and_one_timing_line_only(pte, tmp_path):
    """`optimize run` in a fresh process: stdout is the answer's one line, stderr the runner's one
    timing line; ExecuTorch's own cpuinfo prints (straight to file descriptor 2) stay out."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    argv = ["run", str(pte), "--chat", "--prompt", "Hello there", "--max-new-tokens", "6"]
    done = subprocess.run([sys.executable, "-c", f"from optimize.cli import main; raise SystemExit(main({argv!r}))"],
                          capture_output=True, env=env, cwd=tmp_path, timeout=300)  # bytes: a random model's "\r" stays
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, err[-2000:]
    import io

    streamed = io.StringIO()  # what the API streams for the same call: the CLI prints exactly that
    generate_from_artifact(pte, "Hello there", max_new_tokens=6, chat=True, runner="llm", stream=streamed,
                           say=None)
    assert out == streamed.getvalue() and out.strip() and "<|" not in out, repr(out)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[ExecuTorch TextLLMRunner] prompt"), err


@pytest.mark.slow  # the module's `pte`, in a fresh interpreter
def test_greedy_is_repeatable_in_an_embedding_process_without_mkl_num_threads(pte, tiny):
    """As an MLOps job embeds the API: torch imported first at two threads, ``MKL_NUM_THREADS`` unset. The runner
    makes MKL serial itself around each call (export/executorch/blas_threads.py), on ExecuTorch's workers too, so
    two greedy decodes give the same tokens, those of eager greedy."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = f"""
import json, threading, torch
torch.set_num_threads(2)
from export.executorch import blas_threads
from export.executorch.runner import ExecuTorchRunner
from export.decoding.runtime import greedy_generate
runner = ExecuTorchRunner({str(pte)!r})
seen = []
class Spy:
    def __init__(self, inner):
        self.inner = inner
    def __getattr__(self, name):
        return getattr(self.inner, name)
    def execute(self, *a):  # MKL's count on a thread with none of its own, as ExecuTorch's workers read it
        t = threading.Thread(target=lambda: seen.append(blas_threads.process_mkl()._get()))
        t.start(); t.join()
        return self.inner.execute(*a)
runner._method = Spy(runner._method)
prompt = {tiny.tokenizer(PROMPT)["input_ids"]!r}
first, second = greedy_generate(runner, prompt, 30), greedy_generate(runner, prompt, 30)
print("RESULT", json.dumps([first, second, blas_threads.process_mkl().default, sorted(set(seen))]))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("MKL_NUM_THREADS", "OMP_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[3])
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    first, second, default, seen = json.loads(line[0][len("RESULT "):])
    assert default > 1, "the process's MKL default must be threaded for the check to mean anything"
    assert seen == [1]  # inside each call, a thread without a count of its own runs MKL serially
    assert first == second == greedy_generate(EagerRunner(tiny.model), tiny.tokenizer(PROMPT)["input_ids"], 30)
