"""Type-preserving JSON for non-tensor leaves (acceptance case C07 b)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptstore.core import jsonvalue
from ckptstore.errors import CkptStoreError, UnsupportedTypeError


def assert_type_exact(a, b):
    assert type(a) is type(b), (a, b)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_type_exact(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert type(k) is type(next(kk for kk in b if kk == k))
            assert_type_exact(a[k], b[k])
    elif isinstance(a, slice):
        for attr in ("start", "stop", "step"):
            assert_type_exact(getattr(a, attr), getattr(b, attr))
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def test_c07b_metadata_round_trip_keeps_types():
    value = {"heap": [(1.0, 0), (3.0, 2)], "idx": (slice(0, 2, None), Ellipsis), "count": 3, "flag": True, "none": None, "f": 3.0}
    back = jsonvalue.loads(jsonvalue.dumps(value))
    assert_type_exact(value, back)
    assert back == value


def test_special_floats_and_odd_dicts():
    value = {"nan": float("nan"), "inf": float("inf"), "ninf": -float("inf"), "neg0": -0.0, "big": 2**200,
             "intkeys": {1: "a", (2, 3): "b"}, "dollar": {"$": 1}, "nested": [[], {}, ()]}
    back = jsonvalue.loads(jsonvalue.dumps(value))
    assert_type_exact(value, back)
    assert math.copysign(1.0, back["neg0"]) == -1.0


@pytest.mark.parametrize("bad", [np.longdouble(1.0), np.str_("s"), np.datetime64("2020-01-01"), object(), {1, 2}, b"bytes", 1j])
def test_refuses_types_it_cannot_keep(bad):
    with pytest.raises(UnsupportedTypeError, match=r"meta\.x"):
        jsonvalue.dumps({"x": bad}, "meta")


@pytest.mark.parametrize("text", ['{"$": "unknown"}', '{"$": "slice", "v": [1]}', '{"$": "dict", "v": [[[1], 2]]}', "not json"])
def test_rejects_malformed_input(text):
    with pytest.raises(CkptStoreError):
        jsonvalue.loads(text)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4)
    | st.tuples(children, children)
    | st.dictionaries(st.text(max_size=5), children, max_size=4)
    | st.dictionaries(st.integers(), children, max_size=3)
    | st.builds(slice, st.none() | st.integers(), st.none() | st.integers(), st.none() | st.integers()),
    max_leaves=20,
)


@given(json_values)
def test_round_trip_property(value):
    assert_type_exact(value, jsonvalue.loads(jsonvalue.dumps(value)))
