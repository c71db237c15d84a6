#!/usr/bin/env python3
"""What the Open Inference Protocol front door (`lanes serve --http`) adds to
a request, for docs/serving.md: one model exported from PyTorch, called one
request at a time (a) over HTTP with Triton's binary tensor data extension
and (b) through the `lanes` Python client on the same service, same ONNX
file, same batch; medians of N requests and their difference, as one JSON
object. The HTTP client is the standard library's (`http.client`, one
keep-alive connection), so nothing but numpy is needed on the client side.

Two steps, since the service reads its repository at start:

    python3 benches/oip_latency.py export REPO [--model resnet50] [--batch 8]
    lanes serve --device cuda --endpoint tcp://127.0.0.1:5555 \\
        --http 127.0.0.1:8000 --model-repository REPO &
    python3 benches/oip_latency.py bench --url 127.0.0.1:8000 \\
        --endpoint tcp://127.0.0.1:5555 REPO [--runs 200] [--service-pid PID]

`export` needs torch and torchvision (random weights; the model is the
same for both paths, so its values do not matter for timing); it writes
REPO/NAME/1/model.onnx, a config.pbtxt with max_batch_size BATCH and no
dynamic batching (each request is one Run), and the batch's input as
REPO/NAME.input.npy. NAME is the model's unless --name gives one.

`--model probe` is a model that computes almost nothing (each channel's
mean, then a linear layer to 1000 outputs, ResNet's): what the front door
adds to a request of a given size shows on it even on a CPU service. Its
input is [BATCH, 3, SIZE, SIZE] (--size, default 224): 384 bytes at batch
8 and size 2, 602,112 (600 KB) at batch 1 and 224, 4.8 MB at batch 8 and
224, ResNet-50 b8's input. Several sizes go in one repository under
different --name, and `bench --model NAME` picks one.

`bench --shm` times a third path as well (and a fourth with --grpc-url
and tritonclient[grpc] installed): Triton's system shared memory extension
(`lanes serve --system-shared-memory`). The bench makes two POSIX shared
memory objects with the standard library (`multiprocessing.shared_memory`,
in /dev/shm), registers them, and each request copies the batch's input
into the input region, sends an infer request that names the regions
(over HTTP the JSON alone, over gRPC tritonclient's message) and copies
the output out of the output region: one copy of the input on the client,
as `lanes.Session.run` makes into its shared segment, so the difference
to the Python client is what the front door adds. The regions are
unregistered and removed at the end.

`floor` needs no service: the time to move a request of --bytes (default
4,816,896, ResNet-50 b8's input) over loopback TCP to a plain socket
server thread that only reads it and answers a few bytes, the least any
HTTP front door pays for such a request on this host:

    python3 benches/oip_latency.py floor [--bytes N] [--runs 300]
"""
import argparse
import http.client
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))


def write_model(repo, model, name, batch, size, config=None):
    """Exports MODEL (one of resnet50, resnet18, probe; random weights) to
    REPO/NAME/1/model.onnx with a dynamic batch axis, writes
    REPO/NAME/config.pbtxt (CONFIG, by default `max_batch_size: BATCH` and
    no dynamic batching) and the model's input at batch BATCH, SIZE x SIZE
    pixels, as REPO/NAME.input.npy. Returns the input's size in bytes.
    `oip_load.py export` calls it too."""
    import torch
    import torchvision

    from onnx_fixtures import export_with_references

    class Probe(torch.nn.Module):
        """Almost no computation: each channel's mean, then 3 -> 1000."""

        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 1000)

        def forward(self, x):
            return self.fc(x.mean(dim=(2, 3)))

    torch.manual_seed(0)
    builders = {
        "resnet50": lambda: torchvision.models.resnet50(weights=None),
        "resnet18": lambda: torchvision.models.resnet18(weights=None),
        "probe": Probe,
    }
    if model not in builders:
        sys.exit(f"unknown model {model!r} (one of {', '.join(builders)})")
    module = builders[model]().eval()
    x = torch.randn(batch, 3, size, size)
    with tempfile.TemporaryDirectory() as tmp:
        path = export_with_references(module, {"input": x}, ["output"], tmp, name)
        version = os.path.join(repo, name, "1")
        os.makedirs(version, exist_ok=True)
        os.replace(path, os.path.join(version, "model.onnx"))
    with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
        f.write(config if config is not None else f"max_batch_size: {batch}\n")
    np.save(os.path.join(repo, f"{name}.input.npy"), x.numpy())
    return int(x.numel()) * 4


def export(a):
    name = a.name or a.model
    size = write_model(a.repo, a.model, name, a.batch, a.size)
    print(json.dumps({"exported": name, "model": a.model, "repo": a.repo, "batch": a.batch,
                      "input_bytes": size}))


def process_cost(pid):
    """CPU seconds (user and system) and minor page faults of process PID so
    far, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # After the command's name: state, ppid, ..., minflt is the 10th field
    # of stat(5), utime the 14th, stime the 15th.
    minflt, utime, stime = int(fields[7]), int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK"), minflt


def timed(fn, runs, warmup, pid=None):
    for _ in range(warmup):
        fn()
    times = []
    before = process_cost(pid) if pid else None
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    row = {
        "median_ms": statistics.median(times),
        "p99_ms": times[min(len(times) - 1, int(0.99 * len(times)))],
        "min_ms": times[0],
        "runs": runs,
    }
    if before:
        cpu, faults = (b - a for a, b in zip(before, process_cost(pid)))
        # What the service process spent per request, on every thread
        # (front door, socket thread, executor): not disturbed by other
        # load on the host as the wall times are.
        row["service_cpu_ms"] = cpu * 1e3 / runs
        row["service_page_faults"] = faults / runs
    return row


class Http:
    """Binary infer requests over one keep-alive connection. The body is
    sent as it is, after the header lines (TCP_NODELAY, so the two sends
    do not wait on each other): `HTTPConnection.request` would first join
    the body to the header lines, a copy of the whole body on the client
    that is no part of what the front door costs."""

    def __init__(self, url, model, x):
        host, _, port = url.rpartition(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self.path = f"/v2/models/{model}/infer"
        header = json.dumps({
            "inputs": [{
                "name": "input", "shape": list(x.shape), "datatype": "FP32",
                "parameters": {"binary_data_size": x.nbytes},
            }],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        }).encode()
        self.body = header + np.ascontiguousarray(x, np.float32).tobytes()
        self.headers = {
            "Inference-Header-Content-Length": str(len(header)),
            "Content-Type": "application/octet-stream",
            "Content-Length": str(len(self.body)),
        }

    def infer(self):
        c = self.conn
        if c.sock is None:
            c.connect()
            c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.putrequest("POST", self.path, skip_accept_encoding=True)
        for k, v in self.headers.items():
            c.putheader(k, v)
        c.endheaders()
        c.send(self.body)
        r = c.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
        n = int(r.getheader("Inference-Header-Content-Length"))
        meta = json.loads(data[:n])
        out = meta["outputs"][0]
        return np.frombuffer(data[n:], np.float32).reshape(out["shape"])


class ShmPath:
    """Infer requests whose input and output are in POSIX shared memory
    regions registered with the service (Triton's system shared memory
    extension), over HTTP (`http.client`, the JSON alone) or gRPC
    (tritonclient). Each request copies the input into its region and the
    output out of its region."""

    def __init__(self, url, model, x, grpc_url=None):
        from multiprocessing import shared_memory

        host, _, port = url.rpartition(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)
        meta = self._call("GET", f"/v2/models/{model}")
        out_shape = [x.shape[0] if d == -1 else d for d in meta["outputs"][0]["shape"]]
        self.x, self.model, self.out_shape = x, model, out_shape
        out_bytes = int(np.prod(out_shape)) * 4
        tag = f"{os.getpid()}_{model}"
        self.regions = []
        for name, size in [(f"lanes_bench_in_{tag}", x.nbytes), (f"lanes_bench_out_{tag}", out_bytes)]:
            m = shared_memory.SharedMemory(name=name, create=True, size=size)
            self.regions.append((name, m))
            self._call("POST", f"/v2/systemsharedmemory/region/{name}/register",
                       {"key": "/" + name, "offset": 0, "byte_size": size})
        (in_name, in_mem), (out_name, out_mem) = self.regions
        self.x_view = np.ndarray(x.shape, np.float32, buffer=in_mem.buf)
        self.y_view = np.ndarray(out_shape, np.float32, buffer=out_mem.buf)
        self.body = json.dumps({
            "inputs": [{
                "name": "input", "shape": list(x.shape), "datatype": "FP32",
                "parameters": {"shared_memory_region": in_name,
                               "shared_memory_byte_size": x.nbytes},
            }],
            "outputs": [{"name": "output", "parameters": {
                "shared_memory_region": out_name, "shared_memory_byte_size": out_bytes}}],
        }).encode()
        self.grpc = None
        if grpc_url:
            import tritonclient.grpc as grpcclient

            self.grpc = grpcclient.InferenceServerClient(url=grpc_url)
            i = grpcclient.InferInput("input", list(x.shape), "FP32")
            i.set_shared_memory(in_name, x.nbytes)
            o = grpcclient.InferRequestedOutput("output")
            o.set_shared_memory(out_name, out_bytes)
            self.grpc_args = ([i], [o])

    def _call(self, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        self.conn.request(method, path, body=data,
                          headers={"Content-Type": "application/json"} if data else {})
        r = self.conn.getresponse()
        answer = r.read()
        if r.status != 200:
            raise RuntimeError(f"{method} {path}: HTTP {r.status}: {answer[:300]!r}")
        return json.loads(answer) if answer else None

    def infer_http(self):
        np.copyto(self.x_view, self.x)
        c = self.conn
        if c.sock is None:
            c.connect()
            c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.request("POST", f"/v2/models/{self.model}/infer", body=self.body,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
        return self.y_view.copy()

    def infer_grpc(self):
        np.copyto(self.x_view, self.x)
        self.grpc.infer(self.model, self.grpc_args[0], outputs=self.grpc_args[1])
        return self.y_view.copy()

    def close(self):
        self._call("POST", "/v2/systemsharedmemory/unregister")
        if self.grpc:
            self.grpc.close()
        del self.x_view, self.y_view
        for _, m in self.regions:
            m.close()
            m.unlink()


def max_abs_diff(a, b):
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


def bench(a):
    import lanes

    x = np.load(os.path.join(a.repo, f"{a.model}.input.npy")).astype(np.float32)
    path = os.path.join(a.repo, a.model, "1", "model.onnx")
    h = Http(a.url, a.model, x)
    via_http = h.infer()
    row = {"model": a.model, "batch": int(x.shape[0]), "input_bytes": int(x.nbytes),
           "runs": a.runs}
    row["http_binary"] = timed(h.infer, a.runs, a.warmup, a.service_pid)
    shm_outputs = {}
    if a.shm:
        sp = ShmPath(a.url, a.model, x, a.grpc_url)
        try:
            paths = [("http_shm", sp.infer_http)]
            if a.grpc_url:
                paths.append(("grpc_shm", sp.infer_grpc))
            for key, fn in paths:
                shm_outputs[key] = fn()
                row[key] = timed(fn, a.runs, a.warmup, a.service_pid)
        finally:
            sp.close()
    with lanes.Client(a.endpoint) as client:
        with client.session(f"oip-ref-{a.model}", kind="inference", priority=1) as s:
            s.load_onnx(path, batch=int(x.shape[0]))
            via_client = s.run({"input": x}, fetch=["output"])[0]
            row["lanes_client"] = timed(lambda: s.run({"input": x}, fetch=["output"]), a.runs,
                                        a.warmup, a.service_pid)
    row["outputs_max_abs_diff"] = max_abs_diff(via_http, via_client)
    row["http_adds_ms"] = row["http_binary"]["median_ms"] - row["lanes_client"]["median_ms"]
    if a.service_pid:
        row["http_adds_service_cpu_ms"] = (row["http_binary"]["service_cpu_ms"]
                                           - row["lanes_client"]["service_cpu_ms"])
    for key, y in shm_outputs.items():
        row[f"{key}_outputs_max_abs_diff"] = max_abs_diff(y, via_client)
        row[f"{key}_adds_ms"] = row[key]["median_ms"] - row["lanes_client"]["median_ms"]
        if a.service_pid:
            row[f"{key}_adds_service_cpu_ms"] = (row[key]["service_cpu_ms"]
                                                 - row["lanes_client"]["service_cpu_ms"])
    print(json.dumps(row))


def floor(a):
    """The floor under any HTTP front door: the time to move one request of
    the same size over loopback TCP with nothing else done with it. A plain
    socket server thread (in this process) reads exactly the request's
    bytes into one buffer allocated once, as an HTTP server's receiving
    copy does, and answers a few bytes; the client sends header lines and
    body as `bench` does (two sends, TCP_NODELAY) and waits for the answer.
    No parsing, no copy after the socket's: what is left is the kernel's
    work and the wake-ups of a request and its answer."""
    header = (f"POST /v2/models/floor/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              f"Content-Type: application/octet-stream\r\n"
              f"Content-Length: {a.bytes}\r\n\r\n").encode()
    body = np.random.default_rng(0).integers(0, 256, a.bytes, dtype=np.uint8).tobytes()
    request = len(header) + len(body)
    reply = b"x" * a.reply_bytes
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(request)
        view = memoryview(buf)
        with conn:
            while True:
                got = 0
                while got < request:
                    n = conn.recv_into(view[got:])
                    if n == 0:
                        return
                    got += n
                conn.sendall(reply)

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    answer = bytearray(a.reply_bytes)
    answer_view = memoryview(answer)

    def one():
        client.sendall(header)
        client.sendall(body)
        got = 0
        while got < a.reply_bytes:
            n = client.recv_into(answer_view[got:])
            if n == 0:
                raise RuntimeError("the floor's server closed the connection")
            got += n

    row = {"floor": True, "request_bytes": request, "reply_bytes": a.reply_bytes}
    row.update(timed(one, a.runs, a.warmup, os.getpid()))
    # Here `service_*` is this process, client and server together.
    row["process_cpu_ms"] = row.pop("service_cpu_ms")
    row["process_page_faults"] = row.pop("service_page_faults")
    row["gb_per_s"] = request / (row["median_ms"] * 1e-3) / 1e9
    client.close()
    server.join(timeout=10)
    listener.close()
    print(json.dumps(row))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export", help="write the model repository")
    e.add_argument("repo")
    e.add_argument("--model", default="resnet50")
    e.add_argument("--batch", type=int, default=8)
    e.add_argument("--size", type=int, default=224, help="the input's height and width")
    e.add_argument("--name", help="the model's name in the repository (default: --model)")
    b = sub.add_parser("bench", help="time both paths against a running lanes serve --http")
    b.add_argument("repo")
    b.add_argument("--model", default="resnet50")
    b.add_argument("--url", default="127.0.0.1:8000", help="HOST:PORT of --http")
    b.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="the service's endpoint")
    b.add_argument("--runs", type=int, default=200)
    b.add_argument("--warmup", type=int, default=10)
    b.add_argument("--service-pid", type=int,
                   help="the lanes serve process: also report its CPU time and minor page "
                        "faults per request (Linux), for each path")
    b.add_argument("--shm", action="store_true",
                   help="also time inputs and outputs in shared memory regions (the service "
                        "needs --system-shared-memory): over HTTP, and over gRPC with --grpc-url")
    b.add_argument("--grpc-url", help="HOST:PORT of --grpc, for --shm over gRPC (needs "
                                      "tritonclient[grpc])")
    f = sub.add_parser("floor", help="time moving a request's bytes over loopback TCP, nothing "
                                     "else (what any HTTP front door pays)")
    f.add_argument("--bytes", type=int, default=4816896,
                   help="the body's size (default: ResNet-50 b8's input, 4,816,896)")
    f.add_argument("--reply-bytes", type=int, default=64, help="the answer's size")
    f.add_argument("--runs", type=int, default=300)
    f.add_argument("--warmup", type=int, default=20)
    a = ap.parse_args()
    if a.cmd == "floor":
        if a.bytes < 0 or a.reply_bytes < 1 or a.runs < 1 or a.warmup < 0:
            ap.error("--bytes not negative, --reply-bytes and --runs positive, --warmup not "
                     "negative")
        floor(a)
    elif a.cmd == "export":
        if a.batch < 1 or a.size < 1:
            ap.error("--batch and --size must be positive")
        export(a)
    else:
        if a.runs < 1 or a.warmup < 0:
            ap.error("--runs must be positive, --warmup not negative")
        if a.grpc_url and not a.shm:
            ap.error("--grpc-url times the shared memory path over gRPC: give --shm too")
        bench(a)


if __name__ == "__main__":
    main()
