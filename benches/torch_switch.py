#!/usr/bin/env python3
"""PyTorch's ways of running a model that is not on the GPU, beside
`lanes bench switch` (same architectures, batch and precision as
benches/torch_ref.py, whose `build` this reuses).

Two timings per model, one JSON object per line:
  to_cuda:        the model's parameters and buffers sit in pinned host
                  memory; timed: model.to('cuda', non_blocking=True), input
                  host -> GPU, forward, output GPU -> host (median of --iters;
                  between iterations the pinned host tensors are put back,
                  which copies nothing).
  stop_and_start: a new Python process that imports torch, builds the model,
                  loads its weights from a file saved beforehand, moves it to
                  the GPU and runs one inference; wall time from spawn to exit
                  (median of --starts), and the child's own time from after
                  `import torch` to the output on the host.

Usage: python3 benches/torch_switch.py --model resnet152 --batch 8
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_ref import build  # noqa: E402

CHILD = r"""
import sys, time
t_spawned = time.perf_counter()
import torch
t_imported = time.perf_counter()
sys.path.insert(0, sys.argv[1])
from torch_ref import build
torch.backends.cudnn.allow_tf32 = True
torch.backends.cuda.matmul.allow_tf32 = False
m, make = build(sys.argv[2], int(sys.argv[4]), "sdpa")
m.load_state_dict(torch.load(sys.argv[5]))
m.eval().to("cuda")
x = make(int(sys.argv[3]))
with torch.no_grad():
    y = m(x.to("cuda"))
    y = (y.last_hidden_state if hasattr(y, "last_hidden_state") else y).cpu()
print(time.perf_counter() - t_imported)
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--starts", type=int, default=3)
    a = ap.parse_args()
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = False

    m, make = build(a.model, a.seq, "sdpa")
    m.eval()
    x = make(a.batch).pin_memory()
    # Pinned host copies of every parameter and buffer.
    pinned = {}
    for mod in m.modules():
        for name, t in list(mod._parameters.items()) + list(mod._buffers.items()):
            if t is not None:
                pinned[(id(mod), name)] = t.data.pin_memory()

    def put_back():
        for mod in m.modules():
            for name, t in list(mod._parameters.items()) + list(mod._buffers.items()):
                if t is not None:
                    t.data = pinned[(id(mod), name)]

    def out_of(y):
        return y.last_hidden_state if hasattr(y, "last_hidden_state") else y

    put_back()
    # Resident latency for reference (same timed region minus the weights).
    m.to("cuda")
    with torch.no_grad():
        for _ in range(3):
            out_of(m(x.to("cuda", non_blocking=True))).cpu()
        torch.cuda.synchronize()
        res = []
        for _ in range(a.iters):
            t = time.perf_counter()
            out_of(m(x.to("cuda", non_blocking=True))).cpu()
            res.append((time.perf_counter() - t) * 1e3)
    put_back()
    torch.cuda.synchronize()
    times = []
    with torch.no_grad():
        for i in range(a.iters + 2):
            put_back()
            torch.cuda.synchronize()
            t = time.perf_counter()
            m.to("cuda", non_blocking=True)
            out_of(m(x.to("cuda", non_blocking=True))).cpu()
            dt = (time.perf_counter() - t) * 1e3
            if i >= 2:  # the first moves allocate the caching allocator's blocks
                times.append(dt)
    weights = sum(t.numel() * t.element_size() for t in pinned.values())
    print(json.dumps({
        "bench": "torch_switch", "how": "to_cuda", "model": a.model, "batch": a.batch,
        "weights_bytes": weights, "resident_median_ms": statistics.median(res),
        "median_ms": statistics.median(times), "min_ms": min(times),
    }), flush=True)

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "weights.pt")
        put_back()
        torch.save(m.state_dict(), path)
        walls, inner = [], []
        here = os.path.dirname(os.path.abspath(__file__))
        for _ in range(a.starts):
            t = time.perf_counter()
            r = subprocess.run(
                [sys.executable, "-c", CHILD, here, a.model, str(a.batch), str(a.seq), path],
                capture_output=True, text=True, check=True)
            walls.append((time.perf_counter() - t) * 1e3)
            inner.append(float(r.stdout.strip().splitlines()[-1]) * 1e3)
    print(json.dumps({
        "bench": "torch_switch", "how": "stop_and_start", "model": a.model, "batch": a.batch,
        "median_ms": statistics.median(walls), "after_import_median_ms": statistics.median(inner),
        "starts": a.starts,
    }), flush=True)


if __name__ == "__main__":
    main()
