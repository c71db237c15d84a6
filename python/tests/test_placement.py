"""`lanes.Client.connect_best`: placement across the services of a host (two CPU
services started by `lanes host --device cpu --gpus 0,1`, the test aid of
docs/multi-gpu.md)."""

import json
import subprocess

import numpy as np
import pytest

import lanes
from conftest import lanes_bin

MATMUL = '{"MatMul": {"transpose_a": false, "transpose_b": false}}'


@pytest.fixture
def host(tmp_path):
    directory = tmp_path / "host.json"
    proc = subprocess.Popen(
        [
            str(lanes_bin()), "host", "--device", "cpu", "--gpus", "0,1",
            "--endpoint", "tcp://127.0.0.1:*", "--directory", str(directory),
            "--", "--memory", "6MiB", "--workers", "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in proc.stdout:
            if "service(s) ready" in line:
                break
        else:
            raise RuntimeError(f"lanes host exited with {proc.wait()}")
        yield directory
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def big(client, name):
    """A session holding a 4 MiB weight (x [1, 1024] @ w [1024, 1024])."""
    g = lanes.GraphBuilder()
    x = g.placeholder("x", [1, 1024])
    w = g.variable("w", np.full((1024, 1024), 0.5, dtype=np.float32))
    g.set_name(g.op(MATMUL, [x, w])[0], "y")
    s = client.session(name)
    s.load_graph(g, ["y"])
    y = s.run({"x": np.ones((1, 1024), dtype=np.float32)}, "y")
    assert y[0, 0] == 512.0
    return s


def test_a_full_service_sends_the_next_job_to_the_other(host):
    endpoints = [s["endpoint"] for s in json.loads(host.read_text())["services"]]
    first = lanes.Client.connect_best(directory=host, persistent=1 << 20, ephemeral=1 << 16)
    assert first.endpoint == endpoints[0]
    held = big(first, "big-0")
    job = first.status()["lanes_json"]
    job = json.loads(job)["lanes"][0]["jobs"][0]
    second = lanes.Client.connect_best(endpoints, persistent=job["p"], ephemeral=job["t"])
    assert second.endpoint == endpoints[1]
    big(second, "big-1")
    held.close()


def test_none_reachable_names_each_endpoint():
    dead = ["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"]
    with pytest.raises(lanes.NoServiceError) as e:
        lanes.Client.connect_best(dead, timeout=1.0, connect_timeout=0.5)
    assert "tcp://127.0.0.1:9 (" in str(e.value) and "tcp://127.0.0.1:10 (" in str(e.value)
    with pytest.raises(ValueError):
        lanes.Client.connect_best()
