#!/usr/bin/env python3
"""PyTorch twin of `lanes bench colocate`: inference beside training on one
GPU, each in its own process, as two PyTorch users would share a GPU.

A training process (torchvision --train-model, batch --train-batch, SGD lr
0.01 momentum 0.9, cross-entropy, input resident on the GPU) loops and
records when each step completed. The inference process (--infer-model,
batch --infer-batch, eval mode, no grad) then arrives: the time from its
start of work (model built and moved to the GPU) to its first answer is
reported, then --requests requests paced every --interval-ms (or right
after the previous answer when it took longer) beside training, then the
training process stops and the same requests run alone. Each request
copies its input from pinned host memory, runs the forward pass and copies
the output back (what a request through `lanes serve` does); --resident
keeps the input on the GPU instead.

--mode default: the GPU time-slices between the two processes' contexts.
--mode mps: the Multi-Process Service is started first
(nvidia-cuda-mps-control -d) and stopped at the end, so kernels of both
processes run at once.

Precision as `benches/torch_ref.py`: cuDNN may use TF32, matmuls do not.
Prints one JSON object with the same fields as `lanes bench colocate`.
"""
import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time


def model(name):
    import torchvision

    return getattr(torchvision.models, name)(weights=None)


def trainer(args, ready, stop, out):
    import torch

    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = False
    m = model(args.train_model).cuda().train()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(args.train_batch, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (args.train_batch,), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(m(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    ready.set()
    done = []
    while not stop.is_set():
        step().item()  # one step at a time, as a data loader feeds it
        done.append(time.monotonic())
    out.send(done)


def stats(times):
    s = sorted(times)
    q = lambda p: s[round((len(s) - 1) * p)]
    return {
        "n": len(s),
        "p50_ms": q(0.5),
        "p90_ms": q(0.9),
        "p99_ms": q(0.99),
        "max_ms": s[-1],
        "mean_ms": sum(s) / len(s),
    }


def inferer(args, conn):
    """The inference job: arrival, requests beside training, then (told by
    the parent once training stopped) the same requests alone."""
    import torch

    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = False
    t_open = time.monotonic()
    m = model(args.infer_model).cuda().eval()
    host = torch.randn(args.infer_batch, 3, 224, 224).pin_memory()
    dev = torch.empty_like(host, device="cuda")
    if args.resident:
        dev.copy_(host)

    @torch.no_grad()
    def request():
        if not args.resident:
            dev.copy_(host, non_blocking=True)
        return m(dev).cpu()

    t_first = time.monotonic()
    request()
    arrival = (time.monotonic() - t_open) * 1e3
    first_run = (time.monotonic() - t_first) * 1e3
    for _ in range(args.warmup):
        request()

    def paced():
        times, nxt = [], time.monotonic()
        start = nxt
        for _ in range(args.requests):
            now = time.monotonic()
            if nxt > now:
                time.sleep(nxt - now)
            t0 = time.monotonic()
            request()
            times.append((time.monotonic() - t0) * 1e3)
            nxt += args.interval_ms / 1e3
        return times, start, time.monotonic()

    beside = paced()
    conn.send((arrival, first_run, beside, torch.__version__, torch.cuda.get_device_name()))
    conn.recv()  # training has stopped
    conn.send(paced()[0])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["default", "mps"], default="default")
    p.add_argument("--train-model", default="resnet50")
    p.add_argument("--train-batch", type=int, default=32)
    p.add_argument("--infer-model", default="resnet152")
    p.add_argument("--infer-batch", type=int, default=8)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--interval-ms", type=float, default=5.0)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--train-window", type=float, default=5.0)
    p.add_argument("--resident", action="store_true")
    args = p.parse_args()

    # This process never touches the GPU: with MPS its daemon can only be
    # stopped once every client process has exited.
    if args.mode == "mps":
        subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True)
        time.sleep(1)
    try:
        result = run(args)
    finally:
        if args.mode == "mps":
            subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", timeout=30)
    print(json.dumps(result), flush=True)


def run(args):
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    tp = ctx.Process(target=trainer, args=(args, ready, stop, send))
    tp.start()
    if not ready.wait(600):
        tp.kill()
        sys.exit("the training process did not get ready")
    log = lambda s: print(f"colocate_torch [{args.mode}] {s}", file=sys.stderr, flush=True)
    log(f"training alone for {args.train_window} s")
    w0 = time.monotonic()
    time.sleep(args.train_window)
    w1 = time.monotonic()

    log("inference arrives; requests beside training")
    here, there = ctx.Pipe()
    ip = ctx.Process(target=inferer, args=(args, there))
    ip.start()
    arrival, first_run, (beside, b0, b1), version, gpu = here.recv()
    stop.set()
    done = recv.recv()
    tp.join()
    log("requests alone")
    here.send("alone")
    alone = here.recv()
    ip.join()

    count = lambda a, b: sum(1 for t in done if a <= t <= b)
    train_alone = count(w0, w1) / (w1 - w0)
    train_beside = count(b0, b1) / (b1 - b0)
    gaps = sorted(b - a for a, b in zip(done, done[1:]) if a >= w0 and b <= w1)
    sa, sb = stats(alone), stats(beside)
    return {
        "bench": "colocate_torch",
        "mode": args.mode,
        "torch": version,
        "gpu": gpu,
        "input": "resident" if args.resident else "pinned host copy",
        "training": {
            "model": args.train_model,
            "batch": args.train_batch,
            "alone_it_per_s": train_alone,
            "alone_step_ms": gaps[len(gaps) // 2] * 1e3 if gaps else None,
            "beside_it_per_s": train_beside,
            "beside_over_alone": train_beside / train_alone if train_alone else None,
        },
        "inference": {
            "model": args.infer_model,
            "batch": args.infer_batch,
            "interval_ms": args.interval_ms,
            "alone": sa,
            "beside_training": sb,
            "p99_beside_over_alone": sb["p99_ms"] / sa["p99_ms"],
            "max_beside_over_alone": sb["max_ms"] / sa["max_ms"],
        },
        "arrival": {"open_to_first_reply_ms": arrival, "first_run_ms": first_run},
    }


if __name__ == "__main__":
    main()
