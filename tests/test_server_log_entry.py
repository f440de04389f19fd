"""A log line's capped body (server/observability/log_entry.py): refused by the same count as the request
bounds (`api/limits.count_json_values`), else the body with each long string cut to its head and named."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from swarmkv.api.limits import count_json_values
from swarmkv.server.observability.log_entry import cap_strings, refused_line

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=3), children, max_size=4)
    ),
    max_leaves=30,
)


def _cut(value: Any, max_chars: int) -> Any:
    if isinstance(value, str):
        return value[:max_chars]
    if isinstance(value, dict):
        return {key: _cut(child, max_chars) for key, child in value.items()}
    if isinstance(value, list):
        return [_cut(child, max_chars) for child in value]
    return value


@given(JSON, st.integers(0, 8), st.integers(1, 40), st.integers(1, 5))
def test_capping_refuses_what_the_count_refuses_and_cuts_the_rest(
    body: Any, max_chars: int, max_values: int, max_depth: int
) -> None:
    capped = cap_strings(body, max_chars, max_values, max_depth)
    counted = count_json_values(body, max_depth, max_values)
    assert (capped is None) == isinstance(counted, str)
    if capped is not None:
        assert capped.body == _cut(body, max_chars)
        for cut in capped.cut:
            assert cut.chars > max_chars and cut.kept_chars == max_chars
        assert len(capped.cut) == sum(1 for _ in _long_strings(body, max_chars))


@given(JSON)
def test_without_bounds_nothing_is_refused(body: Any) -> None:
    capped = cap_strings(body, 4)
    assert capped is not None and capped.body == _cut(body, 4)
    for cut in capped.cut:
        assert len(cut.sha256) == len(hashlib.sha256().hexdigest())


def _long_strings(value: Any, max_chars: int) -> Any:
    if isinstance(value, str) and len(value) > max_chars:
        yield value
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    for child in children:
        yield from _long_strings(child, max_chars)


def test_a_refused_body_of_a_million_values_is_named_without_walking_them() -> None:
    # The count stops at the line's bound; a walk that made each value's path first held a path string and a
    # tuple for each of them (1.7 GB for 7.5 million stops) before it counted.
    body = {"stop": ["a"] * 1_000_000}
    tracemalloc.start()
    try:
        line = refused_line({"route": "/v1/chat/completions"}, body, b"raw body")
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert json.loads(line)["body_bytes"] == len(b"raw body")
    assert peak_bytes < 4 * 2**20
