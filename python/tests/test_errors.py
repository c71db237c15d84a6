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
        with pytest.raises(lanes.FeedError, match="float32 or int64") as e:
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
