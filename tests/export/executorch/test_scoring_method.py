"""``scoring_method``: a ``logits: last`` program also carries ``forward_all`` (every position's logits,
same weights stored once), and the runner cuts its cache back for shared-context scoring.

Tolerances: logits of the two methods within 1e-4 of the logit scale (the same XNNPACK kernels over
different chunk lengths); a cut-back cache gives a fresh run's logits to 1e-5 (the same calls)."""

from __future__ import annotations

import pytest
import torch

from export.executorch.exporter import ExecuTorchExporter
from export.executorch.runner import SCORING_METHOD, ExecuTorchRunner

TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152, max_position_embeddings=256, tie_word_embeddings=True,
            rope_theta=100000.0, initializer_range=0.2)
MAX_SEQ_LEN = 64

pytestmark = pytest.mark.timeout(1200)


def _export(cfg, tmp, **opts):
    from targets.sources import RandomSource, load_model

    loaded = load_model(RandomSource(config=dict(cfg), seed=0))
    res = ExecuTorchExporter().export(loaded.model, loaded.tokenizer, tmp, {"max_seq_len": MAX_SEQ_LEN, **opts},
                                      log=lambda *a: None)
    return loaded, res


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    return _export(TINY, tmp_path_factory.mktemp("scoring"), quantize="8da4w", group_size=32, scoring_method=True)


def _ids(n, seed=0):
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow  # over 5 s on the CI host: make test-fast skips it
def test_forward_all_returns_every_position_as_forward_does_one_at_a_time(scored):
    _, res = scored
    assert res.details["llm_ops"]["scoring_method"] == SCORING_METHOD
    runner = ExecuTorchRunner(res.artifact)
    assert runner.method == "forward" and not runner.all_positions
    scoring = runner.scoring_runner()
    assert scoring.method == SCORING_METHOD and scoring.all_positions
    assert runner.scoring_runner() is not runner and scoring.describe()["method"] == SCORING_METHOD
    ids = _ids(40)
    runner.reset()
    one_by_one = runner.forward(ids, all_logits=True)  # a last-only program: one token a call
    scoring.reset()
    at_once = scoring.forward(ids, all_logits=True)
    assert at_once.shape == one_by_one.shape == (40, TINY["vocab_size"])
    scale = one_by_one.abs().max().item()
    assert (at_once - one_by_one).abs().max().item() <= 1e-4 * scale


def test_speculative_decoding_is_refused_without_the_verify_method(scored):
    """forward_all's several-token calls attend a block of rows at once, which does not give one-token
    calls' logits bit for bit: speculative decoding asks for verify and names the option."""
    from export.decoding.runtime import RunnerError

    _, res = scored
    with pytest.raises(RunnerError, match="verify_tokens"):
        ExecuTorchRunner(res.artifact).speculative_runner()


def test_truncate_continues_from_the_cut_as_a_fresh_run(scored):
    _, res = scored
    r = ExecuTorchRunner(res.artifact).scoring_runner()
    prefix, a, b = _ids(20, 1), _ids(12, 2), _ids(9, 3)
    r.reset()
    r.forward(prefix, all_logits=False)
    r.forward(a)
    assert r.position == 32 and r.truncate(20) and r.position == 20
    cut = r.forward(b)
    r.reset()
    r.forward(prefix, all_logits=False)
    fresh = r.forward(b)
    assert (cut - fresh).abs().max().item() <= 1e-5 * fresh.abs().max().item()
    with pytest.raises(ValueError, match="truncate"):
        r.truncate(r.position + 1)


@pytest.mark.slow
def test_the_second_method_stores_no_second_copy_of_the_weights(scored, tmp_path):
    _, with_scoring = scored
    _, plain = _export(TINY, tmp_path / "plain", quantize="8da4w", group_size=32)
    a, b = with_scoring.artifact.stat().st_size, plain.artifact.stat().st_size
    assert SCORING_METHOD not in ExecuTorchRunner(plain.artifact).describe()["methods"]
    assert ExecuTorchRunner(plain.artifact).scoring_runner().method == "forward"
    # the weights are a few MB here; a second copy would add all of it, a second graph adds a few KB
    assert a - b <= 0.05 * b, (a, b)


@pytest.mark.slow
def test_a_ring_cache_is_not_cut_back(tmp_path):
    cfg = {**TINY, "model_type": "mistral", "sliding_window": 16}
    _, res = _export(cfg, tmp_path, scoring_method=True)
    r = ExecuTorchRunner(res.artifact).scoring_runner()
    r.reset()
    r.forward(_ids(30), all_logits=False)
    assert r.truncate(10) is False and r.position == 30
