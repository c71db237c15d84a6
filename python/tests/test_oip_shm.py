"""Triton's system shared memory extension (`lanes serve
--system-shared-memory`), driven by tritonclient unchanged: regions made
with `tritonclient.utils.shared_memory`, registered over HTTP and gRPC,
inputs read from them and outputs written into them giving the same
values as binary tensors, the status, and each error a client can make."""

import os
import shutil
import uuid

import numpy as np
import pytest

from conftest import DATA, device_args, start_http_service, stop_service

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
shm = pytest.importorskip("tritonclient.utils.shared_memory")
from tritonclient.utils import InferenceServerException  # noqa: E402

ONNX = DATA / "onnx"

X = np.load(ONNX / "resnet18.input.npy")
IN_BYTES = X.nbytes
# resnet18 of this repository: 10 classes.
OUT_BYTES = X.shape[0] * 10 * 4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(HTTP address, gRPC address) of a service with the extension on."""
    root = tmp_path_factory.mktemp("oip-shm")
    repo = root / "models"
    (repo / "resnet18" / "1").mkdir(parents=True)
    shutil.copy(ONNX / "resnet18.onnx", repo / "resnet18" / "1" / "model.onnx")
    (repo / "resnet18" / "config.pbtxt").write_text("max_batch_size: 4\n")
    proc, line, url = start_http_service(
        f"ipc://{root / 'serve.sock'}",
        ["--workers", "2", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0",
         "--model-repository", str(repo), "--system-shared-memory", *device_args()],
        root / "serve.log",
    )
    grpc_url = line.split("gRPC inference protocol at ")[1].split()[0]
    yield url, grpc_url
    stop_service(proc)


@pytest.fixture
def clients(served):
    h = httpclient.InferenceServerClient(url=served[0])
    g = grpcclient.InferenceServerClient(url=served[1])
    h.unregister_system_shared_memory()
    yield h, g
    h.unregister_system_shared_memory()
    h.close()
    g.close()


@pytest.fixture
def regions():
    """Makes POSIX shared memory objects (name, key, bytes); destroys them."""
    made = []

    def make(byte_size):
        tag = uuid.uuid4().hex[:12]
        name, key = f"r{tag}", f"/lanes_test_{tag}"
        made.append(shm.create_shared_memory_region(name, key, byte_size))
        return made[-1], name, key

    yield make
    for h in made:
        shm.destroy_shared_memory_region(h)


def binary_reference(h):
    i = httpclient.InferInput("input", list(X.shape), "FP32")
    i.set_data_from_numpy(X, binary_data=True)
    o = httpclient.InferRequestedOutput("output", binary_data=True)
    return h.infer("resnet18", [i], outputs=[o]).as_numpy("output")


def shm_infer(mod, client, in_name, out_name, in_offset=0, out_offset=0):
    i = mod.InferInput("input", list(X.shape), "FP32")
    i.set_shared_memory(in_name, IN_BYTES, offset=in_offset)
    o = mod.InferRequestedOutput("output")
    o.set_shared_memory(out_name, OUT_BYTES, offset=out_offset)
    return client.infer("resnet18", [i], outputs=[o])


def test_metadata_lists_the_extension(clients):
    h, g = clients
    assert "system_shared_memory" in h.get_server_metadata()["extensions"]
    assert "system_shared_memory" in g.get_server_metadata().extensions


@pytest.mark.parametrize("door", ["http", "grpc"])
def test_inputs_and_outputs_in_shared_memory_match_binary(clients, regions, door):
    h, g = clients
    want = binary_reference(h)
    inp, in_name, in_key = regions(IN_BYTES + 64)
    out, out_name, out_key = regions(OUT_BYTES + 32)
    shm.set_shared_memory_region(inp, [X], offset=64)
    client, mod = (h, httpclient) if door == "http" else (g, grpcclient)
    # Registered through the other door: one table serves both.
    other = g if door == "http" else h
    other.register_system_shared_memory(in_name, in_key, IN_BYTES + 64)
    client.register_system_shared_memory(out_name, out_key, OUT_BYTES, offset=32)
    r = shm_infer(mod, client, in_name, out_name, in_offset=64)
    out_meta = r.get_output("output")
    params = out_meta["parameters"] if door == "http" else out_meta.parameters
    if door == "http":
        assert "data" not in out_meta and "binary_data_size" not in params
        assert params["shared_memory_byte_size"] == OUT_BYTES
        shape = out_meta["shape"]
    else:
        assert params["shared_memory_byte_size"].int64_param == OUT_BYTES
        assert len(r.get_response().raw_output_contents) == 0
        shape = list(out_meta.shape)
    assert shape == list(want.shape)
    got = shm.get_contents_as_numpy(out, np.float32, shape, offset=32)
    np.testing.assert_array_equal(got, want)
    # The region's bytes before the registered part are untouched.
    assert not shm.get_contents_as_numpy(out, np.uint8, [32]).any()


def test_an_input_in_shared_memory_with_a_binary_output(clients, regions):
    h, _ = clients
    want = binary_reference(h)
    inp, name, key = regions(IN_BYTES)
    shm.set_shared_memory_region(inp, [X])
    h.register_system_shared_memory(name, key, IN_BYTES)
    i = httpclient.InferInput("input", list(X.shape), "FP32")
    i.set_shared_memory(name, IN_BYTES)
    o = httpclient.InferRequestedOutput("output", binary_data=True)
    np.testing.assert_array_equal(
        h.infer("resnet18", [i], outputs=[o]).as_numpy("output"), want)


def test_status_lists_regions_and_unregister_removes_them(clients, regions):
    h, g = clients
    _, a, a_key = regions(4096)
    _, b, b_key = regions(4096)
    h.register_system_shared_memory(a, a_key, 1024, offset=512)
    g.register_system_shared_memory(b, b_key, 4096)
    status = {r["name"]: r for r in h.get_system_shared_memory_status()}
    assert status[a] == {"name": a, "key": a_key, "offset": 512, "byte_size": 1024}
    assert set(status) == {a, b}
    one = g.get_system_shared_memory_status(b).regions
    assert list(one) == [b] and one[b].key == b_key and one[b].byte_size == 4096
    h.unregister_system_shared_memory(a)
    assert [r["name"] for r in h.get_system_shared_memory_status()] == [b]
    with pytest.raises(InferenceServerException, match="no shared memory region"):
        h.get_system_shared_memory_status(a)
    g.unregister_system_shared_memory()
    assert h.get_system_shared_memory_status() == []
    assert len(g.get_system_shared_memory_status().regions) == 0


@pytest.mark.parametrize("door", ["http", "grpc"])
def test_registration_errors(clients, regions, door):
    h, g = clients
    c = h if door == "http" else g
    _, name, key = regions(1024)
    with pytest.raises(InferenceServerException, match="cannot open"):
        c.register_system_shared_memory(name, "/lanes_test_absent_" + name, 16)
    with pytest.raises(InferenceServerException, match="not the name"):
        c.register_system_shared_memory(name, "/etc/passwd", 16)
    with pytest.raises(InferenceServerException, match="fewer than offset"):
        c.register_system_shared_memory(name, key, 2048)
    with pytest.raises(InferenceServerException, match="fewer than offset 1000"):
        c.register_system_shared_memory(name, key, 100, offset=1000)
    c.register_system_shared_memory(name, key, 1024)
    with pytest.raises(InferenceServerException, match="registered already"):
        c.register_system_shared_memory(name, key, 16)
    assert not os.path.exists("/dev/shm/lanes_test_absent_" + name)


@pytest.mark.parametrize("door", ["http", "grpc"])
def test_infer_errors(clients, regions, door):
    h, g = clients
    client, mod = (h, httpclient) if door == "http" else (g, grpcclient)
    inp, in_name, in_key = regions(IN_BYTES)
    _, out_name, out_key = regions(OUT_BYTES)
    shm.set_shared_memory_region(inp, [X])
    h.register_system_shared_memory(in_name, in_key, IN_BYTES)
    h.register_system_shared_memory(out_name, out_key, OUT_BYTES)
    with pytest.raises(InferenceServerException, match="no shared memory region `absent`"):
        shm_infer(mod, client, "absent", out_name)
    with pytest.raises(InferenceServerException, match="pass the end of region"):
        shm_infer(mod, client, in_name, out_name, in_offset=4)
    with pytest.raises(InferenceServerException, match="pass the end of region"):
        shm_infer(mod, client, in_name, out_name, out_offset=OUT_BYTES)
    # Too small for the input: its shape takes IN_BYTES.
    i = mod.InferInput("input", list(X.shape), "FP32")
    i.set_shared_memory(in_name, IN_BYTES - 4)
    with pytest.raises(InferenceServerException, match="take"):
        client.infer("resnet18", [i])
    # Too small for the output: registered for fewer bytes than it has.
    i = mod.InferInput("input", list(X.shape), "FP32")
    i.set_shared_memory(in_name, IN_BYTES)
    o = mod.InferRequestedOutput("output")
    o.set_shared_memory(out_name, OUT_BYTES - 4)
    with pytest.raises(InferenceServerException, match="do not fit"):
        client.infer("resnet18", [i], outputs=[o])
    h.unregister_system_shared_memory(in_name)
    with pytest.raises(InferenceServerException, match=f"no shared memory region `{in_name}`"):
        shm_infer(mod, client, in_name, out_name)
    # The server still answers.
    np.testing.assert_array_equal(binary_reference(h).shape, (X.shape[0], 10))
