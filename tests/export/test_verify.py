"""export.verify measures any Runner the same way; checked here on eager runners only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from export.decoding.runtime import EagerRunner, Runner
from export.verify import greedy_match, latency, logits_parity, perplexity


class _Shifted(Runner):
    """Wraps a runner and adds a fixed offset to one vocab column, to force disagreement."""

    runtime = "shifted"

    def __init__(self, inner: Runner, column: int, offset: float):
        self.inner, self.column, self.offset = inner, column, offset
        self.max_seq_len = inner.max_seq_len

    def reset(self):
        self.inner.reset()

    @property
    def position(self):
        return self.inner.position

    def forward(self, ids, *, all_logits=True):
        out = self.inner.forward(ids, all_logits=all_logits).clone()
        out[:, self.column] += self.offset
        return out


@pytest.fixture()
def ids():
    return torch.randint(0, 49152, (65,), generator=torch.Generator().manual_seed(0))


def test_parity_identical_and_shifted(tiny_llama, ids):
    ref, same = EagerRunner(tiny_llama), EagerRunner(tiny_llama)
    r = logits_parity(ref, same, [ids[:16], ids[16:40]])
    assert r == {"max_abs_diff": 0.0, "top1_agreement": 1.0, "tokens": 40}
    r = logits_parity(ref, _Shifted(EagerRunner(tiny_llama), 7, 1e4), [ids[:16]])
    assert r["max_abs_diff"] == pytest.approx(1e4, rel=1e-3)
    assert r["top1_agreement"] == 0.0


def test_perplexity_matches_direct_computation(tiny_llama, ids):
    r = perplexity(EagerRunner(tiny_llama), ids, seq_len=32)
    assert r["tokens"] == 64
    with torch.inference_mode():
        nll = sum(
            F.cross_entropy(tiny_llama(ids[s : s + 32][None]).logits[0].float(), ids[s + 1 : s + 33], reduction="sum")
            for s in (0, 32)
        )
    assert r["perplexity"] == pytest.approx(float(torch.exp(nll / 64)), rel=1e-5)


def test_perplexity_window_must_fit(tiny_llama, ids):
    with pytest.raises(ValueError, match="max_seq_len=16"):
        perplexity(EagerRunner(tiny_llama, max_seq_len=16), ids, seq_len=32)


def test_greedy_match_reports_divergence(tiny_llama, ids):
    ref = EagerRunner(tiny_llama)
    assert greedy_match(ref, EagerRunner(tiny_llama), ids[:8], 5)["match"] is True
    r = greedy_match(ref, _Shifted(EagerRunner(tiny_llama), 11, 1e4), ids[:8], 5)
    assert r["match"] is False and r["diverged_at"] == 0 and r["test_ids"] == [11] * 5


def test_latency_shape(tiny_llama, ids):
    r = latency(EagerRunner(tiny_llama), ids[:8], decode_tokens=3, runs=2, warmup=1)
    assert r["prefill_ms"] > 0 and r["decode_tok_s"] > 0 and r["runs"] == 2
    with pytest.raises(ValueError, match="max_seq_len=10"):
        latency(EagerRunner(tiny_llama, max_seq_len=10), ids[:8], decode_tokens=3)
