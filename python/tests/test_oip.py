"""The Open Inference Protocol front end (`lanes serve --http --grpc`)
driven by Triton's own Python clients, `tritonclient.http` and
`tritonclient.grpc`, unchanged: metadata, infer with JSON and binary
tensors (and over gRPC) compared with PyTorch's outputs and with the same
model run through a Lanes session, the model repository, statistics,
dynamic batching, and errors."""

import shutil

import numpy as np
import pytest

from conftest import DATA, device_args, start_http_service, stop_service

import lanes

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

ONNX = DATA / "onnx"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(HTTP address, ZeroMQ endpoint, gRPC address) of a service with a
    repository."""
    root = tmp_path_factory.mktemp("oip")
    repo = root / "models"
    for name, src, config in [
        ("resnet18", "resnet18.onnx", "max_batch_size: 4\n"),
        (
            "batched",
            "resnet18.onnx",
            "max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 5000000 }\n",
        ),
        ("conv", "ops_conv.onnx", None),
    ]:
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(ONNX / src, repo / name / "1" / "model.onnx")
        if config:
            (repo / name / "config.pbtxt").write_text(config)
    (repo / "garbage" / "1").mkdir(parents=True)
    (repo / "garbage" / "1" / "model.onnx").write_bytes(b"not a model")
    endpoint = f"ipc://{root / 'serve.sock'}"
    proc, line, url = start_http_service(
        endpoint,
        ["--workers", "2", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0",
         "--model-repository", str(repo), *device_args()],
        root / "serve.log",
    )
    grpc_url = line.split("gRPC inference protocol at ")[1].split()[0]
    yield url, endpoint, grpc_url
    stop_service(proc)


@pytest.fixture
def triton(served):
    c = httpclient.InferenceServerClient(url=served[0], concurrency=8)
    yield c
    c.close()


@pytest.fixture
def triton_grpc(served):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    c = grpcclient.InferenceServerClient(url=served[2])
    yield grpcclient, c
    c.close()


def reference(endpoint, x):
    """resnet18 at x's batch through an ordinary Lanes session."""
    with lanes.Client(endpoint) as c, c.session("oip-reference") as s:
        s.load_onnx(ONNX / "resnet18.onnx", batch=x.shape[0])
        return s.run({"input": x}, fetch="output")


def infer(triton, model, x, binary, name="input", out="output"):
    i = httpclient.InferInput(name, list(x.shape), "FP32")
    i.set_data_from_numpy(x, binary_data=binary)
    o = httpclient.InferRequestedOutput(out, binary_data=binary)
    return triton.infer(model, [i], outputs=[o]).as_numpy(out)


def test_metadata_and_config(triton):
    assert triton.is_server_live()
    assert triton.is_server_ready()
    assert triton.is_model_ready("resnet18")
    assert not triton.is_model_ready("garbage")
    meta = triton.get_server_metadata()
    assert "binary_tensor_data" in meta["extensions"]
    m = triton.get_model_metadata("resnet18")
    assert m["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 32, 32]}]
    assert m["outputs"][0]["shape"] == [-1, 10]
    c = triton.get_model_config("resnet18")
    assert c["max_batch_size"] == 4
    assert c["input"][0]["dims"] == [3, 32, 32]


@pytest.mark.parametrize("binary", [False, True])
def test_infer_matches_pytorch_and_a_lanes_session(triton, served, binary):
    x = np.load(ONNX / "resnet18.input.npy")
    want = np.load(ONNX / "resnet18.output.npy")
    got = infer(triton, "resnet18", x, binary)
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(got, reference(served[1], x))


def test_errors_are_exceptions_with_messages(triton):
    x = np.zeros((1, 3, 32, 32), np.float32)
    with pytest.raises(InferenceServerException, match="unknown model"):
        infer(triton, "absent", x, True)
    with pytest.raises(InferenceServerException, match="does not match"):
        infer(triton, "resnet18", np.zeros((1, 3, 16, 16), np.float32), True)
    with pytest.raises(InferenceServerException, match="max_batch_size"):
        infer(triton, "resnet18", np.zeros((5, 3, 32, 32), np.float32), False)
    i = httpclient.InferInput("input", [1, 3, 32, 32], "INT64")
    i.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.int64))
    with pytest.raises(InferenceServerException, match="datatype INT64"):
        triton.infer("resnet18", [i])
    with pytest.raises(InferenceServerException, match="unknown input"):
        infer(triton, "resnet18", x, True, name="image")
    with pytest.raises(InferenceServerException, match="does not import"):
        triton.load_model("garbage")


def test_repository_load_unload_and_statistics(triton):
    index = {m["name"]: m for m in triton.get_model_repository_index()}
    assert index["conv"]["state"] == "READY"
    assert index["garbage"]["state"] == "UNAVAILABLE"
    triton.unload_model("conv")
    assert not triton.is_model_ready("conv")
    triton.load_model("conv")
    assert triton.is_model_ready("conv")
    x = np.random.default_rng(0).standard_normal((3, 4, 9, 9)).astype(np.float32)
    y = infer(triton, "conv", x, True, name="x", out="y")
    assert y.shape == (3, 6)
    # Each row is the same whatever the batch it is run in.
    np.testing.assert_allclose(infer(triton, "conv", x[1:2], False, name="x", out="y"), y[1:2],
                               rtol=1e-5, atol=1e-6)
    stats = triton.get_inference_statistics("conv")["model_stats"][0]
    assert stats["inference_count"] == 4
    assert stats["execution_count"] == 2


def test_dynamic_batching_gathers_concurrent_requests(triton):
    x = np.load(ONNX / "resnet18.input.npy")
    want = np.load(ONNX / "resnet18.output.npy")
    before = triton.get_inference_statistics("batched")["model_stats"][0]
    # Eight one-row requests in flight at once: the model's thread waits up
    # to 5 s after the first for more and runs as soon as it has 8 rows
    # (max_batch_size), so they share Runs.
    n = 8
    pending = []
    for k in range(n):
        i = httpclient.InferInput("input", [1, 3, 32, 32], "FP32")
        i.set_data_from_numpy(x[k % 2:k % 2 + 1], binary_data=k % 2 == 0)
        o = httpclient.InferRequestedOutput("output", binary_data=k % 3 == 0)
        pending.append(triton.async_infer("batched", [i], outputs=[o]))
    for k, p in enumerate(pending):
        got = p.get_result().as_numpy("output")
        np.testing.assert_allclose(got, want[k % 2:k % 2 + 1], rtol=1e-4, atol=1e-5)
    after = triton.get_inference_statistics("batched")["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == n
    runs = after["execution_count"] - before["execution_count"]
    assert runs < n, f"{n} concurrent requests took {runs} Runs"
    assert max(b["batch_size"] for b in after["batch_stats"]) > 1


def test_grpc_health_and_metadata(triton_grpc):
    _, c = triton_grpc
    assert c.is_server_live()
    assert c.is_server_ready()
    assert c.is_model_ready("resnet18")
    assert not c.is_model_ready("garbage")
    assert not c.is_model_ready("absent")
    assert "statistics" in c.get_server_metadata().extensions
    m = c.get_model_metadata("resnet18")
    assert m.platform == "lanes_onnx"
    assert [(t.name, t.datatype, list(t.shape)) for t in m.inputs] == [
        ("input", "FP32", [-1, 3, 32, 32])]
    assert list(m.outputs[0].shape) == [-1, 10]


def test_grpc_infer_matches_http_pytorch_and_statistics(triton_grpc, triton, served):
    grpcclient, c = triton_grpc
    x = np.load(ONNX / "resnet18.input.npy")
    want = np.load(ONNX / "resnet18.output.npy")
    before = c.get_inference_statistics("resnet18", as_json=True)["model_stats"][0]
    i = grpcclient.InferInput("input", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    r = c.infer("resnet18", [i], request_id="g-1",
                outputs=[grpcclient.InferRequestedOutput("output")])
    assert r.get_response().id == "g-1"
    got = r.as_numpy("output")
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # The same model and session as over HTTP, and as a Lanes session.
    np.testing.assert_array_equal(got, infer(triton, "resnet18", x, True))
    np.testing.assert_array_equal(got, reference(served[1], x))
    after = c.get_inference_statistics("resnet18", as_json=True)["model_stats"][0]
    # as_json renders uint64 as strings.
    assert int(after["inference_count"]) - int(before.get("inference_count", 0)) == 4


def test_grpc_errors_are_exceptions_with_messages(triton_grpc):
    grpcclient, c = triton_grpc

    def infer_grpc(model, x, dtype="FP32", name="input"):
        i = grpcclient.InferInput(name, list(x.shape), dtype)
        i.set_data_from_numpy(x)
        return c.infer(model, [i])

    x = np.zeros((1, 3, 32, 32), np.float32)
    with pytest.raises(InferenceServerException, match="unknown model") as e:
        infer_grpc("absent", x)
    assert "NOT_FOUND" in e.value.status()
    with pytest.raises(InferenceServerException, match="does not match") as e:
        infer_grpc("resnet18", np.zeros((1, 3, 16, 16), np.float32))
    assert "INVALID_ARGUMENT" in e.value.status()
    with pytest.raises(InferenceServerException, match="datatype INT64"):
        infer_grpc("resnet18", np.zeros((1, 3, 32, 32), np.int64), dtype="INT64")
    with pytest.raises(InferenceServerException, match="max_batch_size"):
        infer_grpc("resnet18", np.zeros((5, 3, 32, 32), np.float32))
    with pytest.raises(InferenceServerException, match="not available"):
        infer_grpc("garbage", x)
