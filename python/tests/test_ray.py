"""`lanes.ray` on a local Ray cluster of two nodes (`ray.cluster_utils.Cluster`
on this machine), each node with its own `lanes serve --device cpu` found
through LANES_ENDPOINT set at node start: trials (Ray tasks, then a Ray Tune
run) train through their node's service; then one node's service is killed,
its trials fail with `lanes.ray.ServiceLostError` and Ray runs them again on
the other node.

Skipped when ray is not installed (`pip install "ray[tune]"`; .ci/python
installs it)."""

import os
import sys
import time

import numpy as np
import pytest

import lanes
import lanes.ray
import conftest

ray = pytest.importorskip("ray", reason='ray is not installed (pip install "ray[tune]")')
cluster_utils = pytest.importorskip("ray.cluster_utils", reason="ray.cluster_utils is missing")
# Ray's workers cannot import this test module: its functions travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 6


def start_service(path):
    """A `lanes serve --device cpu` child on `ipc://path`, answering."""
    return conftest.start_service(
        path, ["--workers", "1", "--device", "cpu", "--memory", "256MiB"], f"{path}.log"
    )


stop = conftest.stop_service


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two Ray nodes, node k with the custom resources of service k and
    LANES_ENDPOINT naming it (inherited by the node's raylet and workers)."""
    tmp = tmp_path_factory.mktemp("ray")
    services = [start_service(tmp / f"node{k}.sock") for k in range(2)]
    endpoints = [ep for _, ep in services]
    c = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "object_store_memory": 100 << 20, "include_dashboard": False},
    )
    nodes = {}
    for ep in endpoints:
        nodes[add_node(c, ep)] = ep
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    state = {"nodes": nodes, "services": [p for p, _ in services], "endpoints": endpoints, "cluster": c,
             "tmp": tmp}
    try:
        yield state
    finally:
        ray.shutdown()
        c.shutdown()
        for proc in state["services"]:
            stop(proc)


def add_node(c, ep):
    """A Ray node of one CPU whose resources are service `ep`'s, with
    LANES_ENDPOINT naming it; its id."""
    res = lanes.ray.node_resources([ep])
    assert res == {"lanes_gpu": 1.0, "lanes_mem_mib": 256.0}
    saved = os.environ.get(lanes.ray.ENDPOINT_ENV)
    os.environ[lanes.ray.ENDPOINT_ENV] = ep
    try:
        return c.add_node(num_cpus=1, object_store_memory=100 << 20, resources=res).node_id
    finally:
        if saved is None:
            os.environ.pop(lanes.ray.ENDPOINT_ENV, None)
        else:
            os.environ[lanes.ray.ENDPOINT_ENV] = saved


def train(client, name, lr, steps=STEPS, before_step=None):
    """A tiny MLP (the zoo's) trained on a fixed batch; the losses."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16), dtype=np.float32)
    y = rng.integers(0, 4, size=(8,)).astype(np.int64)
    with client.session(name, kind="training") as s:
        s.load_zoo("mlp", batch=8, optimizer=lanes.SGD(lr), inputs=16, hidden=[16], classes=4)
        feeds = {n: (x if dtype.startswith("float") else y) for n, _, dtype in s.inputs}
        losses = []
        for i in range(steps):
            if before_step is not None:
                before_step(i)
            losses.append(float(np.asarray(s.run(feeds, fetch="loss")).reshape(-1)[0]))
        return losses


# Retried only on system failures (a worker that could not start): an
# application error such as ServiceLostError is not retried here.
@ray.remote(resources=lanes.ray.resources(32), max_retries=2)
def trial(lr):
    with lanes.ray.client(connect_timeout=2.0) as c:
        losses = train(c, f"trial-{lr}", lr)
        return {"node": ray.get_runtime_context().get_node_id(), "endpoint": c.endpoint, "losses": losses}


def test_the_nodes_advertise_their_services(cluster):
    total = ray.cluster_resources()
    assert total["lanes_gpu"] == 2.0 and total["lanes_mem_mib"] == 512.0
    for node in ray.nodes():
        if node["Alive"] and node["NodeID"] in cluster["nodes"]:
            assert node["Resources"]["lanes_gpu"] == 1.0 and node["Resources"]["lanes_mem_mib"] == 256.0


def test_trials_train_through_their_nodes_service(cluster):
    # Two trials pinned to each node (SPREAD is best effort: on a busy
    # machine Ray once put all four on one node).
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = cluster["nodes"]
    ids = sorted(nodes)
    lrs = [0.05, 0.1, 0.2, 0.3]
    refs = [
        trial.options(scheduling_strategy=NodeAffinitySchedulingStrategy(ids[k % 2], soft=False)).remote(lr)
        for k, lr in enumerate(lrs)
    ]
    results = ray.get(refs, timeout=120)
    for k, r in enumerate(results):
        assert r["node"] == ids[k % 2], "a trial ran on another node than asked"
        assert r["endpoint"] == nodes[r["node"]], "a trial used another node's service"
        assert r["losses"][-1] < r["losses"][0], r["losses"]


def test_a_tune_sweep_through_lanes(cluster, tmp_path):
    tune = pytest.importorskip("ray.tune", reason="ray[tune] is not installed")

    def trainable(config):
        with lanes.ray.client(connect_timeout=2.0) as c:
            losses = train(c, f"tune-{config['lr']}", config["lr"])
        tune.report({"first": losses[0], "loss": losses[-1], "endpoint": c.endpoint,
                     "node": ray.get_runtime_context().get_node_id()})

    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": 1, **lanes.ray.resources(32)}),
        param_space={"lr": tune.grid_search([0.05, 0.2])},
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
        run_config=tune.RunConfig(storage_path=str(tmp_path), verbose=0),
    )
    grid = tuner.fit()
    assert len(grid) == 2 and not grid.errors
    for r in grid:
        assert r.metrics["loss"] < r.metrics["first"]
        assert r.metrics["endpoint"] == cluster["nodes"][r.metrics["node"]]


@ray.remote(num_cpus=0)
class Gate:
    """Where the trials are: each attempt checks in; the test opens the gate
    once the service of node 0 is killed."""

    def __init__(self):
        self.attempts = []
        self.errors = []
        self.open = False

    def check_in(self, lr, node):
        self.attempts.append((lr, node))

    def is_open(self):
        return self.open

    def release(self):
        self.open = True

    def failed(self, error):
        self.errors.append(error)

    def seen(self):
        return list(self.attempts)

    def seen_errors(self):
        return list(self.errors)


@ray.remote(resources=lanes.ray.resources(32), max_retries=2, retry_exceptions=[lanes.ray.ServiceLostError])
def gated_trial(lr, gate):
    node = ray.get_runtime_context().get_node_id()
    ray.get(gate.check_in.remote(lr, node))

    def wait_for_gate(i):
        # After two steps, hold until the test has killed node 0's service.
        while i == 2 and not ray.get(gate.is_open.remote()):
            time.sleep(0.05)

    try:
        with lanes.ray.client(connect_timeout=2.0, timeout=60.0) as c:
            losses = train(c, f"gated-{lr}", lr, before_step=wait_for_gate)
            return {"node": node, "endpoint": c.endpoint, "losses": losses}
    except lanes.ray.ServiceLostError as e:
        ray.get(gate.failed.remote((type(e).__name__, str(e), e.endpoint, e.node_id)))
        raise


def test_a_lost_service_fails_its_trials_and_ray_retries_them(cluster):
    nodes = cluster["nodes"]
    dead_ep = cluster["endpoints"][0]
    dead_node = next(n for n, ep in nodes.items() if ep == dead_ep)
    gate = Gate.remote()
    lrs = [0.1, 0.2]
    refs = [gated_trial.options(scheduling_strategy="SPREAD").remote(lr, gate) for lr in lrs]
    deadline = time.monotonic() + 60
    while len({n for _, n in ray.get(gate.seen.remote())}) < 2:
        assert time.monotonic() < deadline, f"trials did not start on both nodes: {ray.get(gate.seen.remote())}"
        time.sleep(0.05)
    first = dict(ray.get(gate.seen.remote()))
    victim = next(lr for lr, n in first.items() if n == dead_node)
    cluster["services"][0].kill()
    cluster["services"][0].wait(timeout=20)
    ray.get(gate.release.remote())
    results = ray.get(refs, timeout=120)
    attempts = ray.get(gate.seen.remote())
    # The trial on the dead node's service ran again, on the other node.
    assert [n for lr, n in attempts if lr == victim] == [dead_node, next(n for n in nodes if n != dead_node)]
    assert len(attempts) == 3, attempts
    for r in results:
        assert r["node"] != dead_node and r["endpoint"] == nodes[r["node"]]
        assert len(r["losses"]) == STEPS and r["losses"][-1] < r["losses"][0]
    # The drained node takes no more work: new trials all run on the other.
    more = ray.get([trial.options(scheduling_strategy="SPREAD").remote(lr) for lr in (0.05, 0.15, 0.25)], timeout=120)
    assert {r["node"] for r in more} == set(nodes) - {dead_node}
    # Lanes' error, clear about where and what, before Ray's retry.
    [(kind, message, endpoint, node)] = ray.get(gate.seen_errors.remote())
    assert kind == "ServiceLostError" and endpoint == dead_ep and node == dead_node
    assert f"the Lanes service of Ray node {dead_node} ({dead_ep}) is gone" in message
    assert "the node is drained" in message
    # In the driver: the same error, and no node drained (the driver's is
    # no trial's node).
    with pytest.raises(lanes.ray.ServiceLostError, match="the Lanes service of this node .* is gone") as e:
        with lanes.ray.client([dead_ep], connect_timeout=0.5):
            pass
    assert e.value.node_id is None and "drained" not in str(e.value)
    assert lanes.ray.drain_node() is False


def test_tune_restarts_a_trial_whose_service_is_lost(cluster):
    """After the test above: node 0 is drained, node 1 serves; a third node
    joins, its service is killed under a Tune trial, and Tune's
    FailureConfig runs the trial again on node 1."""
    tune = pytest.importorskip("ray.tune", reason="ray[tune] is not installed")
    proc, ep = start_service(cluster["tmp"] / "node2.sock")
    cluster["services"].append(proc)
    node2 = add_node(cluster["cluster"], ep)
    # (Cluster.wait_for_nodes counts node 0, drained, as not joined.)
    deadline = time.monotonic() + 60
    while not any(n["NodeID"] == node2 and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, "the third node did not join"
        time.sleep(0.1)
    live = next(n for n, e in cluster["nodes"].items() if e == cluster["endpoints"][1])
    gate = Gate.remote()

    def trainable(config):
        node = ray.get_runtime_context().get_node_id()
        ray.get(gate.check_in.remote(config["lr"], node))

        def wait_for_gate(i):
            while i == 2 and not ray.get(gate.is_open.remote()):
                time.sleep(0.05)

        with lanes.ray.client(connect_timeout=2.0, timeout=60.0) as c:
            losses = train(c, f"tune-lost-{config['lr']}", config["lr"], before_step=wait_for_gate)
        tune.report({"first": losses[0], "loss": losses[-1], "endpoint": c.endpoint, "node": node})

    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": 1, **lanes.ray.resources(32)}),
        param_space={"lr": tune.grid_search([0.1, 0.2])},
        run_config=tune.RunConfig(storage_path=str(cluster["tmp"] / "tune-lost"), verbose=0,
                                  failure_config=tune.FailureConfig(max_failures=2)),
    )
    import threading

    out = {}
    fit = threading.Thread(target=lambda: out.setdefault("grid", tuner.fit()))
    fit.start()
    deadline = time.monotonic() + 90
    while {n for _, n in ray.get(gate.seen.remote())} != {live, node2}:
        assert time.monotonic() < deadline, f"trials did not start on both nodes: {ray.get(gate.seen.remote())}"
        time.sleep(0.05)
    victim = next(lr for lr, n in ray.get(gate.seen.remote()) if n == node2)
    proc.kill()
    proc.wait(timeout=20)
    ray.get(gate.release.remote())
    fit.join(timeout=120)
    assert not fit.is_alive(), "Tune did not finish"
    grid = out["grid"]
    assert len(grid) == 2 and not grid.errors
    attempts = ray.get(gate.seen.remote())
    assert [n for lr, n in attempts if lr == victim] == [node2, live]
    for r in grid:
        assert r.metrics["node"] == live and r.metrics["endpoint"] == cluster["endpoints"][1]
        assert r.metrics["loss"] < r.metrics["first"]
