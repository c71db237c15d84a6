"""Prints one line per workload from `lanes bench infer|train --path both`
JSON files and `benches/torch_ref.py` JSON lines (given as arguments):
Lanes executor and service medians, PyTorch host/resident medians, ratios."""
import json
import sys

lanes, torch = {}, {}
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
            else:
                lanes[key] = d
for key, d in sorted(lanes.items(), key=lambda kv: str(kv[0])):
    ex = (d.get("executor") or {}).get("median_ms")
    sv = (d.get("service") or {}).get("median_ms")
    ah = ((d.get("service") or {}).get("one_run_ahead") or {}).get("median_ms")
    t = torch.get(key, {})
    th, tr = t.get("host_median_ms"), t.get("resident_median_ms")
    r = lambda a, b: round(a / b, 2) if a and b else None
    print(key, "executor", ex and round(ex, 2), "service", sv and round(sv, 2),
          "torch host", th and round(th, 2), "resident", tr and round(tr, 2),
          "exec/host", r(ex, th), "exec/res", r(ex, tr), "service/host", r(sv, th),
          "ahead", ah and round(ah, 2), "ahead/host", r(ah, th))
