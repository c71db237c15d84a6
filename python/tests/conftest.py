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


def start_service(sock, args, log_path):
    """A `lanes serve` child on `ipc://sock` with `args`, once a client
    connects (60 s at most; its output goes to `log_path`): (process,
    endpoint)."""
    ep = f"ipc://{sock}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(lanes_bin()), "serve", "--endpoint", ep, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"lanes serve exited with {proc.returncode}: "
                + Path(log_path).read_text(errors="replace")
            )
        try:
            lanes.Client(ep, timeout=2.0, connect_timeout=1.0).close()
            return proc, ep
        except lanes.LanesError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)


def start_http_service(endpoint, args, log_path):
    """A `lanes serve` child on `endpoint` with `args` (which open the
    inference protocol's front door, `--http ...`), once its ready line
    names the front door; its stderr goes to `log_path`: (process, ready
    line, HTTP address without `/v2`)."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [str(lanes_bin()), "serve", "--endpoint", endpoint, *args],
            stdout=subprocess.PIPE,
            stderr=log,
        )
    line = proc.stdout.readline().decode()
    if "inference protocol at http://" not in line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"lanes serve did not start: {line!r}\n"
                           + Path(log_path).read_text(errors="replace"))
    url = line.split("inference protocol at http://")[1].split()[0].removesuffix(",")
    return proc, line, url.removesuffix("/v2")


def stop_service(proc):
    """Terminates a service child (killed after 20 s)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def endpoint(tmp_path_factory):
    sock = tmp_path_factory.mktemp("lanes") / "serve.sock"
    proc, ep = start_service(sock, ["--workers", "2", *device_args()], sock.with_name("serve.log"))
    yield ep
    stop_service(proc)


@pytest.fixture
def client(endpoint):
    with lanes.Client(endpoint) as c:
        yield c
