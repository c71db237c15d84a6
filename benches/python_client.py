#!/usr/bin/env python3
"""Lanes through its Python client against PyTorch on the GPU, for
docs/benchmarks.md. Exports full-size resnet50, inception_v3 (torchvision,
random weights, batch-norm statistics set from random batches, eval) and bert-base (transformers BertModel from
BertConfig(), random weights, attention mask, sequence 128) with
torch.onnx.export to a temporary folder (offline: no downloads), loads each
into a running `lanes serve` through `lanes.Client`, runs batch 8, compares
the outputs with PyTorch's and times the median of N runs:

- lanes:            s.run from host NumPy arrays to host NumPy arrays
- lanes_buffers:    (--lanes-buffers) bufs.run: the input written once,
                    outside the timed loop, into the arrays of
                    `s.buffers()` (as the CUDA graph's pinned tensor is
                    filled once); outputs copied out into new arrays
- lanes_buffers_views: the same with copy=False: outputs as read-only
                    views of the reply slot, nothing copied
- torch_eager:      model(x.cuda()) and the output copied back to the host
- torch_resident:   model(x_gpu), input already on the GPU, synchronised
- torch_cuda_graph: a captured CUDA graph replayed, input copied in from
                    pinned host memory, output copied back

Prints one JSON object. Needs torch, torchvision, transformers, numpy and
the lanes package:

    lanes serve --device cuda --endpoint tcp://127.0.0.1:5555 &
    python3 benches/python_client.py --endpoint tcp://127.0.0.1:5555 [--runs 50] [--no-tf32] [--lanes-buffers]
    # lowest latency: `lanes serve --busy-poll 10 ...` and --busy-poll 10 here
    # the client's wait as before the adaptive default: --no-adaptive-wait
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

# The conformance suite's tolerance for TF32 convolutions (Lanes' CUDA
# backend runs convolutions in TF32, as PyTorch's cudnn.allow_tf32 default).
RTOL, ATOL = 2e-2, 2e-2
BATCH = 8

# The users' export recipe (onnx_fixtures) and the BERT wrapper
# (onnx_export_full) live in scripts/.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))


def agreement(got, want):
    """Max abs / rel difference and elements outside numpy's allclose
    (RTOL, ATOL as set for the run)."""
    rtol, atol = RTOL, ATOL
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.shape != want.shape:
        return {"shape": [list(got.shape), list(want.shape)], "ok": False}
    diff = np.abs(got - want)
    rel = diff / np.maximum(np.abs(want), 1e-30)
    outside = int((diff > atol + rtol * np.abs(want)).sum())
    return {
        "max_abs": float(diff.max()) if diff.size else 0.0,
        "max_rel": float(rel.max()) if rel.size else 0.0,
        "outside": outside,
        "elements": int(diff.size),
        "ok": outside == 0,
    }


def median_ms(fn, runs, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "runs": runs}


def models(torch):
    import torchvision
    from onnx_export_full import Bert  # scripts/: the same wrapper as the full exports

    tv = torchvision.models
    yield "resnet50", lambda: tv.resnet50(weights=None), {
        "input": torch.randn(BATCH, 3, 224, 224)}, ["output"]
    yield ("inception_v3", lambda: tv.inception_v3(weights=None, aux_logits=False, init_weights=True),
           {"input": torch.randn(BATCH, 3, 299, 299)}, ["output"])
    ids = torch.randint(0, 30522, (BATCH, 128))
    mask = torch.ones(BATCH, 128, dtype=torch.int64)
    mask[1::2, 96:] = 0  # every second sequence padded
    yield "bert_base", Bert, {"input_ids": ids, "attention_mask": mask}, [
        "last_hidden_state", "pooler_output"]


def cuda_graph(torch, model, inputs, outputs, ref, runs, dev, as_tuple):
    """CUDA-graph replay: inputs copied in from pinned host memory, outputs back."""
    row = {}
    pinned = [v.pin_memory() for v in inputs.values()]
    static = [v.to(dev) for v in inputs.values()]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = as_tuple(model(*static))

    def replay():
        for dst, src in zip(static, pinned):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        [o.cpu() for o in static_out]
    row["torch_cuda_graph"] = median_ms(replay, runs)
    graph_out = [o.float().cpu().numpy() for o in static_out]
    row["cuda_graph_agreement"] = {o: agreement(g, r) for o, g, r in zip(outputs, graph_out, ref)}
    return row


def calibrate_batch_norm(torch, model, inputs, batches=4):
    """Random weights with batch-norm statistics at their initial mean 0 /
    variance 1 let activations grow layer after layer (a random Inception-v3
    answers values near 1e12), where a trained model's statistics keep them
    near 1. Set each batch norm's running statistics from a few random
    batches (the cumulative average, as training converges to), so outputs
    and their comparison look like a trained model's."""
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    with torch.no_grad():
        for _ in range(batches):
            model(*[torch.randn_like(v) if v.is_floating_point() else v for v in inputs.values()])
    model.eval()


def bench_buffers(s, feeds, outputs, ref, runs):
    """`s.buffers()`: inputs written once into its arrays, then timed Runs
    with the outputs copied out (`lanes_buffers`) and viewed in the reply
    slot (`lanes_buffers_views`)."""
    row = {}
    with s.buffers() as bufs:
        for n, a in feeds.items():
            bufs[n] = a
        got = bufs.run(outputs)
        row["buffers_agreement"] = {o: agreement(g, r) for o, g, r in zip(outputs, got, ref)}
        row["lanes_buffers"] = median_ms(lambda: bufs.run(outputs), runs)
        row["lanes_buffers_views"] = median_ms(lambda: bufs.run(outputs, copy=False), runs)
        row["lanes_buffers_reply_bytes"] = bufs.reply_bytes
    return row


def bench_model(torch, lanes, client, name, build, inputs, outputs, runs, tmp, buffers=False):
    model = build()
    calibrate_batch_norm(torch, model, inputs)
    model = model.eval()
    # The users' export recipe, which also saves the inputs and PyTorch's
    # FP32 outputs on the CPU as `lanes import --check DIR` reads them.
    from onnx_fixtures import export_with_references
    path = export_with_references(model, inputs, outputs, tmp, name)
    row = {"onnx_bytes": os.path.getsize(path)}
    dev = torch.device("cuda")
    model = model.to(dev)
    host = {k: v.numpy() for k, v in inputs.items()}

    def as_tuple(out):
        return out if isinstance(out, tuple) else (out,)

    def forward():
        with torch.no_grad():
            out = as_tuple(model(*[v.to(dev) for v in inputs.values()]))
            return [o.float().cpu().numpy() for o in out]

    # The reference is PyTorch in FP32 (TF32 off); PyTorch's own output with
    # the session's TF32 setting is compared with it too, so Lanes' error
    # (TF32 convolutions) can be read beside PyTorch's.
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    ref = forward()
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags
    row["torch_agreement"] = {o: agreement(g, r) for o, g, r in zip(outputs, forward(), ref)}

    with client.session(name, kind="inference", priority=1) as s:
        t = time.perf_counter()
        s.load_onnx(path, batch=BATCH)
        row["lanes_load_s"] = time.perf_counter() - t
        dtypes = {n: dt for n, _, dt in s.inputs}
        feeds = {n: np.ascontiguousarray(a.astype(dtypes[n])) for n, a in host.items()}
        got = s.run(feeds, fetch=outputs)
        row["agreement"] = {o: agreement(g, r) for o, g, r in zip(outputs, got, ref)}
        row["lanes"] = median_ms(lambda: s.run(feeds, fetch=outputs), runs)
        if buffers:
            row.update(bench_buffers(s, feeds, outputs, ref, runs))

    with torch.no_grad():
        def eager():
            out = as_tuple(model(*[v.to(dev, non_blocking=False) for v in inputs.values()]))
            [o.cpu() for o in out]
        row["torch_eager"] = median_ms(eager, runs)

        resident = [v.to(dev) for v in inputs.values()]

        def eager_resident():
            model(*resident)
            torch.cuda.synchronize()
        row["torch_resident"] = median_ms(eager_resident, runs)

        try:
            row.update(cuda_graph(torch, model, inputs, outputs, ref, runs, dev, as_tuple))
        except RuntimeError as e:  # a model whose forward cannot be captured
            row["torch_cuda_graph"] = {"error": str(e).splitlines()[0]}
    graph = row.get("torch_cuda_graph", {}).get("median_ms")
    if graph:
        for k in ("lanes", "lanes_buffers", "lanes_buffers_views"):
            if k in row:
                row[f"{k}_over_cuda_graph"] = round(row[k]["median_ms"] / graph, 3)
    torch.cuda.empty_cache()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:5555")
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--models", nargs="*", default=None, help="subset: resnet50 inception_v3 bert_base")
    ap.add_argument("--no-tf32", action="store_true",
                    help="disable TF32 matmuls and convolutions in torch (start the service with --no-tf32 "
                         "too; outputs are then compared at FP32 tolerances)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--busy-poll", type=float, default=0.0, metavar="MS",
                    help="the client spins this long for each reply (start the service with --busy-poll too)")
    ap.add_argument("--no-adaptive-wait", action="store_true",
                    help="the client sleeps through every wait (without --busy-poll it otherwise polls "
                         "the reply slot for a bounded window around the expected reply)")
    ap.add_argument("--lanes-buffers", action="store_true",
                    help="also time Runs from s.buffers(): the input written once into the session's "
                         "feed buffers, outputs copied out (lanes_buffers) or viewed (lanes_buffers_views)")
    ap.add_argument("--keep", metavar="DIR",
                    help="write the exported .onnx files here, with their inputs and PyTorch's FP32 "
                         "outputs (CPU) as .npy for `lanes import --check DIR` (default: a temporary folder)")
    args = ap.parse_args(argv)

    import torch
    import lanes

    if args.no_tf32:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # The conformance suite's tolerance for long FP32 accumulations.
        global RTOL, ATOL
        RTOL, ATOL = 1e-3, 1e-4
    torch.manual_seed(args.seed)
    result = {
        "batch": BATCH,
        "runs": args.runs,
        "rtol": RTOL,
        "atol": ATOL,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "tf32": not args.no_tf32,
        "endpoint": args.endpoint,
        "models": {},
    }
    result["busy_poll_ms"] = args.busy_poll
    result["adaptive_wait"] = not args.no_adaptive_wait
    result["lanes_buffers"] = args.lanes_buffers
    with lanes.Client(args.endpoint, timeout=600.0, busy_poll=args.busy_poll / 1000.0,
                      adaptive_wait=not args.no_adaptive_wait) as client:
        result["service"] = {k: v for k, v in client.status().items() if not isinstance(v, list)}
        with tempfile.TemporaryDirectory() as scratch:
            tmp = args.keep or scratch
            os.makedirs(tmp, exist_ok=True)
            for name, build, inputs, outputs in models(torch):
                if args.models and name not in args.models:
                    continue
                try:
                    result["models"][name] = bench_model(
                        torch, lanes, client, name, build, inputs, outputs, args.runs, tmp,
                        buffers=args.lanes_buffers)
                except lanes.LanesError as e:
                    result["models"][name] = {"error": str(e), "code_name": e.code_name}
                print(f"{name}: done", file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
