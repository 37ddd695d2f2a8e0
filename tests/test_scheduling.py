"""tests/conftest.py's ordering: tests marked ``minutes(n)`` dealt longest first to the least loaded
worker, each worker's share of the collection starting with its own, chains kept together in
order, and the rest in their order."""

from __future__ import annotations

import pytest


class _Item:
    def __init__(self, name: str, minutes: float | None = None, chain: str | None = None):
        self.name = name
        kwargs = {"chain": chain} if chain else {}
        self._mark = pytest.mark.minutes(minutes, **kwargs).mark if minutes is not None else None

    def get_closest_marker(self, name: str):
        return self._mark if name == "minutes" else None


def _order(items, workers, monkeypatch):
    from tests.conftest import pytest_collection_modifyitems

    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
    pytest_collection_modifyitems(None, items)
    return [i.name for i in items]


def test_one_worker_runs_the_long_tests_first_longest_first(monkeypatch):
    items = [_Item("a"), _Item("b", 3), _Item("c"), _Item("d", 12), _Item("e", 3.5), _Item("f"), _Item("g", 3)]
    assert _order(items, 1, monkeypatch) == ["d", "e", "b", "g", "a", "c", "f"]


def test_two_workers_each_start_their_share_with_half_the_long_work(monkeypatch):
    shorts = [_Item(f"s{k}") for k in range(10)]
    items = shorts[:3] + [_Item("L12", 12), _Item("L5", 5), _Item("L4", 4), _Item("L3", 3)] + shorts[3:]
    names = _order(items, 2, monkeypatch)
    first, second = names[: len(names) // 2], names[len(names) // 2:]  # what worksteal hands each worker
    assert first[:1] == ["L12"] and second[:3] == ["L5", "L4", "L3"], names  # LPT: 12 | 5 + 4 + 3
    assert [n for n in names if n.startswith("s")] == [f"s{k}" for k in range(10)]  # the rest keep their order
    assert sorted(names) == sorted([i.name for i in shorts] + ["L12", "L3", "L4", "L5"])  # nothing lost or doubled


def test_a_chain_runs_on_one_worker_in_collection_order(monkeypatch):
    shorts = [_Item(f"s{k}") for k in range(12)]
    chain = [_Item("produce", 7, "ex"), _Item("reuse", 0.5, "ex"), _Item("other", 3, "ex")]
    items = shorts[:6] + chain + [_Item("solo", 6)] + shorts[6:]
    names = _order(items, 2, monkeypatch)
    half = len(names) // 2
    lanes = [names[:half], names[half:]]
    ex_lane = next(lane for lane in lanes if "produce" in lane)
    assert ex_lane[:3] == ["produce", "reuse", "other"]  # together, in order, first
    assert "solo" not in ex_lane and next(lane for lane in lanes if "solo" in lane)[0] == "solo"


def test_every_shipped_example_carries_a_cost_and_one_chain():
    """The examples' parametrization marks each with its minutes and the examples' chain."""
    from tests import test_examples

    params = next(m for m in test_examples.test_example_passes_its_gates_with_margin.pytestmark
                  if m.name == "parametrize").args[1]
    marks = {p.values[0]: [m for m in p.marks if m.name == "minutes"] for p in params}
    assert marks and all(len(m) == 1 and m[0].args[0] > 0 and m[0].kwargs.get("chain") == "examples"
                         for m in marks.values()), marks
    order = [p.values[0] for p in params]
    assert order.index("smollm2") < order.index("smollm2_torchchat") and order.index("smollm2") < order.index(
        "smollm2_onnx_int4") and order.index("smollm2_int8") < order.index("smollm2_onnx")
