"""Errors are Python exceptions carrying the service's wire error code."""

import time

import numpy as np
import pytest

import lanes


def test_bad_feed_carries_its_code(client):
    with client.session("errors") as s:
        s.load_zoo("mlp", batch=2)
        with pytest.raises(lanes.FeedError) as e:
            s.run({"input": np.zeros((3, 64), np.float32)})
        assert isinstance(e.value, lanes.LanesError)
        assert e.value.code_name == "BadFeed"
        assert e.value.code == 14
        with pytest.raises(lanes.FeedError) as e:
            s.run({"input": np.zeros((2, 64), np.float32)}, fetch="nope")
        assert e.value.code_name == "UnknownFetch"
        with pytest.raises(lanes.FeedError, match="float32, float16, bfloat16 .ml_dtypes. or int64") as e:
            s.run({"input": np.zeros((2, 64), np.float64)})
        assert e.value.code is None
        with pytest.raises(lanes.FeedError) as e:
            s.write_variables({"no_such_variable": np.zeros(3, np.float32)})
        assert e.value.code_name == "BadVariable"


def test_run_before_load_and_after_close(client):
    s = client.session("no-graph")
    with pytest.raises(lanes.LanesError) as e:
        s.run({"input": np.zeros((1, 64), np.float32)}, fetch="output")
    assert e.value.code_name == "NoGraph"
    s.close()
    s.close()  # harmless
    assert s.closed
    with pytest.raises(lanes.SessionClosedError):
        s.run({}, fetch="output")


def test_bad_arguments(client):
    with pytest.raises(ValueError, match="kind"):
        client.session("x", kind="batch")
    with client.session("args") as s:
        with pytest.raises(ValueError, match="no zoo model"):
            s.load_zoo("resnet9000")
        with pytest.raises(TypeError, match="unknown parameter"):
            s.load_zoo("mlp", hiden=[3])
        with pytest.raises(lanes.ModelError, match="batch"):
            s.load_zoo("mlp", batch=0)
        with pytest.raises(TypeError, match="optimizer"):
            s.load_zoo("mlp", optimizer="sgd")


def test_bad_client_options(endpoint):
    with pytest.raises(ValueError, match="busy_poll"):
        lanes.Client(endpoint, busy_poll=-1.0)
    with pytest.raises(ValueError, match="timeout"):
        lanes.Client(endpoint, timeout=0.0)


def test_no_service_and_bad_endpoint(tmp_path):
    with pytest.raises(lanes.NoServiceError) as e:
        lanes.Client(f"ipc://{tmp_path}/nobody.sock", connect_timeout=0.5)
    assert e.value.code is None
    # The connect timeout, not the request timeout, bounds the handshake.
    t0 = time.monotonic()
    with pytest.raises(lanes.NoServiceError):
        lanes.Client(f"ipc://{tmp_path}/nobody.sock", timeout=300.0)
    assert time.monotonic() - t0 < 30.0
    with pytest.raises(ValueError, match="connect_timeout"):
        lanes.Client(f"ipc://{tmp_path}/nobody.sock", connect_timeout=0.0)
    with pytest.raises(lanes.LanesError, match="not an endpoint"):
        lanes.Client("127.0.0.1:5555")


def test_closed_client(endpoint):
    c = lanes.Client(endpoint)
    s = c.session("orphan")
    c.close()
    with pytest.raises(lanes.SessionClosedError):
        s.load_zoo("mlp")
    with pytest.raises(lanes.SessionClosedError):
        c.status()


def test_status_lists_sessions(client):
    with client.session("visible", priority=3):
        st = client.status()
        assert isinstance(st, dict)
        assert "visible" in repr(st)


def test_slo_ms_is_counted_and_checked(client):
    """A session's latency objective: its Runs counted in status (a minute
    holds every Run of the small MLP); out of bounds a ValueError before
    anything is sent."""
    with client.session("objective", slo_ms=60000.0) as s:
        s.load_zoo("mlp", batch=2)
        for _ in range(3):
            s.run({"input": np.zeros((2, 64), np.float32)})
        st = client.status()
        mine = [x for x in st["sessions"] if x["spec"]["name"] == "objective"][0]
        assert mine["spec"]["slo_ms"] == 60000.0
        assert mine["slo"]["runs"] == 3 and mine["slo"]["within"] == 3
        assert mine["slo"]["recent_p99_ms"] > 0
    for bad in [0.0, -1.0, float("nan"), float("inf"), 3_600_001.0]:
        with pytest.raises(ValueError, match="slo_ms"):
            client.session("bad-objective", slo_ms=bad)
    with client.session("no-objective") as s:
        mine = [x for x in client.status()["sessions"] if x["spec"]["name"] == "no-objective"][0]
        assert mine["slo"] is None


def test_a_stopped_service_raises_service_gone_at_once(tmp_path):
    import subprocess

    from conftest import lanes_bin

    sock = tmp_path / "stopping.sock"
    ep = f"ipc://{sock}"
    proc = subprocess.Popen(
        [str(lanes_bin()), "serve", "--device", "cpu", "--memory", "none", "--endpoint", ep, "--workers", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                c = lanes.Client(ep, timeout=300.0)
                break
            except lanes.NoServiceError:
                assert time.monotonic() < deadline
        c.status()
        # SIGTERM: the service stops cleanly (nothing in flight), exits 0
        # and removes its socket file.
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        assert not sock.exists()
        # The client's next request fails at once, not at its timeout.
        t0 = time.monotonic()
        with pytest.raises(lanes.ServiceGoneError):
            c.status()
        assert time.monotonic() - t0 < 30.0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_errors_pickle_with_their_codes(client):
    # Ray and multiprocessing send exceptions between processes by pickle.
    import pickle

    with client.session("pickled") as s:
        s.load_zoo("mlp", batch=2)
        with pytest.raises(lanes.FeedError) as e:
            s.run({"input": np.zeros((3, 64), np.float32)})
    back = pickle.loads(pickle.dumps(e.value))
    assert type(back) is lanes.FeedError
    assert (back.code, back.code_name, str(back)) == (e.value.code, "BadFeed", str(e.value))
    assert type(pickle.loads(pickle.dumps(lanes.ServiceGoneError("gone")))) is lanes.ServiceGoneError
