"""Fixtures: a `lanes serve --device cpu` child process per test session.

The binary is $LANES_BIN, by default the repository's target/release/lanes
(build it with `cargo build --release`). LANES_TEST_DEVICE=cuda runs the
service on the GPU instead (convolutions in plain FP32, `--no-tf32`, so that
results compare with the CPU references at the same tolerances).
"""

import os
import subprocess
import time
from pathlib import Path

import pytest

import lanes

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"


def lanes_bin() -> Path:
    path = Path(os.environ.get("LANES_BIN", REPO / "target" / "release" / "lanes"))
    if not path.is_file():
        pytest.exit(
            f"no lanes binary at {path}: run `cargo build --release` or set LANES_BIN",
            returncode=2,
        )
    return path


def device_args() -> list:
    """`lanes serve` flags for LANES_TEST_DEVICE (cpu by default)."""
    device = os.environ.get("LANES_TEST_DEVICE", "cpu")
    if device == "cuda":
        return ["--device", "cuda", "--no-tf32", "--memory", "16GiB"]
    return ["--device", device]


@pytest.fixture(scope="session")
def endpoint(tmp_path_factory):
    sock = tmp_path_factory.mktemp("lanes") / "serve.sock"
    ep = f"ipc://{sock}"
    log = open(sock.with_name("serve.log"), "wb")
    proc = subprocess.Popen(
        [str(lanes_bin()), "serve", "--endpoint", ep, "--workers", "2", *device_args()],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            log.close()
            raise RuntimeError(
                f"lanes serve exited with {proc.returncode}: "
                + sock.with_name("serve.log").read_text(errors="replace")
            )
        try:
            lanes.Client(ep, timeout=2.0).close()
            break
        except lanes.LanesError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)
    yield ep
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()


@pytest.fixture
def client(endpoint):
    with lanes.Client(endpoint) as c:
        yield c
