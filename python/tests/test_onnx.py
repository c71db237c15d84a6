"""The PyTorch-exported ONNX fixtures (tests/data/onnx) run through the
service match PyTorch's outputs saved beside them, at the Rust tests'
tolerance (tests/onnx_import.rs)."""

import json

import numpy as np
import pytest

from conftest import DATA

import lanes

ONNX = DATA / "onnx"
RTOL, ATOL = 1e-4, 1e-5
MODELS = sorted(json.loads((ONNX / "manifest.json").read_text())["models"])


@pytest.mark.parametrize("model", MODELS)
def test_fixture_matches_pytorch(client, model):
    entry = json.loads((ONNX / "manifest.json").read_text())["models"][model]
    feeds_np = {n: np.load(ONNX / f"{model}.{n}.npy") for n in entry["inputs"]}
    batch = next(iter(feeds_np.values())).shape[0]
    with client.session(f"onnx-{model}") as s:
        s.load_onnx(ONNX / f"{model}.onnx", batch=batch)
        assert [n for n, _, _ in s.inputs] == entry["inputs"]
        assert s.outputs == entry["outputs"]
        dtypes = {n: dt for n, _, dt in s.inputs}
        feeds = {n: a.astype(dtypes[n]) for n, a in feeds_np.items()}
        out = s.run(feeds)
        assert list(out) == entry["outputs"]
        for name, got in out.items():
            want = np.load(ONNX / f"{model}.{name}.npy")
            assert got.shape == want.shape
            assert got.dtype == np.float32
            bad = ~np.isclose(got, want, rtol=RTOL, atol=ATOL)
            assert not bad.any(), (
                f"{model}.{name}: {bad.sum()} of {bad.size} outside rtol {RTOL}/atol {ATOL}, "
                f"max abs {np.abs(got - want).max():e}"
            )


def test_fetch_forms(client):
    x = np.load(ONNX / "resnet18.input.npy")
    with client.session("fetch-forms") as s:
        s.load_onnx(str(ONNX / "resnet18.onnx"), batch=x.shape[0])
        one = s.run({"input": x}, fetch="output")
        listed = s.run({"input": x}, fetch=["output", "output"])
        assert isinstance(listed, list) and len(listed) == 2
        np.testing.assert_array_equal(one, listed[0])
        # A strided (non-contiguous) feed is read in its logical order.
        wide = np.zeros(x.shape[:-1] + (x.shape[-1] * 2,), np.float32)
        wide[..., ::2] = x
        np.testing.assert_array_equal(s.run({"input": wide[..., ::2]}, fetch="output"), one)
        h1 = s.submit_run({"input": x}, fetch="output")
        h2 = s.submit_run({"input": x})
        assert not h1.done
        np.testing.assert_array_equal(s.wait(h2)["output"], one)
        np.testing.assert_array_equal(s.wait(h1), one)
        assert h1.done
        with pytest.raises(ValueError):
            s.wait(h1)


def test_unsupported_and_malformed_files(client, tmp_path):
    with client.session("bad-files") as s:
        with pytest.raises(lanes.ModelError, match="not supported") as e:
            s.load_onnx(ONNX / "unsupported_op.onnx")
        assert e.value.code is None
        junk = tmp_path / "junk.onnx"
        junk.write_bytes(b"\x08\x07 not a model")
        with pytest.raises(lanes.ModelError):
            s.load_onnx(junk)
        with pytest.raises(lanes.ModelError, match="cannot read"):
            s.load_onnx(tmp_path / "missing.onnx")


def test_outputs_are_not_copied(client):
    """An output array is a view of the buffer the reply was decoded into
    (NumPy does not own it), and each Run's arrays are independent."""
    x = np.load(ONNX / "resnet18.input.npy")
    with client.session("zero-copy") as s:
        s.load_onnx(ONNX / "resnet18.onnx", batch=x.shape[0])
        a = s.run({"input": x}, fetch="output")
        b = s.run({"input": x}, fetch="output")
    assert not a.flags.owndata and a.base is not None
    assert a.flags.c_contiguous and a.flags.writeable
    a[...] = 0
    assert b.any()


def test_feed_buffers_follow_the_feeds(client, endpoint):
    """`run` writes feeds into shared-memory buffers kept by the session:
    new values in the same buffers, a feed of another shape (refused by the
    service, the session still usable), and a client without shared memory
    all give the same answers."""
    x = np.load(ONNX / "resnet18.input.npy")
    with client.session("buffers") as s:
        s.load_onnx(ONNX / "resnet18.onnx", batch=x.shape[0])
        a = s.run({"input": x}, fetch="output")
        b = s.run({"input": x * np.float32(0.5)}, fetch="output")
        assert not np.array_equal(a, b)
        np.testing.assert_array_equal(s.run({"input": x}, fetch="output"), a)
        with pytest.raises(lanes.LanesError, match="input"):
            s.run({"input": x[:1]}, fetch="output")
        np.testing.assert_array_equal(s.run({"input": x}, fetch="output"), a)
    with lanes.Client(endpoint, shared_memory=False, busy_poll=0.001) as plain:
        with plain.session("no-buffers") as s:
            s.load_onnx(ONNX / "resnet18.onnx", batch=x.shape[0])
            np.testing.assert_array_equal(s.run({"input": x}, fetch="output"), a)


def test_outputs_larger_than_the_reply_slot(endpoint):
    """Outputs larger than the feed buffers' 1 MiB reply slot come through
    the socket once; the buffers are then made again with a slot that holds
    them. Every `run` gives the answer a client without shared memory gets,
    with busy polling, with the adaptive wait (the default) and sleeping
    throughout."""
    # 512 x 1024 float32 outputs: 2 MiB.
    shape = dict(batch=512, inputs=16, hidden=[32], classes=1024)
    x = np.random.default_rng(3).standard_normal((512, 16), dtype=np.float32)
    with lanes.Client(endpoint, shared_memory=False) as plain:
        with plain.session("plain") as s:
            s.load_zoo("mlp", seed=5, **shape)
            name = s.inputs[0][0]
            want = s.run({name: x})
    for busy, adaptive in ((0.0, True), (0.0, False), (0.05, True)):
        with lanes.Client(endpoint, busy_poll=busy, adaptive_wait=adaptive) as c:
            with c.session("large-outputs") as s:
                s.load_zoo("mlp", seed=5, **shape)
                for i in range(4):
                    got = s.run({name: x})
                    assert got.keys() == want.keys()
                    for k, v in want.items():
                        assert v.nbytes > 1 << 20
                        np.testing.assert_array_equal(got[k], v, err_msg=f"run {i}, busy {busy}, adaptive {adaptive}")
