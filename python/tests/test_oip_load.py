"""benches/oip_load.py, the front door's throughput at a p99 target with
dynamic batching and without, run briefly against a real `lanes serve
--http` on a probe model: its export writes both models, its bench prints a
row per level and a summary, and the batched model's statistics show Runs
of several requests (counted, not timed)."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, device_args, start_http_service, stop_service

pytest.importorskip("torch")
pytest.importorskip("torchvision")  # the export's onnx_fixtures imports it
pytest.importorskip("onnx")  # torch.onnx.export needs it

BENCH = REPO / "benches" / "oip_load.py"


def run_bench(*args, timeout=300):
    r = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(HTTP address, repository) of a service with the two probe models."""
    root = tmp_path_factory.mktemp("oip_load")
    repo = root / "models"
    # A long delay and a preferred size of 4: four callers in flight are
    # gathered into Runs of several requests whatever the host's speed.
    [exported] = run_bench("export", str(repo), "--model", "probe", "--size", "8",
                           "--max-batch", "8", "--delay-us", "20000", "--preferred", "4")
    assert exported["exported"] == ["probe_unbatched", "probe_batched"]
    assert "dynamic_batching" in (repo / "probe_batched" / "config.pbtxt").read_text()
    assert "dynamic_batching" not in (repo / "probe_unbatched" / "config.pbtxt").read_text()
    proc, _, url = start_http_service(
        f"ipc://{root / 'serve.sock'}",
        ["--http", "127.0.0.1:0", "--model-repository", str(repo), *device_args()],
        root / "serve.log",
    )
    yield url, repo
    stop_service(proc)


def test_the_sweep_reports_levels_and_batching_gathers_requests(served):
    url, repo = served
    rows = run_bench("bench", str(repo), "--url", url, "--model", "probe",
                     "--concurrency", "1,4", "--seconds", "2", "--warmup", "0.5",
                     "--p99-ms", "60000")
    levels, summary = rows[:-1], rows[-1]
    assert [(r["model"], r["concurrency"]) for r in levels] == [
        ("probe_unbatched", 1), ("probe_unbatched", 4), ("probe_batched", 1), ("probe_batched", 4)]
    for r in levels:
        assert r["errors"] == 0
        assert r["requests"] > 0
        assert r["throughput_infer_per_s"] == pytest.approx(r["requests"] / 2.0)
        assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
        s = r["server"]
        assert s["failed"] == 0
        # Batch-1 requests: one row each.
        assert s["inference_count"] == s["requests"] > 0
        assert sum(s["runs_by_batch_size"].values()) == s["execution_count"]
        assert s["execution_count_total"] >= s["execution_count"]
    for r in levels[:2]:
        # Without dynamic batching each request is a Run of its own.
        assert r["server"]["runs_by_batch_size"] == {"1": r["server"]["execution_count"]}
    gathered = levels[3]["server"]
    assert max(int(b) for b in gathered["runs_by_batch_size"]) > 1, gathered
    assert gathered["execution_count"] < gathered["inference_count"], gathered
    assert summary["summary"] is True and summary["p99_target_ms"] == 60000
    for name in ("probe_unbatched", "probe_batched"):
        best = summary[name]
        assert best["throughput_infer_per_s"] == max(
            r["throughput_infer_per_s"] for r in levels if r["model"] == name)
    assert summary["batched_over_unbatched"] == pytest.approx(
        summary["probe_batched"]["throughput_infer_per_s"]
        / summary["probe_unbatched"]["throughput_infer_per_s"])


def test_a_target_no_level_meets_gives_no_best(served):
    url, repo = served
    rows = run_bench("bench", str(repo), "--url", url, "--model", "probe",
                     "--concurrency", "2", "--seconds", "1", "--warmup", "0.2",
                     "--p99-ms", "0.000001")
    summary = rows[-1]
    assert summary["probe_unbatched"] is None and summary["probe_batched"] is None
    assert summary["batched_over_unbatched"] is None
