from __future__ import annotations

import pytest

from optimize.gates import evaluate_gates
from optimize.gates_config import GatesConfig
from optimize.report import Metrics

BASE = Metrics(perplexity=10.0, size_mb=100.0, decode_tok_s=50.0, top1_agreement=1.0, kl_divergence=0.0)


@pytest.mark.parametrize(
    "goal, metrics, ok",
    [
        ({"perplexity": {"max_pct_degradation": 2}}, Metrics(perplexity=10.19), True),
        ({"perplexity": {"max_pct_degradation": 2}}, Metrics(perplexity=10.21), False),
        ({"perplexity": {"max_degradation": 0.5}}, Metrics(perplexity=10.6), False),
        ({"perplexity": {"threshold": 12}}, Metrics(perplexity=11.9), True),
        ({"top1_agreement": {"threshold": 0.9}}, Metrics(top1_agreement=0.85), False),
        ({"decode_tok_s": {"max_pct_degradation": 10}}, Metrics(decode_tok_s=46.0), True),
        ({"decode_tok_s": {"max_pct_degradation": 10}}, Metrics(decode_tok_s=44.0), False),
        ({"size_mb": {"threshold": 30}}, Metrics(size_mb=29.0), True),
    ],
)
def test_goal_directions(goal, metrics, ok):
    (result,) = evaluate_gates(GatesConfig(**goal), metrics, BASE)
    assert result.ok is ok
    assert result.metric in result.message


def test_unmeasured_metric_fails_its_gate():
    (result,) = evaluate_gates(GatesConfig(prefill_ms={"threshold": 10}), Metrics(), BASE)
    assert not result.ok and "was not measured" in result.message


def test_stage_override_replaces_metric_and_on_fail():
    base = GatesConfig(perplexity={"max_pct_degradation": 1}, size_mb={"threshold": 10})
    merged = base.merged_with(GatesConfig(perplexity={"max_pct_degradation": 5}, on_fail="warn"))
    assert merged.perplexity.max_pct_degradation == 5
    assert merged.size_mb.threshold == 10
    assert merged.on_fail == "warn"
    assert base.merged_with(GatesConfig(size_mb={"threshold": 20})).on_fail == "stop"
