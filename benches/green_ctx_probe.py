#!/usr/bin/env python3
"""Do CUDA green contexts confine work to their SMs, and what would an SM
partition give inference beside training? A probe for issue 31's lever
("SM partitions that hold"), in PyTorch, before it is built into Lanes.

One process, two threads, both replaying CUDA graphs (so Python's launch
cost and the GIL stay out of the way):

- training: a ResNet-50 training step (forward, cross-entropy, backward,
  SGD with momentum) at batch 32, captured once and replayed back to back;
- inference: ResNet-152 forward at batch 8, captured once; each request
  copies its input from pinned memory, replays, copies the output back and
  synchronises.

Each graph is captured on the stream it is replayed on. A partition is a
green context of N SMs (`torch.cuda.green_contexts.GreenContext`) whose
stream captures and replays the graph; "full" is an ordinary stream on
the whole device.

Measured, one row each:
1. training alone on full, then on green contexts of decreasing SM counts
   (`--train-sms`): if the context confines the work, the step slows as
   the SMs fall;
2. inference alone (full): p50, p99 over `--requests` requests paced at
   load L (`--load`: the alone median / interval, fixed pacing);
3. inference beside training: for each partition in `--splits`
   (TRAIN_SMS:INFER_SMS, 0 = full, e.g. 0:0 is no partition), the same
   paced requests with training running all along; inference p50/p99 and
   their ratios to alone, training it/s and its ratio to training alone
   on full. Each green context is cut from the whole device, so two of
   them may share SMs: the useful splits confine training (N:0) and leave
   inference the whole device, (132 - N) SMs of it free of training.

Prints one JSON object (progress on stderr). Needs torch (2.10 or later
for green contexts) and torchvision, and a GPU.

    python3 benches/green_ctx_probe.py --splits 0:0,16:0,32:0,64:0
"""
import argparse
import json
import statistics
import sys
import threading
import time


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def green_stream(torch, sms):
    """A stream whose work runs on `sms` SMs (0: an ordinary stream)."""
    if sms == 0:
        return torch.cuda.Stream(), None
    from torch.cuda.green_contexts import GreenContext
    ctx = GreenContext.create(num_sms=sms, device_id=0)
    if hasattr(ctx, "Stream"):
        return ctx.Stream(), ctx
    # torch 2.10's API: the stream made while the context is current.
    ctx.set_context()
    try:
        s = torch.cuda.Stream()
    finally:
        ctx.pop_context()
    return s, ctx


def capture(torch, stream, fn, warmup=3):
    """`fn` captured into a graph on `stream` (warmed up there first)."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    stream.synchronize()
    return g


class Training:
    def __init__(self, torch, tv, batch):
        self.torch = torch
        dev = torch.device("cuda")
        self.model = tv.models.resnet50(weights=None).to(dev).train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.x = torch.randn(batch, 3, 224, 224, device=dev)
        self.y = torch.randint(0, 1000, (batch,), device=dev)
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def step(self):
        self.opt.zero_grad(set_to_none=False)
        loss = self.loss_fn(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()

    def graph_on(self, sms):
        stream, ctx = green_stream(self.torch, sms)
        g = capture(self.torch, stream, self.step)
        return g, stream, ctx


class Inference:
    def __init__(self, torch, tv, batch):
        self.torch = torch
        dev = torch.device("cuda")
        self.model = tv.models.resnet152(weights=None).to(dev).eval()
        self.host_in = torch.randn(batch, 3, 224, 224).pin_memory()
        self.x = self.host_in.to(dev)
        self.out = None
        self.host_out = None

    def forward(self):
        with self.torch.no_grad():
            self.out = self.model(self.x)

    def graph_on(self, sms):
        stream, ctx = green_stream(self.torch, sms)
        g = capture(self.torch, stream, self.forward)
        self.host_out = self.torch.empty(self.out.shape, pin_memory=True)
        return g, stream, ctx

    def request(self, g, stream):
        with self.torch.cuda.stream(stream):
            self.x.copy_(self.host_in, non_blocking=True)
            g.replay()
            self.host_out.copy_(self.out, non_blocking=True)
        stream.synchronize()


def replay_on(torch, g, stream):
    """Replays `g` on `stream` (a graph replays on the current stream, not
    the one it was captured on) and waits for it."""
    with torch.cuda.stream(stream):
        g.replay()
    stream.synchronize()


def train_rate(torch, g, stream, seconds):
    """Steps per second replaying `g` back to back for `seconds`."""
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        replay_on(torch, g, stream)
        n += 1
    return n / (time.perf_counter() - t0)


def paced(inf, g, stream, interval_s, requests, give_up_ms=2000.0):
    """Latencies (ms) of `requests` requests due every `interval_s`,
    counted from their due time (open loop). Stops early once a request
    answers `give_up_ms` after its due time: the queue grows without
    bound (the caller reports the row as overloaded)."""
    lat = []
    t0 = time.perf_counter()
    for i in range(requests):
        due = t0 + i * interval_s
        while time.perf_counter() < due:
            time.sleep(min(0.0005, max(0.0, due - time.perf_counter())))
        inf.request(g, stream)
        lat.append((time.perf_counter() - due) * 1e3)
        if lat[-1] > give_up_ms:
            break
    return lat


def quantiles(lat):
    s = sorted(lat)
    rank = lambda q: s[min(len(s) - 1, max(0, int(q * len(s) + 0.999999) - 1))]
    return {"n": len(s), "p50_ms": rank(0.5), "p99_ms": rank(0.99), "max_ms": s[-1],
            "mean_ms": statistics.fmean(s)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-sms", default="0,96,64,32,16",
                    help="SM counts for training alone (0: the whole device)")
    ap.add_argument("--splits", default="0:0,16:0,32:0,64:0",
                    help="TRAIN_SMS:INFER_SMS partitions for inference beside training (0: whole device)")
    ap.add_argument("--load", type=float, default=0.5)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--train-seconds", type=float, default=3.0)
    ap.add_argument("--train-batch", type=int, default=32)
    ap.add_argument("--infer-batch", type=int, default=8)
    ap.add_argument("--watchdog", type=float, default=0.0, metavar="S",
                    help="print every thread's stack after S seconds (a probe that hangs says where)")
    args = ap.parse_args(argv)
    if args.watchdog > 0:
        import faulthandler
        faulthandler.dump_traceback_later(args.watchdog, exit=True)

    import torch
    import torchvision as tv

    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    out = {"torch": torch.__version__, "gpu": props.name, "sms": props.multi_processor_count,
           "load": args.load, "requests": args.requests, "train_alone": [], "beside": []}
    train = Training(torch, tv, args.train_batch)
    inf = Inference(torch, tv, args.infer_batch)
    graphs = {}

    def train_graph(sms):
        if ("t", sms) not in graphs:
            graphs[("t", sms)] = train.graph_on(sms)
        return graphs[("t", sms)]

    def infer_graph(sms):
        if ("i", sms) not in graphs:
            graphs[("i", sms)] = inf.graph_on(sms)
        return graphs[("i", sms)]

    log("capturing inference on the whole device …")
    gi, si, _ = infer_graph(0)
    log("calibrating inference …")
    for _ in range(20):
        inf.request(gi, si)
    calib = []
    for _ in range(100):
        t = time.perf_counter()
        inf.request(gi, si)
        calib.append((time.perf_counter() - t) * 1e3)
    calib.sort()
    alone_median = calib[len(calib) // 2]
    interval = alone_median / 1e3 / args.load
    out["infer_alone_median_ms"] = alone_median
    out["interval_ms"] = interval * 1e3
    alone = quantiles(paced(inf, gi, si, interval, args.requests))
    out["infer_alone"] = alone
    log(f"inference alone: p50 {alone['p50_ms']:.2f} p99 {alone['p99_ms']:.2f} ms, interval {interval*1e3:.2f} ms")

    full_rate = None
    for sms in [int(s) for s in args.train_sms.split(",")]:
        try:
            g, s, _ = train_graph(sms)
        except Exception as e:  # noqa: BLE001 - the probe reports what the driver says
            out["train_alone"].append({"sms": sms, "error": repr(e)})
            log(f"training on {sms} SMs: {e!r}")
            continue
        rate = train_rate(torch, g, s, args.train_seconds)
        full_rate = rate if sms == 0 else full_rate
        out["train_alone"].append({"sms": sms, "it_per_s": rate})
        log(f"training alone on {sms or 'all'} SMs: {rate:.2f} it/s")

    for split in args.splits.split(","):
        t_sms, i_sms = (int(v) for v in split.split(":"))
        row = {"train_sms": t_sms, "infer_sms": i_sms}
        try:
            gt, st, _ = train_graph(t_sms)
            gi, si, _ = infer_graph(i_sms)
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)
            out["beside"].append(row)
            log(f"split {split}: {e!r}")
            continue
        log(f"split {split}: captured, requests beside training …")
        for _ in range(5):
            inf.request(gi, si)
        stop = threading.Event()
        steps = [0]

        def trainer():
            while not stop.is_set():
                replay_on(torch, gt, st)
                steps[0] += 1

        th = threading.Thread(target=trainer)
        th.start()
        time.sleep(0.2)
        s0, t0 = steps[0], time.perf_counter()
        lat = paced(inf, gi, si, interval, args.requests)
        rate = (steps[0] - s0) / (time.perf_counter() - t0)
        stop.set()
        th.join()
        q = quantiles(lat)
        row.update(q)
        row["overloaded"] = len(lat) < args.requests
        row["p50_over_alone"] = q["p50_ms"] / alone["p50_ms"]
        row["p99_over_alone"] = q["p99_ms"] / alone["p99_ms"]
        row["train_it_per_s"] = rate
        row["train_kept"] = rate / full_rate if full_rate else None
        out["beside"].append(row)
        log(f"split {split}: {len(lat)} requests, p50 {q['p50_ms']:.2f} ({row['p50_over_alone']:.2f}x) p99 {q['p99_ms']:.2f} "
            f"({row['p99_over_alone']:.2f}x), training {rate:.2f} it/s ({row['train_kept'] or 0:.0%})")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
