"""`Session.buffers()`: inputs written into NumPy arrays that live in the
session's shared feed buffers, Runs that copy nothing in, and outputs
copied out or (``copy=False``) viewed in the reply slot."""

import threading

import numpy as np
import pytest

import lanes

MATMUL = '{"MatMul": {"transpose_a": false, "transpose_b": false}}'
W = np.arange(12, dtype=np.float32).reshape(3, 4) / 8


def cast(dtype: str) -> str:
    return '{"Cast": {"to": "%s"}}' % dtype


def linear(dtype: str = "float32"):
    """y = f32(x) @ W, x of `dtype` [2, 3]."""
    b = lanes.GraphBuilder()
    x = b.placeholder("x", [2, 3], dtype)
    if dtype != "float32":
        x = b.op(cast("F32"), [x])[0]
    y = b.op(MATMUL, [x, b.variable("w", W)])[0]
    b.set_name(y, "y")
    return b


def values(dtype, k=0):
    """Small exact values of `dtype` for x, different for each `k`."""
    x = (np.arange(6).reshape(2, 3) + k) % 5
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return x.astype(np.float32).astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "int64", "float16", "bfloat16"])
def test_buffers_give_what_run_gives(client, dtype):
    x = values(dtype)
    with client.session(f"bufs-{dtype}") as s:
        s.load_graph(linear(dtype), ["y"])
        want = s.run({"x": x})
        with s.buffers() as bufs:
            a = bufs["x"]
            assert a.shape == (2, 3) and a.dtype == x.dtype
            assert a.flags.writeable
            assert bufs.inputs["x"] is a and list(bufs.keys()) == ["x"] and "x" in bufs
            a[...] = x
            got = bufs.run()
            assert list(got) == ["y"]
            np.testing.assert_array_equal(got["y"], want["y"])
            np.testing.assert_array_equal(bufs.run("y"), want["y"])
            (y,) = bufs.run(["y"], copy=False)
            np.testing.assert_array_equal(y, want["y"])


def test_what_is_written_is_what_runs(client):
    with client.session("bufs-rewrite") as s:
        s.load_graph(linear(), ["y"])
        bufs = s.buffers()
        outs = []
        for k in (0, 1):
            bufs["x"] = values("float32", k)  # __setitem__ copies into the array
            outs.append(bufs.run("y"))
            np.testing.assert_array_equal(outs[-1], values("float32", k) @ W)
        assert not np.array_equal(outs[0], outs[1])
        # Copies are the caller's; views of the reply slot show the next Run.
        bufs["x"] = values("float32", 0)
        copied = bufs.run("y")
        view = bufs.run("y", copy=False)
        assert not view.flags.writeable
        with pytest.raises(ValueError):
            view[0, 0] = 1.0
        np.testing.assert_array_equal(view, values("float32", 0) @ W)
        bufs["x"] = values("float32", 1)
        bufs.run("y")
        np.testing.assert_array_equal(copied, values("float32", 0) @ W)
        np.testing.assert_array_equal(view, values("float32", 1) @ W)
        bufs.close()


def test_large_outputs_come_through_the_slot_or_the_socket(client):
    """Outputs past the default 1 MiB slot: the slot made for the model
    holds them (views); a slot too small sends them on the socket (owned
    arrays), with the same values."""
    b = lanes.GraphBuilder()
    x = b.placeholder("x", [512, 3], "float32")
    y = b.op(MATMUL, [x, b.variable("w", np.tile(W, (1, 256)))])[0]
    b.set_name(y, "y")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 4, (512, 3)).astype(np.float32)
    with client.session("bufs-large") as s:
        s.load_graph(b, ["y"])
        want = s.run({"x": x}, fetch="y")
        assert want.nbytes == 2 << 20
        with s.buffers() as bufs:
            assert bufs.reply_bytes > want.nbytes
            bufs["x"] = x
            view = bufs.run("y", copy=False)
            assert not view.flags.writeable
            np.testing.assert_array_equal(view, want)
        with s.buffers(reply_bytes=4096) as bufs:
            bufs["x"] = x
            out = bufs.run("y", copy=False)
            assert out.flags.writeable  # the caller's own array
            np.testing.assert_array_equal(out, want)


def test_closed_buffers_and_sessions_raise_and_arrays_stay_valid(client):
    with client.session("bufs-closed") as s:
        s.load_graph(linear(), ["y"])
        bufs = s.buffers()
        a = bufs["x"]
        a[...] = values("float32")
        view = bufs.run("y", copy=False)
        bufs.close()
        bufs.close()
        assert bufs.closed
        with pytest.raises(lanes.SessionClosedError, match="closed"):
            bufs.run()
        with pytest.raises(lanes.SessionClosedError):
            bufs["x"]
        # The arrays' memory is their own mapping: still there.
        a[...] = 7
        assert a.sum() == 42
        np.testing.assert_array_equal(view, values("float32") @ W)
        other = s.buffers()
        b = other["x"]
    # The session is closed.
    with pytest.raises(lanes.SessionClosedError):
        other.run()
    with pytest.raises(lanes.SessionClosedError):
        s.buffers()
    assert other.closed
    b[...] = 1
    del other, bufs
    assert b.sum() == 6 and view.shape == (2, 4)


def test_closed_buffers_give_their_segment_to_the_next(client):
    """The service keeps a session's segments until the session closes, so
    buffers made per request must not each take a new one: closed
    buffers' segment is reused by the next `buffers()` of the same inputs
    (their arrays then view the same memory), not by one of other
    shapes."""
    with client.session("bufs-reuse") as s:
        s.load_graph(linear(), ["y"])
        for k in range(50):
            with s.buffers() as bufs:
                bufs["x"][...] = values("float32", k)
                np.testing.assert_array_equal(bufs.run("y"), values("float32", k) @ W)
        first = s.buffers()
        kept = first["x"]
        first.close()
        again = s.buffers()
        kept[...] = 3
        np.testing.assert_array_equal(again["x"], np.full((2, 3), 3, np.float32))
        np.testing.assert_array_equal(again.run("y"), np.full((2, 3), 3, np.float32) @ W)
        # Open buffers are never shared; other shapes get a segment of
        # their own.
        both = s.buffers()
        both["x"][...] = 1
        assert again["x"].sum() == 18
        again.close()
        wide = s.buffers(shapes={"x": [4, 3]})
        wide["x"][...] = 2
        assert kept.sum() == 18 and wide["x"].shape == (4, 3)


def test_wrong_names_are_key_errors(client):
    with client.session("bufs-names") as s:
        with pytest.raises(lanes.FeedError, match="load one"):
            s.buffers()
        s.load_graph(linear(), ["y"])
        with s.buffers() as bufs:
            with pytest.raises(KeyError, match="`x`"):
                bufs["nope"]
            with pytest.raises(lanes.FeedError):
                bufs.run("nope")
        with pytest.raises(KeyError, match="nope"):
            s.buffers(shapes={"nope": [2, 3]})


def test_threads_take_turns(client):
    """Runs from one Buffers on several threads, beside `s.run` with other
    values on another, each give their own results."""
    with client.session("bufs-threads") as s:
        s.load_graph(linear(), ["y"])
        bufs = s.buffers()
        bufs["x"] = values("float32", 0)
        want0, want1 = values("float32", 0) @ W, values("float32", 1) @ W
        bad = []

        def from_buffers():
            for _ in range(30):
                for copy in (True, False):
                    y = bufs.run("y", copy=copy)
                    if not np.array_equal(np.array(y), want0):
                        bad.append(("buffers", y))

        def from_run():
            for _ in range(30):
                y = s.run({"x": values("float32", 1)}, fetch="y")
                if not np.array_equal(y, want1):
                    bad.append(("run", y))

        threads = [threading.Thread(target=from_buffers) for _ in range(3)]
        threads.append(threading.Thread(target=from_run))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert bad == []
        bufs.close()


def test_a_busy_polling_client_takes_outputs_from_the_slot(endpoint):
    """With `busy_poll` the client takes each Run's outputs from the reply
    slot as soon as they are written (the socket reply dropped): copied or
    viewed, each Run's own, beside `s.run`'s."""
    with lanes.Client(endpoint, busy_poll=0.01) as c, c.session("bufs-poll") as s:
        s.load_graph(linear(), ["y"])
        with s.buffers() as bufs:
            for k in range(40):
                x = values("float32", k)
                bufs["x"] = x
                y = bufs.run("y", copy=bool(k % 2))
                np.testing.assert_array_equal(y, x @ W)
                np.testing.assert_array_equal(s.run({"x": x}, fetch="y"), x @ W)
