"""The Open Inference Protocol front end (`lanes serve --http --grpc`)
driven by Triton's own Python clients, `tritonclient.http` and
`tritonclient.grpc`, unchanged: metadata, infer with JSON and binary
tensors (and over gRPC) compared with PyTorch's outputs and with the same
model run through a Lanes session, the model repository, statistics,
dynamic batching, and errors."""

import base64
import json
import shutil
import urllib.error
import urllib.request

import numpy as np
import pytest

from conftest import DATA, device_args, start_http_service, stop_service

import lanes

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

ONNX = DATA / "onnx"

# The service's --http-max-body: small, so that a model file over it is
# cheap to send.
MAX_BODY = 2 << 20


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
         "--model-repository", str(repo), "--http-max-body", f"{MAX_BODY}B", *device_args()],
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
    # Off unless --system-shared-memory (test_oip_shm.py), and refused.
    assert "system_shared_memory" not in meta["extensions"]
    with pytest.raises(InferenceServerException, match="--system-shared-memory"):
        triton.register_system_shared_memory("r", "/lanes_test_off", 16)
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


def test_grpc_model_config_is_the_http_one(triton_grpc, triton):
    grpcclient, c = triton_grpc
    assert "model_configuration" in c.get_server_metadata().extensions
    for name in ["resnet18", "batched", "conv"]:
        want = triton.get_model_config(name)
        got = c.get_model_config(name).config
        assert (got.name, got.platform, got.backend, got.max_batch_size) == (
            want["name"], want["platform"], want["backend"], want["max_batch_size"])
        assert got.version_policy.latest.num_versions == 1
        for mine, theirs in [(got.input, want["input"]), (got.output, want["output"])]:
            assert [(t.name, grpcclient.model_config_pb2.DataType.Name(t.data_type), list(t.dims))
                    for t in mine] == [(t["name"], t["data_type"], t["dims"]) for t in theirs]
        group = got.instance_group[0]
        assert (group.name, group.count) == (name, 1)
        assert grpcclient.model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind) == "KIND_MODEL"
        if "dynamic_batching" in want:
            b = want["dynamic_batching"]
            assert got.dynamic_batching.max_queue_delay_microseconds == b[
                "max_queue_delay_microseconds"]
            assert list(got.dynamic_batching.preferred_batch_size) == b["preferred_batch_size"]
        else:
            assert not got.HasField("dynamic_batching")
    assert c.get_model_config("batched").config.dynamic_batching.max_queue_delay_microseconds \
        == 5000000
    # as_json, the form tritonclient's tools read.
    j = c.get_model_config("resnet18", as_json=True)["config"]
    assert j["input"][0]["data_type"] == "TYPE_FP32" and j["max_batch_size"] == 4
    with pytest.raises(InferenceServerException, match="unknown model"):
        c.get_model_config("absent")
    with pytest.raises(InferenceServerException, match="StatusCode.NOT_FOUND"):
        c.get_model_config("absent")


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


def test_grpc_repository_index_load_and_unload(triton_grpc, triton):
    grpcclient, c = triton_grpc
    index = {m["name"]: m for m in c.get_model_repository_index(as_json=True)["models"]}
    assert index["conv"]["state"] == "READY" and index["conv"]["version"] == "1"
    assert index["garbage"]["state"] == "UNAVAILABLE"
    assert "does not import" in index["garbage"]["reason"]
    # The same index as over HTTP.
    assert {n: m["state"] for n, m in index.items()} == {
        m["name"]: m["state"] for m in triton.get_model_repository_index()}
    # `ready`: the loaded models only (tritonclient has no argument for it).
    from tritonclient.grpc import service_pb2
    ready = c._client_stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True))
    assert "garbage" not in {m.name for m in ready.models}
    assert {"conv", "resnet18"} <= {m.name for m in ready.models}

    c.unload_model("conv", unload_dependents=True)
    assert not c.is_model_ready("conv") and not triton.is_model_ready("conv")
    index = {m.name: m for m in c.get_model_repository_index().models}
    assert (index["conv"].state, index["conv"].reason) == ("UNAVAILABLE", "unloaded")
    c.load_model("conv")
    assert c.is_model_ready("conv") and triton.is_model_ready("conv")
    x = np.random.default_rng(1).standard_normal((2, 4, 9, 9)).astype(np.float32)
    i = grpcclient.InferInput("x", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    np.testing.assert_array_equal(c.infer("conv", [i]).as_numpy("y"),
                                  infer(triton, "conv", x, True, name="x", out="y"))


def test_grpc_repository_errors(triton_grpc):
    _, c = triton_grpc
    from tritonclient.grpc import service_pb2
    with pytest.raises(InferenceServerException, match="no model `absent` in the repository") as e:
        c.load_model("absent")
    assert "NOT_FOUND" in e.value.status()
    with pytest.raises(InferenceServerException, match="does not import") as e:
        c.load_model("garbage")
    assert "INVALID_ARGUMENT" in e.value.status()
    with pytest.raises(InferenceServerException, match="unknown model `absent`") as e:
        c.unload_model("absent")
    assert "NOT_FOUND" in e.value.status()
    # A parameter with none of the protocol's kinds set.
    req = service_pb2.RepositoryModelLoadRequest(model_name="conv")
    req.parameters["empty"].CopyFrom(service_pb2.ModelRepositoryParameter())
    import grpc
    with pytest.raises(grpc.RpcError) as e:
        c._client_stub.RepositoryModelLoad(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parameter `empty` has no value" in e.value.details()
    assert c.is_model_ready("conv")


def post(served, path, body):
    """(status, body or error message) of a POST to /v2/repository/PATH."""
    req = urllib.request.Request(f"http://{served[0]}/v2/repository/{path}",
                                 data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["error"]


def test_http_repository_parameters_are_checked(served):
    def post_(path, body):
        return post(served, path, body)

    assert post_("models/conv/load", {"parameters": [1]}) == (
        400, "`parameters` must be an object")
    assert post_("models/conv/load", {"parameters": {"x": {"y": 1}}}) == (
        400, "parameter `x` must be a string, a boolean or an integer")
    assert post_("models/conv/unload", {"parameters": {"unload_dependents": 1.5}}) == (
        400, "parameter `unload_dependents`: 1.5 is not an integer")
    assert post_("index", {"ready": "yes"}) == (400, "`ready` must be a boolean")


def conv_x(rows=2):
    return np.random.default_rng(2).standard_normal((rows, 4, 9, 9)).astype(np.float32)


def test_a_model_file_sent_in_the_load_request(triton, triton_grpc):
    grpcclient, c = triton_grpc
    conv = (ONNX / "ops_conv.onnx").read_bytes()
    want = infer(triton, "conv", conv_x(), True, name="x", out="y")
    # Over HTTP: a name the repository does not have.
    triton.load_model("sent", config=json.dumps({"max_batch_size": 4}),
                      files={"file:1/model.onnx": conv})
    assert triton.is_model_ready("sent") and c.is_model_ready("sent")
    assert triton.get_model_config("sent")["max_batch_size"] == 4
    assert triton.get_model_metadata("sent")["versions"] == ["1"]
    np.testing.assert_array_equal(infer(triton, "sent", conv_x(), True, name="x", out="y"), want)
    index = {m["name"]: m for m in triton.get_model_repository_index()}
    assert (index["sent"]["state"], index["sent"]["version"]) == ("READY", "1")
    # Over gRPC: a reload at another version, with dynamic batching.
    config = {"max_batch_size": 2,
              "dynamic_batching": {"max_queue_delay_microseconds": "100",
                                   "preferred_batch_size": [2]}}
    c.load_model("sent", config=json.dumps(config), files={"file:7/model.onnx": conv})
    cfg = triton.get_model_config("sent")
    assert cfg["max_batch_size"] == 2
    assert cfg["dynamic_batching"] == {"max_queue_delay_microseconds": 100,
                                       "preferred_batch_size": [2]}
    i = grpcclient.InferInput("x", [2, 4, 9, 9], "FP32")
    i.set_data_from_numpy(conv_x())
    r = c.infer("sent", [i])
    assert r.get_response().model_version == "7"
    np.testing.assert_array_equal(r.as_numpy("y"), want)
    # A model of the repository replaced from a request, then loaded from
    # the repository again by a load without files.
    resnet = (ONNX / "resnet18.onnx").read_bytes()
    triton.load_model("conv", config="{}", files={"file:3/model.onnx": resnet})
    assert triton.get_model_metadata("conv")["inputs"][0]["name"] == "input"
    assert triton.get_model_metadata("conv")["versions"] == ["3"]
    c.load_model("conv")
    m = triton.get_model_metadata("conv")
    assert (m["inputs"][0]["name"], m["versions"]) == ("x", ["1"])
    # A configuration alone overrides the repository's config.pbtxt.
    triton.load_model("resnet18", config=json.dumps({"max_batch_size": 2}))
    assert triton.get_model_config("resnet18")["max_batch_size"] == 2
    triton.load_model("resnet18")
    assert triton.get_model_config("resnet18")["max_batch_size"] == 4
    triton.unload_model("sent")
    assert not triton.is_model_ready("sent")


def test_bad_model_files_are_refused(triton, triton_grpc, served):
    _, c = triton_grpc
    conv = (ONNX / "ops_conv.onnx").read_bytes()
    cfg = "{}"
    for load in (triton.load_model, c.load_model):
        # Not ONNX: the importer's message; the model loaded before stays.
        with pytest.raises(InferenceServerException, match="does not import") as e:
            load("conv", config=cfg, files={"file:1/model.onnx": b"not a model"})
        if load == c.load_model:
            assert "INVALID_ARGUMENT" in e.value.status()
        assert triton.is_model_ready("conv")
        with pytest.raises(InferenceServerException, match="needs the `config` parameter"):
            load("conv", files={"file:1/model.onnx": conv})
        with pytest.raises(InferenceServerException, match="only `file:VERSION/model.onnx`"):
            load("conv", config=cfg, files={"file:1/model.pt2": conv})
        with pytest.raises(InferenceServerException, match="one model file per load"):
            load("conv", config=cfg, files={"file:1/model.onnx": conv, "file:2/model.onnx": conv})
        with pytest.raises(InferenceServerException, match="parameter `config`: not JSON"):
            load("conv", config="max_batch_size: 2", files={"file:1/model.onnx": conv})
        with pytest.raises(InferenceServerException, match="max_batch_size: `-2`"):
            load("conv", config='{"max_batch_size": -2}')
        with pytest.raises(InferenceServerException, match="cannot name a model"):
            load(".hidden", config=cfg, files={"file:1/model.onnx": conv})
        # A made-up name whose file fails is not kept in the index.
        with pytest.raises(InferenceServerException, match="does not import"):
            load("made_up", config=cfg, files={"file:1/model.onnx": b"\x00" * 10})
        assert "made_up" not in {m["name"] for m in triton.get_model_repository_index()}
    assert triton.is_model_ready("conv")
    # Over the size limit: 413 over HTTP, RESOURCE_EXHAUSTED over gRPC.
    big = b"\x00" * (MAX_BODY + 1)
    with pytest.raises(InferenceServerException, match="exceeds") as e:
        triton.load_model("big", config=cfg, files={"file:1/model.onnx": big})
    assert e.value.status() == "413"
    with pytest.raises(InferenceServerException, match="exceeds") as e:
        c.load_model("big", config=cfg, files={"file:1/model.onnx": big})
    assert "RESOURCE_EXHAUSTED" in e.value.status()
    # Not base64 (tritonclient always encodes it).
    status, err = post(served, "models/conv/load",
                       {"parameters": {"config": "{}", "file:1/model.onnx": "%%%"}})
    assert (status, "is not base64" in err) == (400, True), err
    status, err = post(served, "models/conv/load",
                       {"parameters": {"config": "{}", "file:1/model.onnx": True}})
    assert (status, "must be the file's bytes" in err) == (400, True), err
    status, _ = post(served, "models/sent2/load",
                     {"parameters": {"config": "{}",
                                     "file:1/model.onnx": base64.b64encode(conv).decode()}})
    assert status == 200 and triton.is_model_ready("sent2")
    triton.unload_model("sent2")


W = (np.arange(12, dtype=np.float32).reshape(4, 3) / 8 - 0.5).astype(np.float32)
B = np.array([0.25, -0.5, 1.0], np.float32)


def half_model(elem):
    """y = x @ W + B with x and y declared `elem` (float16 or bfloat16),
    computed in float32 between two Casts, as a model exported in half
    is at its edges."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper
    nodes = [
        helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["xf", "w"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["yf"]),
        helper.make_node("Cast", ["yf"], ["y"], to=elem),
    ]
    g = helper.make_graph(
        nodes, "half", [helper.make_tensor_value_info("x", elem, ["N", 4])],
        [helper.make_tensor_value_info("y", elem, ["N", 3])],
        [numpy_helper.from_array(W, "w"), numpy_helper.from_array(B, "b")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m)
    return m.SerializeToString()


@pytest.mark.parametrize("dt", ["FP16", "BF16"])
def test_half_tensors_on_the_wire(triton, triton_grpc, dt):
    grpcclient, c = triton_grpc
    ml_dtypes = pytest.importorskip("ml_dtypes")
    pytest.importorskip("onnx")
    from onnx import TensorProto
    elem, np_dt, rtol = {
        "FP16": (TensorProto.FLOAT16, np.float16, 1e-3),
        "BF16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16, 1e-2),
    }[dt]
    name = f"half_{dt.lower()}"
    triton.load_model(name, config="{}", files={"file:1/model.onnx": half_model(elem)})
    m = triton.get_model_metadata(name)
    assert m["inputs"] == [{"name": "x", "datatype": dt, "shape": [-1, 4]}]
    assert m["outputs"] == [{"name": "y", "datatype": dt, "shape": [-1, 3]}]
    assert triton.get_model_config(name)["input"][0]["data_type"] == f"TYPE_{dt}"
    x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32).astype(np_dt)
    want = (x.astype(np.float32) @ W + B).astype(np_dt).astype(np.float32)
    # tritonclient sends BF16 only as binary data over HTTP.
    got = []
    for binary in [True, False] if dt == "FP16" else [True]:
        i = httpclient.InferInput("x", [3, 4], dt)
        i.set_data_from_numpy(x, binary_data=binary)
        o = httpclient.InferRequestedOutput("y", binary_data=binary)
        y = triton.infer(name, [i], outputs=[o]).as_numpy("y")
        assert y.dtype == np_dt and y.shape == (3, 3)
        np.testing.assert_allclose(y.astype(np.float32), want, rtol=rtol, atol=rtol)
        got.append(y)
    i = grpcclient.InferInput("x", [3, 4], dt)
    i.set_data_from_numpy(x)
    y = c.infer(name, [i]).as_numpy("y")
    assert y.dtype == np_dt
    # Every door gives the very same values.
    for other in got:
        np.testing.assert_array_equal(y.astype(np.float32), other.astype(np.float32))
    # The model's datatype, and no other.
    i = httpclient.InferInput("x", [3, 4], "FP32")
    i.set_data_from_numpy(x.astype(np.float32))
    with pytest.raises(InferenceServerException, match=f"datatype FP32 does not match the model's {dt}"):
        triton.infer(name, [i])
    i = httpclient.InferInput("x", [3, 4], dt)
    i.set_data_from_numpy(x, binary_data=True)
    # One element short: 2 bytes each.
    i._raw_data = i._raw_data[:-2]
    i._parameters["binary_data_size"] = len(i._raw_data)
    with pytest.raises(InferenceServerException, match="binary_data_size 22"):
        triton.infer(name, [i])
    triton.unload_model(name)


@pytest.mark.parametrize("request_coding", [None, "gzip", "deflate"])
@pytest.mark.parametrize("response_coding", [None, "gzip", "deflate"])
def test_compressed_bodies(triton, request_coding, response_coding):
    x = np.load(ONNX / "resnet18.input.npy")
    want = np.load(ONNX / "resnet18.output.npy")
    for binary in (False, True):
        i = httpclient.InferInput("input", list(x.shape), "FP32")
        i.set_data_from_numpy(x, binary_data=binary)
        o = httpclient.InferRequestedOutput("output", binary_data=binary)
        got = triton.infer("resnet18", [i], outputs=[o],
                           request_compression_algorithm=request_coding,
                           response_compression_algorithm=response_coding).as_numpy("output")
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_compressed_bodies_are_bounded_and_checked(served):
    import gzip
    import zlib

    def infer_raw(body, encoding, accept=None):
        headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
        if accept:
            headers["Accept-Encoding"] = accept
        req = urllib.request.Request(f"http://{served[0]}/v2/models/conv/infer", data=body,
                                     headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, r.headers.get("Content-Encoding"), r.read()
        except urllib.error.HTTPError as e:
            return e.code, None, json.loads(e.read())["error"]

    x = np.zeros((1, 4, 9, 9), np.float32)
    request = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                      "data": x.flatten().tolist()}]}).encode()
    status, coding, body = infer_raw(zlib.compress(request), "deflate", accept="gzip;q=0, deflate")
    assert (status, coding) == (200, "deflate")
    assert json.loads(zlib.decompress(body))["outputs"][0]["shape"] == [1, 6]
    # A bomb: a small body that inflates past --http-max-body.
    bomb = gzip.compress(b" " * (MAX_BODY + 1))
    assert len(bomb) < MAX_BODY // 100
    status, _, err = infer_raw(bomb, "gzip")
    assert status == 413 and "inflates to more than" in err, err
    status, _, err = infer_raw(b"not gzip", "gzip")
    assert status == 400 and "not valid gzip data" in err, err
    status, _, err = infer_raw(request, "br")
    assert status == 400 and "is not supported" in err, err


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
def test_grpc_compressed_requests(triton_grpc, coding):
    grpcclient, c = triton_grpc
    x = np.load(ONNX / "resnet18.input.npy")
    want = np.load(ONNX / "resnet18.output.npy")
    i = grpcclient.InferInput("input", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    got = c.infer("resnet18", [i], compression_algorithm=coding).as_numpy("output")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # A message that inflates past --http-max-body is refused.
    big = np.zeros((MAX_BODY // (3 * 32 * 32 * 4) + 1, 3, 32, 32), np.float32)
    i = grpcclient.InferInput("input", list(big.shape), "FP32")
    i.set_data_from_numpy(big)
    with pytest.raises(InferenceServerException) as e:
        c.infer("resnet18", [i], compression_algorithm=coding)
    assert "RESOURCE_EXHAUSTED" in e.value.status()
    assert "size limit, of 2097152 bytes, exceeded" in e.value.message()
