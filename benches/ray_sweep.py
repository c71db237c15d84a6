#!/usr/bin/env python3
"""Issue 34's sweep on Ray Tune: --trials training trials of the CIFAR
ResNet-18 (--steps steps of batch --batch each, SGD over an lr x momentum
grid), run by Ray Tune on --gpus Ray nodes of one GPU each (a local
`ray.cluster_utils.Cluster` on this host: node k sees GPU k only), in one
of two ways (--runner):

  torch  fractional GPUs: each trial is a PyTorch process asking for
         {"gpu": 1/N} (N = --per-gpu), so N trials share a GPU, time-sliced
         between their CUDA contexts, with no memory safety;
  lanes  each node runs `lanes serve --device cuda:k` and advertises it as
         Ray custom resources (`lanes.ray.node_resources`); each trial asks
         for 1/N of the node's lanes_mem_mib, so N trials share a node, and
         trains through the node's service (`lanes.ray.client`): the zoo's
         resnet18_cifar (--lanes-model zoo) or torchvision's model captured
         by lanes.torch (--lanes-model torch).

Both: every trial is submitted at once (Tune's queue holds those that do not
fit), a trial's JCT runs from the sweep's start to its last step, and the
makespan is the last trial's. Prints one JSON object per runner: makespan,
JCT p50 and p95, failures, and each trial's result.

    benches/ray_sweep.py --gpus 1 --per-gpu 8            # on a GPU host
    benches/ray_sweep.py --gpus 2 --per-gpu 8 --runner lanes
    benches/ray_sweep.py --small --device cpu            # end-to-end check

Needs ray[tune], torch and torchvision, and the `lanes` package; the service
binary is --lanes-bin (default target/release/lanes). Nothing is
downloaded: it runs on a host without network.
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def grid(trials):
    """(lr, momentum) pairs: 8 learning rates geometric from 1e-3 to 1e-1
    times momenta 0, 0.5, 0.9, 0.99, the first `trials` of them."""
    lrs = [1e-3 * 100 ** (i / 7) for i in range(8)]
    pairs = [(lr, m) for m in (0.9, 0.0, 0.5, 0.99) for lr in lrs]
    while len(pairs) < trials:
        pairs += pairs
    return pairs[:trials]


def torch_model(torch, torchvision):
    m = torchvision.models.resnet18(weights=None, num_classes=10)
    m.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
    m.maxpool = torch.nn.Identity()
    return m


def batch_of(torch, batch):
    g = torch.Generator().manual_seed(13)
    x = torch.rand(batch, 3, 32, 32, generator=g).mul_(2).sub_(1)
    y = torch.randint(0, 10, (batch,), generator=g)
    return x, y


def torch_trial(config):
    """A fractional-GPU trial: PyTorch on the GPU Ray gave it."""
    import torch
    import torchvision
    from ray import tune

    lr, momentum = config["hp"]
    device = "cuda" if config["device"] == "cuda" else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    torch.backends.cudnn.allow_tf32 = True
    m = torch_model(torch, torchvision).to(device).train()
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = (t.to(device) for t in batch_of(torch, config["batch"]))
    losses = []
    for _ in range(config["steps"]):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss)
    losses = [float(v) for v in losses]
    # The GPU Ray gave the trial (node k's raylet sees GPU k only).
    tune.report({"end": time.time(), "first_loss": losses[0], "loss": losses[-1],
                 "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")})


def lanes_trial(config):
    """A Lanes trial: training through its node's service."""
    import numpy as np

    import lanes
    import lanes.ray
    from ray import tune

    lr, momentum = config["hp"]
    losses = []
    with lanes.ray.client(connect_timeout=10.0) as client:
        if config["lanes_model"] == "torch":
            import torch
            import torchvision

            import lanes.torch

            torch.set_num_threads(1)
            m = torch_model(torch, torchvision)
            x, y = batch_of(torch, config["batch"])
            opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum)
            with lanes.torch.training_job(client, m, example=(x, y), loss=torch.nn.CrossEntropyLoss(),
                                          optimizer=opt, name=f"trial-{lr:.4g}-{momentum}") as job:
                for _ in range(config["steps"]):
                    losses.append(job.step(x, y))
        else:
            rng = np.random.default_rng(13)
            x = rng.uniform(-1, 1, (config["batch"], 3, 32, 32)).astype(np.float32)
            y = rng.integers(0, 10, (config["batch"],)).astype(np.int64)
            with client.session(f"trial-{lr:.4g}-{momentum}", kind="training") as s:
                s.load_zoo("resnet18_cifar", batch=config["batch"],
                           optimizer=lanes.SGD(lr, momentum=momentum), classes=10)
                feeds = {n: (x if dtype.startswith("float") else y) for n, _, dtype in s.inputs}
                for _ in range(config["steps"]):
                    losses.append(s.run(feeds, fetch="loss"))
            losses = [float(np.asarray(v).reshape(-1)[0]) for v in losses]
    tune.report({"end": time.time(), "first_loss": losses[0], "loss": losses[-1], "endpoint": client.endpoint})


def start_services(args, tmp):
    """One `lanes serve` per node; their processes and endpoints."""
    procs, endpoints = [], []
    for k in range(args.gpus):
        ep = f"ipc://{tmp}/lanes-{k}.sock"
        device = f"cuda:{k}" if args.device == "cuda" else "cpu"
        log = open(f"{tmp}/lanes-{k}.log", "wb")
        procs.append(subprocess.Popen(
            [args.lanes_bin, "serve", "--endpoint", ep, "--device", device, "--memory", args.memory,
             *args.serve_arg],
            stdout=log, stderr=subprocess.STDOUT))
        log.close()
        endpoints.append(ep)
    return procs, endpoints


def wait_ready(lanes, procs, endpoints, tmp):
    deadline = time.monotonic() + 120
    for k, (p, ep) in enumerate(zip(procs, endpoints)):
        while True:
            if p.poll() is not None:
                raise SystemExit(f"lanes serve {k} exited: " + Path(f"{tmp}/lanes-{k}.log").read_text())
            try:
                lanes.Client(ep, connect_timeout=1.0).close()
                break
            except lanes.LanesError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def run(args, runner):
    import ray
    from ray import tune
    from ray.cluster_utils import Cluster

    import lanes
    import lanes.ray

    tmp = tempfile.mkdtemp(prefix="ray-sweep-")
    procs = []
    saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", lanes.ray.ENDPOINT_ENV)}
    t_setup = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "num_gpus": 0, "include_dashboard": False, "object_store_memory": args.object_store})
    try:
        if runner == "lanes":
            procs, endpoints = start_services(args, tmp)
            wait_ready(lanes, procs, endpoints, tmp)
        per_trial = {}
        for k in range(args.gpus):
            resources = {}
            if runner == "lanes":
                resources = lanes.ray.node_resources([endpoints[k]])
                os.environ[lanes.ray.ENDPOINT_ENV] = endpoints[k]
                per_trial = lanes.ray.resources(int(resources[lanes.ray.MEM_RESOURCE] // args.per_gpu))
            if args.device == "cuda":
                # The node's raylet, and so its workers, see GPU k only.
                os.environ["CUDA_VISIBLE_DEVICES"] = str(k)
            cluster.add_node(num_cpus=args.per_gpu, num_gpus=1, resources=resources,
                             object_store_memory=args.object_store)
        cluster.wait_for_nodes()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=args.verbose)
        setup_s = time.monotonic() - t_setup
        if runner == "torch":
            trainable = tune.with_resources(torch_trial, {"cpu": 1, "gpu": 1.0 / args.per_gpu})
        else:
            trainable = tune.with_resources(lanes_trial, {"cpu": 1, **per_trial})
        config = {"hp": tune.grid_search(grid(args.trials)), "steps": args.steps, "batch": args.batch,
                  "device": args.device, "lanes_model": args.lanes_model}
        tuner = tune.Tuner(
            trainable,
            param_space=config,
            tune_config=tune.TuneConfig(max_concurrent_trials=args.gpus * args.per_gpu),
            run_config=tune.RunConfig(storage_path=f"{tmp}/tune", verbose=0,
                                      failure_config=tune.FailureConfig(max_failures=0)),
        )
        start = time.time()
        # Tune's progress tables go to stderr: stdout is the JSON alone.
        with contextlib.redirect_stdout(sys.stderr):
            results = tuner.fit()
        wall = time.time() - start
        trials, jcts = [], []
        for r in results:
            m = r.metrics or {}
            entry = {"hp": (r.config or {}).get("hp"), "error": str(r.error) if r.error else None}
            if "end" in m:
                jct = m["end"] - start
                jcts.append(jct)
                entry.update(jct_s=round(jct, 3), first_loss=m.get("first_loss"), loss=m.get("loss"),
                             endpoint=m.get("endpoint"), gpu=m.get("gpu"))
            trials.append(entry)
        jcts.sort()
        return {
            "bench": "ray_sweep", "runner": runner, "device": args.device, "gpus": args.gpus,
            "per_gpu": args.per_gpu, "trials": args.trials, "steps": args.steps, "batch": args.batch,
            "lanes_model": args.lanes_model if runner == "lanes" else None,
            "setup_s": round(setup_s, 3),
            "makespan_s": round(max(jcts), 3) if jcts else None,
            "fit_wall_s": round(wall, 3),
            "jct_p50_s": round(statistics.median(jcts), 3) if jcts else None,
            "jct_p95_s": round(jcts[min(len(jcts) - 1, int(0.95 * len(jcts)))], 3) if jcts else None,
            "failures": sum(1 for t in trials if t["error"] or "jct_s" not in t),
            "runs": trials,
        }
    finally:
        ray.shutdown()
        cluster.shutdown()
        for p in procs:
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runner", choices=["torch", "lanes", "both"], default="both")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--gpus", type=int, default=1, help="Ray nodes, one GPU (or CPU service) each")
    p.add_argument("--per-gpu", type=int, default=8, help="N: trials sharing a GPU at once")
    p.add_argument("--trials", type=int, default=32)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lanes-model", choices=["zoo", "torch"], default="zoo")
    p.add_argument("--memory", default="auto", help="each service's --memory")
    p.add_argument("--serve-arg", action="append", default=[], help="more `lanes serve` flags (repeatable)")
    p.add_argument("--lanes-bin", default=os.environ.get("LANES_BIN", str(REPO / "target/release/lanes")))
    p.add_argument("--object-store", type=int, default=200 << 20, help="bytes per Ray node")
    p.add_argument("--small", action="store_true", help="4 trials of 3 steps, batch 4, 2 per node: a check")
    p.add_argument("--verbose", action="store_true", help="Ray's worker logs on stderr")
    args = p.parse_args()
    if args.small:
        args.trials, args.steps, args.batch, args.per_gpu = 4, 3, 4, 2
        if args.device == "cpu" and args.memory == "auto":
            args.memory = "2GiB"
    if args.gpus < 1 or args.per_gpu < 1 or args.trials < 1 or args.steps < 1:
        p.error("--gpus, --per-gpu, --trials and --steps must be at least 1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    runners = ["torch", "lanes"] if args.runner == "both" else [args.runner]
    failed = False
    for runner in runners:
        out = run(args, runner)
        failed |= out["failures"] > 0
        print(json.dumps(out), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
