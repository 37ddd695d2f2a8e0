"""tests/conftest.py's ordering: tests marked ``minutes(n)`` first, longest first, the rest in order."""

from __future__ import annotations

import pytest


class _Item:
    def __init__(self, name: str, minutes: float | None = None):
        self.name = name
        self._mark = pytest.mark.minutes(minutes).mark if minutes is not None else None

    def get_closest_marker(self, name: str):
        return self._mark if name == "minutes" else None


def test_long_tests_start_first_longest_first_and_the_rest_keep_their_order():
    from tests.conftest import pytest_collection_modifyitems

    items = [_Item("a"), _Item("b", 3), _Item("c"), _Item("d", 12), _Item("e", 3.5), _Item("f"), _Item("g", 3)]
    pytest_collection_modifyitems(None, items)
    assert [i.name for i in items] == ["d", "e", "b", "g", "a", "c", "f"]


def test_every_shipped_example_carries_a_cost():
    """The examples' parametrization marks each with its minutes, so the hook above starts them first."""
    from tests import test_examples

    params = next(m for m in test_examples.test_example_passes_its_gates_with_margin.pytestmark
                  if m.name == "parametrize").args[1]
    costs = {p.values[0]: [m.args[0] for m in p.marks if m.name == "minutes"] for p in params}
    assert costs and all(len(c) == 1 and c[0] > 0 for c in costs.values()), costs
