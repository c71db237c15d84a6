"""Prints the executor-and-service-versus-PyTorch table (markdown) from
`lanes bench infer|train` JSON files and `benches/torch_ref.py` JSON lines,
given as arguments (all from one session on one GPU).

Per workload: the Lanes executor median; the service path with feeds as
tensors; the service path with feed buffers (and busy polling, when the
file says so); PyTorch eager with the input resident and CUDA-graph replay
with the input copied from pinned host memory; and the ratios the goals are
stated in. A Lanes file may hold either path or both; several files for one
workload are merged (the service variant is told by its `feeds_via`)."""
import json
import sys

rows, torch = {}, {}
for path in sys.argv[1:]:
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            d = json.loads(line)
            key = (d.get("bench"), d.get("model"))
            if d.get("impl") == "pytorch-eager":
                torch[key] = d
                continue
            r = rows.setdefault(key, {})
            ex = (d.get("executor") or {}).get("median_ms")
            if ex is not None:
                r["executor"] = ex
            sv = d.get("service") or {}
            if sv.get("median_ms") is not None:
                buffers = str(sv.get("feeds_via", "")).startswith("feed buffers")
                r["buffers" if buffers else "service"] = sv["median_ms"]
                if buffers:
                    r["busy_poll_ms"] = sv.get("busy_poll_ms")


def f(x):
    return "–" if x is None else f"{x:.3f}"


def ratio(a, b):
    return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def diff(a, b):
    return "–" if a is None or b is None else f"{a - b:.3f}"


print("| workload | executor | service, tensors | service, feed buffers | PyTorch eager resident "
      "| PyTorch graph | exec/graph | service/graph | buffers/graph | service − exec | buffers − exec |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for key in sorted(rows, key=str):
    r, t = rows[key], torch.get(key, {})
    ex, sv, bf = r.get("executor"), r.get("service"), r.get("buffers")
    graph, res = t.get("graph_median_ms"), t.get("resident_median_ms")
    # Training has no graph figure: its yardstick is eager with the input
    # resident.
    yard = graph if graph is not None else res
    name = f"{key[1]} {key[0]}"
    print(f"| {name} | {f(ex)} | {f(sv)} | {f(bf)} | {f(res)} | {f(graph)} | {ratio(ex, yard)} "
          f"| {ratio(sv, yard)} | {ratio(bf, yard)} | {diff(sv, ex)} | {diff(bf, ex)} |")
