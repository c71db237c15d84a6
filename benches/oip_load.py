#!/usr/bin/env python3
"""Throughput at a p99 latency target through the Open Inference Protocol
front door (`lanes serve --http`), with dynamic batching and without: the
measurement of `perf_analyzer --concurrency-range`, for hosts that do not
have it. Closed loop: at each concurrency C, C callers (threads, one
keep-alive connection each, spread over --processes processes) each send
one request, wait for its answer and send the next, for --warmup seconds
and then --seconds measured. Requests are batch 1 (many callers with one
image each, the case dynamic batching is for), binary tensor data, with
the standard library's `http.client` (oip_latency.py's client), so only
numpy is needed on the client side.

Two steps, since the service reads its repository at start:

    python3 benches/oip_load.py export REPO [--model resnet50] [--max-batch 8] \\
        [--delay-us 100] [--preferred 4,8]
    lanes serve --device cuda --http 127.0.0.1:8000 --model-repository REPO &
    python3 benches/oip_load.py bench REPO --url 127.0.0.1:8000 [--model resnet50] \\
        [--concurrency 1,2,4,8,16,32] [--seconds 10] [--warmup 3] [--p99-ms 10]

`export` writes one ONNX file (oip_latency.py's export: resnet50, resnet18
or probe; --size pixels square) as two models of the same max_batch_size:
NAME_unbatched (no dynamic batching: each request is one Run) and
NAME_batched (`dynamic_batching { max_queue_delay_microseconds: D
preferred_batch_size: [...] }`), and a batch-1 input as
REPO/NAME_unbatched.input.npy.

`bench` measures both models in turn, each over every concurrency, and
prints one JSON object per level: throughput (inferences per second),
client latency (p50, p99, of the requests answered in the measured
seconds), errors, the callers' CPU use, and the model's server-side
statistics over the measured seconds (from /stats: Runs, rows, Runs by
batch size, mean queueing and compute per request, time spent opening
sessions for new batch sizes, which a long enough warm-up keeps at 0),
then a summary: for each model the best throughput whose p99 is within
--p99-ms, and the batched model's over the unbatched one's.
"""
import argparse
import http.client
import json
import multiprocessing
import os
import shutil
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oip_latency  # noqa: E402  (its export and its HTTP client)


def model_names(name):
    """(unbatched, batched) model names for NAME."""
    return f"{name}_unbatched", f"{name}_batched"


def export(a):
    plain, batched = model_names(a.name or a.model)
    size = oip_latency.write_model(a.repo, a.model, plain, 1, a.size,
                                   f"max_batch_size: {a.max_batch}\n")
    os.makedirs(os.path.join(a.repo, batched, "1"), exist_ok=True)
    shutil.copyfile(os.path.join(a.repo, plain, "1", "model.onnx"),
                    os.path.join(a.repo, batched, "1", "model.onnx"))
    preferred = ", ".join(str(p) for p in a.preferred)
    with open(os.path.join(a.repo, batched, "config.pbtxt"), "w") as f:
        f.write(f"max_batch_size: {a.max_batch}\n"
                f"dynamic_batching {{\n"
                f"  max_queue_delay_microseconds: {a.delay_us}\n"
                f"  preferred_batch_size: [ {preferred} ]\n"
                f"}}\n")
    print(json.dumps({"exported": [plain, batched], "model": a.model, "repo": a.repo,
                      "max_batch_size": a.max_batch, "max_queue_delay_us": a.delay_us,
                      "preferred_batch_size": a.preferred, "request_input_bytes": size}))


def callers(url, model, x, threads, pipe):
    """One process's callers: THREADS threads, each with its own connection.
    Reports "ready" once each has been answered once, waits for the
    measured window (start, end) in time.monotonic() seconds (one clock for
    every process on Linux), calls until its end and sends back the
    latencies (ms) of the requests answered within it, the errors, and the
    process's CPU seconds over it."""
    clients = [oip_latency.Http(url, model, x) for _ in range(threads)]
    try:
        for c in clients:
            c.infer()
    except (OSError, RuntimeError, http.client.HTTPException) as e:
        pipe.send(("failed", f"{type(e).__name__}: {e}"))
        return
    pipe.send(("ready", None))
    start, end = pipe.recv()
    latencies = [[] for _ in clients]
    errors = [0] * len(clients)

    def loop(k):
        c = clients[k]
        while True:
            t0 = time.monotonic()
            if t0 >= end:
                return
            try:
                c.infer()
            except (OSError, RuntimeError, http.client.HTTPException):
                errors[k] += 1
                # A broken connection is opened again by the next request.
                c.conn.close()
                continue
            t1 = time.monotonic()
            if start <= t1 < end:
                latencies[k].append((t1 - t0) * 1e3)

    workers = [threading.Thread(target=loop, args=(k,)) for k in range(len(clients))]
    for w in workers:
        w.start()
    time.sleep(max(0.0, start - time.monotonic()))
    cpu0 = time.process_time()
    time.sleep(max(0.0, end - time.monotonic()))
    cpu1 = time.process_time()
    for w in workers:
        w.join()
    for c in clients:
        c.conn.close()
    pipe.send(("done", ([t for ls in latencies for t in ls], sum(errors), cpu1 - cpu0)))


def get_stats(url, model):
    host, _, port = url.rpartition(":")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        c.request("GET", f"/v2/models/{model}/stats")
        r = c.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"stats of {model}: HTTP {r.status}: {data[:300]!r}")
        return json.loads(data)["model_stats"][0]
    finally:
        c.close()


def stats_delta(before, after):
    """The model's statistics over a window: counts and mean times."""
    def count(s, k):
        return int(s["inference_stats"][k]["count"])

    def ns(s, k):
        return int(s["inference_stats"][k]["ns"])

    def by_batch(s):
        return {int(b["batch_size"]): int(b["compute_infer"]["count"]) for b in s["batch_stats"]}

    b0, b1 = by_batch(before), by_batch(after)
    runs_by_batch = {str(k): v - b0.get(k, 0) for k, v in sorted(b1.items())
                     if v - b0.get(k, 0) > 0}
    requests = count(after, "success") - count(before, "success")

    def mean_ms(k):
        return (ns(after, k) - ns(before, k)) / 1e6 / requests if requests else None

    return {
        "execution_count": int(after["execution_count"]) - int(before["execution_count"]),
        "inference_count": int(after["inference_count"]) - int(before["inference_count"]),
        "requests": requests,
        "failed": count(after, "fail") - count(before, "fail"),
        "runs_by_batch_size": runs_by_batch,
        "queue_ms_mean": mean_ms("queue"),
        "compute_infer_ms_mean": mean_ms("compute_infer"),
        "opening_sessions_ms": (ns(after, "compute_input") - ns(before, "compute_input")) / 1e6,
        "execution_count_total": int(after["execution_count"]),
        "batch_stats_total": after["batch_stats"],
    }


def percentile(sorted_ms, q):
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))] if sorted_ms else None


def level(a, model, x, concurrency):
    """One concurrency level of one model: its JSON row."""
    ctx = multiprocessing.get_context("spawn")
    procs = min(a.processes, concurrency)
    shares = [concurrency // procs + (1 if k < concurrency % procs else 0) for k in range(procs)]
    pipes, children = [], []
    for n in shares:
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=callers, args=(a.url, model, x, n, theirs), daemon=True)
        p.start()
        pipes.append(ours)
        children.append(p)
    try:
        for p in pipes:
            kind, why = p.recv()
            if kind != "ready":
                sys.exit(f"{model}: a caller failed before the level started: {why}")
        start = time.monotonic() + a.warmup
        end = start + a.seconds
        for p in pipes:
            p.send((start, end))
        time.sleep(max(0.0, start - time.monotonic()))
        before = get_stats(a.url, model)
        time.sleep(max(0.0, end - time.monotonic()))
        after = get_stats(a.url, model)
        latencies, errors, cpu = [], 0, 0.0
        for p in pipes:
            kind, (ms, err, c) = p.recv()
            latencies += ms
            errors += err
            cpu += c
    finally:
        for p in children:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    latencies.sort()
    rows = int(x.shape[0])
    return {
        "model": model,
        "concurrency": concurrency,
        "processes": procs,
        "seconds": a.seconds,
        "requests": len(latencies),
        "errors": errors,
        "throughput_infer_per_s": len(latencies) * rows / a.seconds,
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
        "max_ms": latencies[-1] if latencies else None,
        "client_cpu_cores": cpu / a.seconds,
        "server": stats_delta(before, after),
    }


def best_within(rows, target):
    """The row of the highest throughput whose p99 is within TARGET ms."""
    ok = [r for r in rows if r["p99_ms"] is not None and r["p99_ms"] <= target
          and r["errors"] == 0]
    if not ok:
        return None
    r = max(ok, key=lambda r: r["throughput_infer_per_s"])
    return {"throughput_infer_per_s": r["throughput_infer_per_s"],
            "concurrency": r["concurrency"], "p99_ms": r["p99_ms"], "p50_ms": r["p50_ms"]}


def bench(a):
    plain, batched = model_names(a.model)
    x = np.load(os.path.join(a.repo, f"{plain}.input.npy")).astype(np.float32)
    if x.shape[0] != 1:
        sys.exit(f"{plain}.input.npy has {x.shape[0]} rows; the load is batch-1 requests")
    summary = {"summary": True, "p99_target_ms": a.p99_ms, "measured_by": "benches/oip_load.py",
               "input_bytes": int(x.nbytes)}
    for name in (plain, batched):
        rows = []
        for c in a.concurrency:
            row = level(a, name, x, c)
            print(json.dumps(row), flush=True)
            rows.append(row)
        summary[name] = best_within(rows, a.p99_ms)
    p, b = summary[plain], summary[batched]
    summary["batched_over_unbatched"] = (
        b["throughput_infer_per_s"] / p["throughput_infer_per_s"] if p and b else None)
    print(json.dumps(summary), flush=True)


def positive_list(text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"not a list of positive integers: {text!r}")
    return values


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write the two models (batched and unbatched)")
    e.add_argument("repo")
    e.add_argument("--model", default="resnet50", help="resnet50, resnet18 or probe")
    e.add_argument("--name", help="the models' name before _batched/_unbatched "
                                  "(default: --model)")
    e.add_argument("--size", type=int, default=224, help="the input's height and width")
    e.add_argument("--max-batch", type=int, default=8, help="max_batch_size of both")
    e.add_argument("--delay-us", type=int, default=100,
                   help="the batched model's max_queue_delay_microseconds")
    e.add_argument("--preferred", type=positive_list, default=[4, 8],
                   help="the batched model's preferred_batch_size, comma-separated")
    b = sub.add_parser("bench", help="the concurrency sweep against a running lanes serve --http")
    b.add_argument("repo")
    b.add_argument("--model", default="resnet50", help="the name given to export")
    b.add_argument("--url", default="127.0.0.1:8000", help="HOST:PORT of --http")
    b.add_argument("--concurrency", type=positive_list, default=[1, 2, 4, 8, 16, 32],
                   help="callers at each level, comma-separated")
    b.add_argument("--seconds", type=float, default=10.0, help="measured at each level")
    b.add_argument("--warmup", type=float, default=3.0, help="seconds before each level's")
    b.add_argument("--p99-ms", type=float, default=10.0, help="the latency target")
    b.add_argument("--processes", type=int, default=1,
                   help="processes the callers are spread over (Python's lock limits one)")
    a = ap.parse_args()
    if a.cmd == "export":
        if a.max_batch < 1 or a.size < 1 or a.delay_us < 0:
            ap.error("--max-batch and --size must be positive, --delay-us not negative")
        if max(a.preferred) > a.max_batch:
            ap.error("a --preferred size is over --max-batch")
        export(a)
    else:
        if a.seconds <= 0 or a.warmup < 0 or a.processes < 1 or a.p99_ms <= 0:
            ap.error("--seconds, --processes and --p99-ms must be positive, --warmup not "
                     "negative")
        bench(a)


if __name__ == "__main__":
    main()
