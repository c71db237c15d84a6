#!/usr/bin/env python3
"""PyTorch twin of `lanes bench colocate`: inference beside training on one
GPU, each job in its own process, as PyTorch users would share a GPU, run
with issue 31's protocol and printing the same JSON keys as the Lanes bench.

Jobs. --train-jobs training processes (torchvision --train-model, batch
--train-batch, SGD lr 0.01 momentum 0.9, cross-entropy, input resident on
the device) loop one step at a time and record when each step completed;
the parent can pause them (the step in flight finishes) and resume them.
--inference-jobs inference processes (--infer-model, batch --infer-batch,
eval mode, no grad) each answer requests: a request copies its input from
pinned host memory, runs the forward pass and copies the output back (what
a request through `lanes serve` does; --resident keeps the input on the
device instead). With --cuda-graph the forward pass is captured once in a
CUDA graph and each request replays it between the two copies.

Protocol (as `lanes bench colocate`):
1. training starts; the inference jobs arrive (the first one's time from
   its start of work to its first answer is reported);
2. calibration: training paused, each inference job's median latency over
   --calibrate warm requests; the interval of load L is K x alone / L per
   job (K = --inference-jobs; L is the load of all of them together), or
   --interval-ms as given;
3. for each L, --repeat times: the inference jobs' --requests requests
   alone (training paused), open loop at their arrival times (--arrivals
   fixed: one every interval; poisson: exponential gaps seeded from --seed,
   the job, L and the repetition); training alone for --train-window s; the
   same requests beside training, with training's steps inside that window.
   Open loop: a request is due at its arrival time whatever the previous
   one did, and its latency counts from its due time.

--mode default: the GPU time-slices between the processes' contexts.
--mode mps: the Multi-Process Service, so kernels of all processes run at
once: this script starts its own daemon (nvidia-cuda-mps-control -d, its
pipe and log directories in a temporary directory, passed to the jobs) and
stops it at the end (quit); if it cannot, it says so and exits.
--mode mps-priority: MPS, and inference on a high-priority stream
(torch.cuda.Stream(priority=-1)); its CUDA graph is captured and replayed
on that stream.

--device cpu runs the same protocol on the CPU (a smoke test of the script;
--mode and --cuda-graph do not apply there).

Precision as `benches/torch_ref.py`: cuDNN may use TF32, matmuls do not.
"""
import argparse
import json
import math
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time


def model(name):
    import torchvision

    return getattr(torchvision.models, name)(weights=None)


def image(name):
    return 299 if name == "inception_v3" else 224


def setup(args):
    import torch

    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    if args.device == "cpu":
        torch.set_num_threads(1)  # the jobs' processes share the host's cores
    return torch


def trainer(args, index, ready, running, idle, stop, out):
    """One training job: a step at a time while `running` is set."""
    torch = setup(args)
    dev = args.device
    m = model(args.train_model).to(dev).train()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    side = image(args.train_model)
    x = torch.randn(args.train_batch, 3, side, side, device=dev)
    y = torch.randint(0, 1000, (args.train_batch,), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        out = m(x)
        if isinstance(out, tuple):  # inception_v3's auxiliary head
            out = out[0]
        loss = loss_fn(out, y)
        loss.backward()
        opt.step()
        return loss

    t0 = time.monotonic()
    for _ in range(3):
        step().item()
    load_ms = (time.monotonic() - t0) * 1e3
    ready.set()
    done = []
    while not stop.is_set():
        if not running.is_set():
            idle.set()
            running.wait(0.01)
            continue
        idle.clear()
        step().item()  # one step at a time, as a data loader feeds it
        done.append(time.monotonic())
    out.send((load_ms, done))


class Inference:
    """An inference job's model, buffers and one request."""

    def __init__(self, args):
        torch = setup(args)
        self.torch = torch
        dev = args.device
        cuda = dev == "cuda"
        side = image(args.infer_model)
        self.m = model(args.infer_model).to(dev).eval()
        self.host = torch.randn(args.infer_batch, 3, side, side)
        if cuda:
            self.host = self.host.pin_memory()
        self.dev_in = torch.empty_like(self.host, device=dev)
        self.dev_in.copy_(self.host)
        self.resident = args.resident
        self.cuda = cuda
        self.stream = None
        if cuda:
            prio = -1 if args.mode == "mps-priority" else 0
            self.stream = torch.cuda.Stream(priority=prio)
        self.graph = None
        with torch.no_grad():
            out = self._forward()
            self.out_host = torch.empty(out.shape, dtype=out.dtype, pin_memory=cuda)
            if cuda and args.cuda_graph:
                self.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.stream):
                    for _ in range(3):  # warm-up on the capture stream
                        self._forward()
                self.stream.synchronize()
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=self.stream):
                    self.static_out = self._forward()

    def _forward(self):
        out = self.m(self.dev_in)
        return out[0] if isinstance(out, tuple) else out

    def request(self):
        torch = self.torch
        with torch.no_grad():
            if not self.cuda:
                self.dev_in.copy_(self.host)
                self.out_host.copy_(self._forward())
                return
            with torch.cuda.stream(self.stream):
                if not self.resident:
                    self.dev_in.copy_(self.host, non_blocking=True)
                if self.graph is not None:
                    self.graph.replay()
                    out = self.static_out
                else:
                    out = self._forward()
                self.out_host.copy_(out, non_blocking=True)
            self.stream.synchronize()


def inferer(args, index, conn):
    """One inference job, driven by the parent over `conn`."""
    t_open = time.monotonic()
    job = Inference(args)
    t_first = time.monotonic()
    job.request()
    now = time.monotonic()
    conn.send(
        {
            "open_to_first_reply_ms": (now - t_open) * 1e3,
            "load_ms": (t_first - t_open) * 1e3,
            "first_run_ms": (now - t_first) * 1e3,
            "torch": job.torch.__version__,
            "gpu": job.torch.cuda.get_device_name() if job.cuda else "cpu",
        }
    )
    for _ in range(args.warmup):
        job.request()
    while True:
        cmd = conn.recv()
        if cmd[0] == "calibrate":
            times = []
            for _ in range(cmd[1]):
                t0 = time.monotonic()
                job.request()
                times.append((time.monotonic() - t0) * 1e3)
            conn.send(median(times))
        elif cmd[0] == "drive":
            due, start = cmd[1], cmd[2]
            times = []
            for d in due:
                at = start + d
                wait = at - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                job.request()
                times.append((time.monotonic() - at) * 1e3)
            conn.send(times)
        else:
            return


def median(v):
    s = sorted(v)
    return s[(len(s) - 1) // 2] if s else math.nan


def rank(s, p):
    return s[max(0, min(len(s), math.ceil(len(s) * p)) - 1)]


def latency(times):
    """Latency summary (nearest rank), milliseconds: as the Lanes bench."""
    s = sorted(times)
    return {
        "n": len(s),
        "p50_ms": rank(s, 0.5),
        "p90_ms": rank(s, 0.9),
        "p99_ms": rank(s, 0.99),
        "max_ms": s[-1],
        "mean_ms": sum(s) / len(s),
    }


def spread(v):
    return {"min": min(v), "median": median(v), "max": max(v)}


def schedule(arrivals, n, interval_ms, seed):
    """When each of n requests is due, seconds from the start."""
    mean = interval_ms / 1e3
    if arrivals == "fixed":
        return [mean * i for i in range(n)]
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0 / mean) if mean > 0 else 0.0
        out.append(t)
    return out


def goals(load, p99_ratio, max_ratio, kept):
    p99_bound = 1.10 if load <= 0.5 else 1.25
    kept_bound = 1.0 - load + 0.1
    p99, mx, k = p99_ratio <= p99_bound, max_ratio <= 1.5, kept >= kept_bound
    return {
        "p99_bound": p99_bound,
        "p99_within": p99,
        "max_within_1_5x": mx,
        "kept_bound": kept_bound,
        "kept_at_least": k,
        "all": p99 and mx and k,
    }


class Mps:
    """This script's own MPS daemon: pipe and log directories in a temporary
    directory, exported to the jobs (spawned after it starts)."""

    def __init__(self):
        if shutil.which("nvidia-cuda-mps-control") is None:
            sys.exit("--mode mps needs nvidia-cuda-mps-control, which is not on PATH")
        self.dir = tempfile.mkdtemp(prefix="colocate-mps-")
        self.env = dict(os.environ)
        for k, sub in [("CUDA_MPS_PIPE_DIRECTORY", "pipe"), ("CUDA_MPS_LOG_DIRECTORY", "log")]:
            path = os.path.join(self.dir, sub)
            os.makedirs(path)
            self.env[k] = path
            os.environ[k] = path
        # The daemon forks and may keep the descriptors it was given: a file,
        # not a pipe whose end would never come.
        err_path = os.path.join(self.dir, "start.err")
        with open(err_path, "w") as err:
            r = subprocess.run(
                ["nvidia-cuda-mps-control", "-d"], env=self.env, stdout=subprocess.DEVNULL, stderr=err
            )
        if r.returncode != 0:
            with open(err_path) as f:
                why = f.read().strip()
            shutil.rmtree(self.dir, ignore_errors=True)
            sys.exit(
                f"could not start the MPS daemon (nvidia-cuda-mps-control -d: exit {r.returncode}) "
                f"{why}; another daemon may own the GPU, or the GPU's compute mode forbids it"
            )
        time.sleep(1)

    def control(self, command):
        r = subprocess.run(
            ["nvidia-cuda-mps-control"],
            input=command + "\n",
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return r.stdout.strip()

    def stop(self):
        self.control("quit")
        shutil.rmtree(self.dir, ignore_errors=True)


def log(args, s):
    mode = args.mode if args.device == "cuda" else "cpu"
    print(f"colocate_torch [{mode}] {s}", file=sys.stderr, flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["default", "mps", "mps-priority"], default="default")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--cuda-graph", action="store_true", help="inference replayed from a captured CUDA graph")
    p.add_argument("--train-model", default="resnet50")
    p.add_argument("--train-batch", type=int, default=32)
    p.add_argument("--train-jobs", type=int, default=1)
    p.add_argument("--infer-model", default="resnet152")
    p.add_argument("--infer-batch", type=int, default=8)
    p.add_argument("--inference-jobs", type=int, default=1)
    p.add_argument("--arrivals", choices=["fixed", "poisson"], default="fixed")
    p.add_argument("--load", default="0.5", help="inference loads L, e.g. 0.1,0.3,0.5,0.7")
    p.add_argument("--interval-ms", type=float, default=None, help="a fixed mean interval instead of --load")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=31)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--calibrate", type=int, default=100)
    p.add_argument("--train-window", type=float, default=5.0)
    p.add_argument("--resident", action="store_true")
    args = p.parse_args()
    try:
        args.loads = [float(x) for x in args.load.split(",")]
    except ValueError:
        sys.exit(f"--load takes numbers, e.g. 0.1,0.3,0.5,0.7, not {args.load!r}")
    if args.interval_ms is None and any(not (l > 0 and math.isfinite(l)) for l in args.loads):
        sys.exit("--load takes positive numbers")
    if min(args.requests, args.repeat, args.calibrate, args.train_jobs, args.inference_jobs) <= 0:
        sys.exit("--requests, --repeat, --calibrate, --train-jobs and --inference-jobs must be positive")

    # This process never touches the GPU: with MPS its daemon can only be
    # stopped once every client process has exited.
    mps = Mps() if args.device == "cuda" and args.mode != "default" else None
    try:
        result = run(args, mps)
    finally:
        if mps is not None:
            mps.stop()
    print(json.dumps(result), flush=True)


def run(args, mps):
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    trainers = []
    for i in range(args.train_jobs):
        ready, running, idle = ctx.Event(), ctx.Event(), ctx.Event()
        running.set()
        recv, send = ctx.Pipe(duplex=False)
        tp = ctx.Process(target=trainer, args=(args, i, ready, running, idle, stop, send))
        tp.start()
        if not ready.wait(900):
            tp.kill()
            sys.exit(f"training job {i} did not get ready")
        trainers.append((tp, running, idle, recv))
    log(args, f"{args.train_jobs} training job(s) running")

    infers, arrival, info = [], None, None
    for j in range(args.inference_jobs):
        here, there = ctx.Pipe()
        ip = ctx.Process(target=inferer, args=(args, j, there))
        ip.start()
        first = here.recv()
        if arrival is None:
            info = (first.pop("torch"), first.pop("gpu"))
            arrival = first
        log(args, f"inference job {j}: first answer {first.get('open_to_first_reply_ms', 0):.0f} ms after its start")
        infers.append((ip, here))
    if mps is not None:
        log(args, f"MPS servers: {mps.control('get_server_list') or '(none listed)'}")

    def pause():
        for _, running, _, _ in trainers:
            running.clear()
        for _, _, idle, _ in trainers:
            idle.wait(600)

    def resume():
        for _, running, idle, _ in trainers:
            idle.clear()
            running.set()

    def drive(schedules):
        start = time.monotonic() + 0.05
        for (_, conn), due in zip(infers, schedules):
            conn.send(("drive", due, start))
        times = [conn.recv() for _, conn in infers]
        return times, start, time.monotonic()

    pause()
    alone_ms = []
    for j, (_, conn) in enumerate(infers):
        conn.send(("calibrate", args.calibrate))
        alone_ms.append(conn.recv())
        log(args, f"inference job {j} alone: median {alone_ms[-1]:.3f} ms")
    k = len(infers)
    loads = [None] if args.interval_ms is not None else args.loads
    pending = []  # (load index, repetition, per-job results, windows)
    for li, load in enumerate(loads):
        intervals = [k * m / load if load is not None else args.interval_ms for m in alone_ms]
        l = load if load is not None else sum(m / i for m, i in zip(alone_ms, intervals))
        for rep in range(args.repeat):
            schedules = [
                schedule(args.arrivals, args.requests, iv, args.seed ^ (j << 32) ^ (li << 16) ^ rep)
                for j, iv in enumerate(intervals)
            ]
            log(args, f"L {l:.2f} repetition {rep}: requests alone")
            alone, _, _ = drive(schedules)
            resume()
            w0 = time.monotonic()
            time.sleep(args.train_window)
            w1 = time.monotonic()
            log(args, f"L {l:.2f} repetition {rep}: requests beside training")
            beside, b0, b1 = drive(schedules)
            pause()
            # The trainers report their steps at the end: the windows are
            # kept and counted then.
            pending.append((l, rep, intervals, alone, beside, (w0, w1), (b0, b1)))

    for _, conn in infers:
        conn.send(("quit",))
    stop.set()
    resume()
    load_ms, done = [], []
    for tp, _, _, recv in trainers:
        lm, d = recv.recv()
        load_ms.append(lm)
        done.extend(d)
        tp.join()
    for ip, _ in infers:
        ip.join()
    done.sort()

    def rate(w):
        a, b = w
        return sum(1 for t in done if a <= t <= b) / (b - a)

    runs, by_load = [], {}
    for l, rep, intervals, alone, beside, wa, wb in pending:
        train_alone, train_beside = rate(wa), rate(wb)
        gaps = sorted(y - x for x, y in zip(done, done[1:]) if x >= wa[0] and y <= wa[1])
        kept = train_beside / train_alone if train_alone else math.nan
        jobs, p99r, maxr = [], -math.inf, -math.inf
        for j, (al, be) in enumerate(zip(alone, beside)):
            sa, sb = latency(al), latency(be)
            p, m = sb["p99_ms"] / sa["p99_ms"], sb["max_ms"] / sa["max_ms"]
            p99r, maxr = max(p99r, p), max(maxr, m)
            jobs.append(
                {
                    "job": j,
                    "interval_ms": intervals[j],
                    "alone": sa,
                    "beside_training": sb,
                    "p99_beside_over_alone": p,
                    "max_beside_over_alone": m,
                }
            )
        g = goals(l, p99r, maxr, kept)
        log(args, f"L {l:.2f} repetition {rep}: p99 x {p99r:.2f}, max x {maxr:.2f}, training kept {kept * 100:.0f} %")
        runs.append(
            {
                "load": l,
                "repetition": rep,
                "inference": jobs,
                "p99_beside_over_alone": p99r,
                "max_beside_over_alone": maxr,
                "training": {
                    "alone_it_per_s": train_alone,
                    "alone_step_ms": gaps[len(gaps) // 2] * 1e3 if gaps else None,
                    "beside_it_per_s": train_beside,
                    "kept": kept,
                },
                "goals": g,
            }
        )
        by_load.setdefault(l, []).append(runs[-1])
    summary = [
        {
            "load": l,
            "repetitions": len(rs),
            "p99_beside_over_alone": spread([r["p99_beside_over_alone"] for r in rs]),
            "max_beside_over_alone": spread([r["max_beside_over_alone"] for r in rs]),
            "training_kept": spread([r["training"]["kept"] for r in rs]),
            "goals_met": sum(1 for r in rs if r["goals"]["all"]),
        }
        for l, rs in by_load.items()
    ]
    torch_version, gpu = info
    return {
        "bench": "colocate",
        "system": "torch",
        "mode": args.mode if args.device == "cuda" else "cpu",
        "cuda_graph": bool(args.cuda_graph and args.device == "cuda"),
        "torch": torch_version,
        "device": args.device,
        "gpu": gpu,
        "input": "resident" if args.resident else "pinned host copy",
        "arrivals": args.arrivals,
        "seed": args.seed,
        "requests": args.requests,
        "repeat": args.repeat,
        "training": {
            "model": args.train_model,
            "batch": args.train_batch,
            "jobs": args.train_jobs,
            "load_ms": load_ms,
        },
        "inference": {
            "model": args.infer_model,
            "batch": args.infer_batch,
            "jobs": args.inference_jobs,
            "alone_median_ms": alone_ms,
        },
        "arrival": arrival,
        "runs": runs,
        "summary": summary,
    }


if __name__ == "__main__":
    main()
