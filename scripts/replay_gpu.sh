#!/usr/bin/env bash
# Live vs simulated on the GPU: one 16-job trace replayed as real
# resnet18_cifar jobs against `lanes serve --device cuda` in four
# configurations (one lane srtf, one lane fifo, two lanes srtf, two lanes
# fifo), each compared with the simulator on the trace as it ran.
#
# Run from the repository root on the GPU machine:
#   OUT=/some/dir bash scripts/replay_gpu.sh
# LANES names the binary (default: `bash .gpu/env.sh .gpu/bin/lanes`, the
# carried build). Writes under $OUT (default ./replay-gpu-out): the trace,
# each configuration's `lanes replay --json` and service log, and
# summary.json; prints a table of live / simulated average JCT (the
# as-run simulation with each job's graph load holding a lane's worker
# for the time the service's metrics give, and without, for comparison).
# DEVICE, JOBS, ZOO, SCALE, MEMORY override the defaults (cuda, 16,
# resnet18_cifar, 0.1, 16GiB), e.g. for a quick check on the CPU.
# Each service is stopped after its replay. About 4-6 minutes.
set -euo pipefail

OUT=${OUT:-./replay-gpu-out}
mkdir -p "$OUT"
if [[ -n "${LANES:-}" ]]; then
    read -r -a LANES_CMD <<<"$LANES"
else
    LANES_CMD=(bash .gpu/env.sh .gpu/bin/lanes)
fi
MEMORY=${MEMORY:-16GiB}
DEVICE=${DEVICE:-cuda}
JOBS=${JOBS:-16}
ZOO=${ZOO:-resnet18_cifar}
SCALE=${SCALE:-0.1}
REPLAY_TIMEOUT=${REPLAY_TIMEOUT:-170}
PORT=${PORT:-5611}

lanes() { "${LANES_CMD[@]}" "$@"; }

TRACE="$OUT/trace.csv"
lanes trace gen --jobs "$JOBS" --seed 3 --mean-interarrival 2 --out "$TRACE"

SERVICE_PID=""
stop_service() {
    if [[ -n "$SERVICE_PID" ]] && kill -0 "$SERVICE_PID" 2>/dev/null; then
        # The service runs in its own process group (setsid): the wrapper
        # (.gpu/env.sh) and the service go together.
        kill -- "-$SERVICE_PID" 2>/dev/null || kill "$SERVICE_PID" 2>/dev/null || true
        for _ in $(seq 1 50); do
            kill -0 "$SERVICE_PID" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 -- "-$SERVICE_PID" 2>/dev/null || kill -9 "$SERVICE_PID" 2>/dev/null || true
        wait "$SERVICE_PID" 2>/dev/null || true
    fi
    SERVICE_PID=""
}
trap stop_service EXIT

# run NAME LANES POLICY CONTENTION
run() {
    local name=$1 nlanes=$2 policy=$3 contention=$4
    local endpoint="tcp://127.0.0.1:$PORT"
    # The replay reads the service's own timing of each LoadGraph here.
    local metrics="127.0.0.1:$((PORT + 100))"
    PORT=$((PORT + 1))
    local log="$OUT/$name.serve.log"
    setsid "${LANES_CMD[@]}" serve --device "$DEVICE" --endpoint "$endpoint" --policy "$policy" \
        --workers "$nlanes" --max-lanes "$nlanes" --memory "$MEMORY" --metrics "$metrics" \
        >"$log" 2>&1 &
    SERVICE_PID=$!
    # Wait for the endpoint (the service prints it once bound).
    local up=0
    for _ in $(seq 1 120); do
        if grep -q "lanes serving on" "$log"; then
            up=1
            break
        fi
        if ! kill -0 "$SERVICE_PID" 2>/dev/null; then
            break
        fi
        sleep 0.5
    done
    if [[ $up != 1 ]]; then
        echo "$name: the service did not come up; its log:" >&2
        cat "$log" >&2
        stop_service
        return 1
    fi
    echo "== $name: lanes serve --workers $nlanes --max-lanes $nlanes --policy $policy" >&2
    local rc=0
    timeout "$REPLAY_TIMEOUT" "${LANES_CMD[@]}" replay --trace "$TRACE" \
        --endpoint "$endpoint" --zoo "$ZOO" --time-scale "$SCALE" \
        --memory "$MEMORY" --lanes "$nlanes" --contention "$contention" --metrics "$metrics" --json \
        >"$OUT/$name.json" 2>"$OUT/$name.replay.log" || rc=$?
    stop_service
    if [[ $rc != 0 ]]; then
        echo "$name: lanes replay failed (exit $rc); see $OUT/$name.replay.log" >&2
        tail -5 "$OUT/$name.replay.log" >&2 || true
        return 0
    fi
}

run one-lane-srtf 1 srtf off
run one-lane-fifo 1 fifo off
run two-lanes-srtf 2 srtf h100-resnet18-cifar
run two-lanes-fifo 2 fifo h100-resnet18-cifar

python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
rows = []
for name in ["one-lane-srtf", "one-lane-fifo", "two-lanes-srtf", "two-lanes-fifo"]:
    path = os.path.join(out, name + ".json")
    try:
        with open(path) as f:
            c = json.load(f)[0]
    except (OSError, ValueError, IndexError) as e:
        rows.append({"config": name, "error": str(e)})
        continue
    rows.append({
        "config": name,
        "policy": c["policy"],
        "lanes": c["lanes"],
        "contention": c["contention"],
        "live_avg_jct_s": c["live"]["avg_jct_s"],
        "sim_as_run_avg_jct_s": c["simulated_as_run"]["avg_jct_s"],
        "live_over_sim_as_run": c["live_over_sim_as_run_avg_jct"],
        "live_over_sim_as_run_without_loads": c.get("live_over_sim_as_run_without_loads_avg_jct"),
        "startup_ms": c.get("startup_ms"),
        "load_ms": c.get("load_ms"),
        "after_load_ms": c.get("after_load_ms"),
        "load_measured_by": c.get("load_measured_by"),
    })
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(rows, f, indent=2)
print(f"{'config':<16} {'live avg JCT s':>15} {'sim as-run s':>13} {'live/sim':>9} {'no loads':>9}"
      "  start-up ms (train, infer)  load ms (train, infer)")
for r in rows:
    if "error" in r:
        print(f"{r['config']:<16} failed: {r['error']}")
        continue
    s = r["startup_ms"] or {}
    l = r["load_ms"] or {}
    nl = r["live_over_sim_as_run_without_loads"] or 0.0
    print(f"{r['config']:<16} {r['live_avg_jct_s']:>15.3f} {r['sim_as_run_avg_jct_s']:>13.3f} "
          f"{r['live_over_sim_as_run']:>9.3f} {nl:>9.3f}  {s.get('training', 0):.0f}, {s.get('inference', 0):.0f}"
          f"  {l.get('training', 0):.0f}, {l.get('inference', 0):.0f} ({r['load_measured_by']})")
EOF
