"""`lanes.ray` without a Ray cluster: importing it without ray, finding a
node's services, its resources, and the error a lost service becomes
(docs/ray.md). The two-node cluster is test_ray.py."""

import json
import os
import pickle
import subprocess
import sys

import pytest

import lanes
import lanes.ray


def test_imports_without_ray():
    # `ray` made unimportable in a fresh interpreter.
    code = (
        "import sys; sys.modules['ray'] = None; import lanes.ray; "
        "print(lanes.ray.resources(8), lanes.ray.drain_node())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # Nothing to drain outside Ray.
    assert out.stdout.strip() == "{'lanes_mem_mib': 8.0} False"


def test_node_endpoints_env_then_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(lanes.ray.ENDPOINT_ENV, "ipc:///a, ipc:///b")
    monkeypatch.setenv(lanes.ray.DIRECTORY_ENV, str(tmp_path / "unused.json"))
    assert lanes.ray.node_endpoints() == ["ipc:///a", "ipc:///b"]
    assert lanes.ray.node_endpoints(["tcp://h:1"]) == ["tcp://h:1"]
    monkeypatch.delenv(lanes.ray.ENDPOINT_ENV)
    directory = tmp_path / "host.json"
    directory.write_text(json.dumps({"services": [
        {"index": 0, "endpoint": "ipc:///gpu0", "running": True},
        {"index": 1, "endpoint": "ipc:///gpu1", "running": False},
    ]}))
    monkeypatch.setenv(lanes.ray.DIRECTORY_ENV, str(directory))
    assert lanes.ray.node_endpoints() == ["ipc:///gpu0"]
    directory.write_text("{not json")
    with pytest.raises(lanes.LanesError, match="cannot read the Lanes directory"):
        lanes.ray.node_endpoints()
    monkeypatch.delenv(lanes.ray.DIRECTORY_ENV)
    if not os.path.exists(lanes.ray.DEFAULT_DIRECTORY):
        with pytest.raises(lanes.LanesError, match="no Lanes service configured on this node"):
            lanes.ray.node_endpoints()


def test_node_resources_from_status(endpoint):
    with lanes.Client(endpoint) as c:
        capacity = json.loads(c.status()["lanes_json"])["capacity"] >> 20
    assert lanes.ray.node_resources([endpoint]) == {"lanes_gpu": 1.0, "lanes_mem_mib": float(capacity)}
    assert lanes.ray.node_resources([endpoint], reserve_mib=100)["lanes_mem_mib"] == float(capacity - 100)
    # A service that does not answer is left out, and named when none does.
    dead = "tcp://127.0.0.1:9"
    assert lanes.ray.node_resources([endpoint, dead], connect_timeout=0.5)["lanes_gpu"] == 1.0
    with pytest.raises(lanes.NoServiceError, match="tcp://127.0.0.1:9"):
        lanes.ray.node_resources([dead], connect_timeout=0.5)
    with pytest.raises(ValueError):
        lanes.ray.node_resources([endpoint], reserve_mib=-1)
    with pytest.raises(ValueError):
        lanes.ray.resources(0)


def test_resources_command(endpoint):
    out = subprocess.run([sys.executable, "-m", "lanes.ray", "resources", "--endpoint", endpoint],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == lanes.ray.node_resources([endpoint])
    out = subprocess.run([sys.executable, "-m", "lanes.ray", "resources", "--endpoint", "tcp://127.0.0.1:9"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "tcp://127.0.0.1:9" in out.stderr


def test_a_lost_service_is_a_retryable_typed_error(endpoint):
    with lanes.ray.client([endpoint]) as c:
        assert c.endpoint == endpoint
        with c.session("alive") as s:
            s.load_zoo("mlp", batch=1)
    with pytest.raises(lanes.ray.ServiceLostError) as e:
        with lanes.ray.client(["tcp://127.0.0.1:9"], connect_timeout=0.5, drain=False):
            pass
    err = e.value
    assert isinstance(err, lanes.ServiceGoneError) and isinstance(err, lanes.LanesError)
    assert isinstance(err.__cause__, lanes.NoServiceError)
    assert err.endpoint == "tcp://127.0.0.1:9" and "is gone" in str(err)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is lanes.ray.ServiceLostError
    assert (str(back), back.endpoint, back.node_id) == (str(err), err.endpoint, err.node_id)
    # Other errors in the block pass through untouched.
    with pytest.raises(KeyError):
        with lanes.ray.client([endpoint]):
            raise KeyError("mine")


def test_which_services_still_answer(endpoint):
    # What decides whether a lost service's node is drained: its other
    # services answering.
    assert lanes.ray._answering([endpoint, "tcp://127.0.0.1:9"], 0.5) == [endpoint]
    assert lanes.ray._answering(["tcp://127.0.0.1:9"], 0.5) == []
