"""Half-precision arrays: numpy float16 as Lanes f16 both ways; bfloat16
(ml_dtypes) as Lanes bf16, refused with a TypeError when ml_dtypes is not
there to give the result its dtype."""

import sys

import numpy as np
import pytest

import lanes

MATMUL = '{"MatMul": {"transpose_a": false, "transpose_b": false}}'


def cast(dtype: str) -> str:
    return '{"Cast": {"to": "%s"}}' % dtype


def half_linear(dtype: str, w: np.ndarray):
    """y = x @ w in `dtype` ("float16" or "bfloat16"), and y cast to f32."""
    b = lanes.GraphBuilder()
    x = b.placeholder("x", [2, 3], dtype)
    wv = b.variable("w", w)
    y = b.op(MATMUL, [x, wv])[0]
    b.set_name(y, "y")
    assert b.type_of(y) == ([2, 4], dtype)
    yf = b.op(cast("F32"), [y])[0]
    b.set_name(yf, "yf")
    return b


# Multiples of 1/4 and 1/8: every product and sum is exact in f32 and in
# the half dtypes, so the results compare exactly.
X = np.arange(6, dtype=np.float32).reshape(2, 3) / 4
W = np.arange(12, dtype=np.float32).reshape(3, 4) / 8
WANT = X @ W


def test_float16_feeds_variables_and_results(client):
    w = W.astype(np.float16)
    with client.session("half-f16") as s:
        s.load_graph(half_linear("float16", w), ["y", "yf"])
        y, yf = s.run({"x": X.astype(np.float16)}, fetch=["y", "yf"])
        assert y.dtype == np.float16 and y.shape == (2, 4)
        np.testing.assert_array_equal(y, WANT.astype(np.float16))
        assert yf.dtype == np.float32
        np.testing.assert_array_equal(yf, WANT)
        back = s.read_variables(["w"])["w"]
        assert back.dtype == np.float16
        np.testing.assert_array_equal(back, w)
        # A non-contiguous float16 feed is read in C order.
        wide = np.zeros((2, 6), np.float16)
        wide[:, ::2] = X
        np.testing.assert_array_equal(s.run({"x": wide[:, ::2]}, fetch="y"), y)
        # A float32 feed for a float16 placeholder is refused, not cast.
        with pytest.raises(lanes.FeedError):
            s.run({"x": X}, fetch="y")


def test_bfloat16_through_ml_dtypes(client):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    w = W.astype(ml_dtypes.bfloat16)
    with client.session("half-bf16") as s:
        s.load_graph(half_linear("bfloat16", w), ["y", "yf"])
        y, yf = s.run({"x": X.astype(ml_dtypes.bfloat16)}, fetch=["y", "yf"])
        assert y.dtype == ml_dtypes.bfloat16 and y.shape == (2, 4)
        np.testing.assert_array_equal(y.astype(np.float32), WANT)
        np.testing.assert_array_equal(yf, WANT)
        back = s.read_variables(["w"])["w"]
        assert back.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(back.view(np.uint16), w.view(np.uint16))


def test_a_bfloat16_result_without_ml_dtypes_is_a_type_error(client, monkeypatch):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    w = W.astype(ml_dtypes.bfloat16)
    with client.session("half-bf16-plain") as s:
        s.load_graph(half_linear("bfloat16", w), ["y", "yf"])
        x = X.astype(ml_dtypes.bfloat16)
        # As if ml_dtypes were not installed: the import fails.
        monkeypatch.setitem(sys.modules, "ml_dtypes", None)
        with pytest.raises(TypeError, match="ml_dtypes"):
            s.run({"x": x}, fetch="y")
        # The f32 result needs nothing.
        np.testing.assert_array_equal(s.run({"x": x}, fetch="yf"), WANT)
