"""The common-prefix length every caller shares: lists, tuples, arrays and strings alike."""

from __future__ import annotations

from array import array

from hypothesis import given
from hypothesis import strategies as st

from swarmkv.prefix import common_prefix_length


def test_common_prefix_length_of_each_kind() -> None:
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix_length((1, 2, 3, 4), (1, 2, 9, 4)) == 2
    assert common_prefix_length(array("i", range(1000)), array("i", [*range(700), -1])) == 700
    assert common_prefix_length("tool_order", "tool_set") == 5


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40))
def test_common_prefix_length_equals_a_scan(a: list[int], b: list[int]) -> None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    assert common_prefix_length(a, b) == n
