//! The Open Inference Protocol over gRPC against a real `lanes serve
//! --grpc … --model-repository …` child process, through a client made
//! from the same `.proto`: health, metadata, infer with raw and typed
//! tensors compared with PyTorch's outputs and with the REST answer,
//! statistics, and each error case as its gRPC status.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use lanes::oip::grpc::proto::grpc_inference_service_client::GrpcInferenceServiceClient;
use lanes::oip::grpc::proto::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
use lanes::oip::grpc::proto::*;
use tonic::transport::Channel;
use tonic::Code;
use util::oip::{close, npy, repo, Repo};
use util::serve::Serve;

type Client = GrpcInferenceServiceClient<Channel>;

/// A service with `--grpc` (and whatever `extra` adds), a client for it
/// and a runtime to drive the client on.
struct Grpc {
    serve: Serve,
    rt: tokio::runtime::Runtime,
    client: Client,
}

fn after<'a>(line: &'a str, marker: &str) -> Option<&'a str> {
    line.split(marker)
        .nth(1)
        .and_then(|r| r.split([' ', ',', '\n']).next())
}

fn start(repo: &Repo, extra: &[&str]) -> Grpc {
    let dir = repo.0.to_str().unwrap();
    let mut args = vec!["--grpc", "127.0.0.1:0", "--model-repository", dir];
    args.extend_from_slice(extra);
    let serve = Serve::start(&args);
    let addr = after(&serve.line, "gRPC inference protocol at ")
        .unwrap_or_else(|| panic!("no gRPC address in {:?}", serve.line))
        .to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let channel = rt
        .block_on(
            tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                .unwrap()
                .connect(),
        )
        .unwrap();
    let client = GrpcInferenceServiceClient::new(channel).max_decoding_message_size(64 << 20);
    Grpc { serve, rt, client }
}

impl Grpc {
    fn infer(&self, req: ModelInferRequest) -> Result<ModelInferResponse, tonic::Status> {
        let mut c = self.client.clone();
        self.rt
            .block_on(c.model_infer(req))
            .map(tonic::Response::into_inner)
    }
    fn stats(&self, name: &str) -> ModelStatisticsResponse {
        let mut c = self.client.clone();
        let req = ModelStatisticsRequest {
            name: name.into(),
            version: String::new(),
        };
        self.rt
            .block_on(c.model_statistics(req))
            .unwrap()
            .into_inner()
    }
    fn ready(&self, name: &str, version: &str) -> bool {
        let mut c = self.client.clone();
        let req = ModelReadyRequest {
            name: name.into(),
            version: version.into(),
        };
        self.rt
            .block_on(c.model_ready(req))
            .unwrap()
            .into_inner()
            .ready
    }
}

fn input(name: &str, datatype: &str, shape: &[i64]) -> InferInputTensor {
    InferInputTensor {
        name: name.into(),
        datatype: datatype.into(),
        shape: shape.to_vec(),
        ..Default::default()
    }
}

fn le_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A request for `model` with one FP32 input sent as raw bytes.
fn raw_request(model: &str, name: &str, shape: &[i64], x: &[f32]) -> ModelInferRequest {
    ModelInferRequest {
        model_name: model.into(),
        inputs: vec![input(name, "FP32", shape)],
        raw_input_contents: vec![le_bytes(x)],
        ..Default::default()
    }
}

fn dims_i64(d: &[usize]) -> Vec<i64> {
    d.iter().map(|&x| x as i64).collect()
}

#[test]
fn health_metadata_infer_and_statistics() {
    let r = repo("grpc-infer");
    // gRPC alone, without --http.
    let g = start(&r, &[]);
    assert!(!g.serve.line.contains("http://"), "{}", g.serve.line);
    let mut c = g.client.clone();
    let live = g.rt.block_on(c.server_live(ServerLiveRequest {})).unwrap();
    assert!(live.into_inner().live);
    let ready =
        g.rt.block_on(c.server_ready(ServerReadyRequest {}))
            .unwrap();
    assert!(ready.into_inner().ready);
    let meta =
        g.rt.block_on(c.server_metadata(ServerMetadataRequest {}))
            .unwrap()
            .into_inner();
    assert_eq!(meta.name, "lanes");
    assert!(meta.extensions.contains(&"statistics".to_string()));

    let m =
        g.rt.block_on(c.model_metadata(ModelMetadataRequest {
            name: "resnet18".into(),
            version: "1".into(),
        }))
        .unwrap()
        .into_inner();
    assert_eq!(m.versions, vec!["1".to_string()]);
    assert_eq!(m.inputs[0].name, "input");
    assert_eq!(m.inputs[0].shape, vec![-1, 3, 32, 32]);
    assert_eq!(m.outputs[0].datatype, "FP32");
    assert!(g.ready("resnet18", ""));
    assert!(g.ready("resnet18", "1"));
    assert!(!g.ready("resnet18", "9"));
    assert!(!g.ready("garbage", ""));
    assert!(!g.ready("nope", ""));

    // Raw tensors (what tritonclient sends), against PyTorch's outputs.
    let (xd, x) = npy("resnet18.input.npy");
    let (yd, y) = npy("resnet18.output.npy");
    let mut req = raw_request("resnet18", "input", &dims_i64(&xd), &x);
    req.id = "req-7".into();
    let a = g.infer(req).unwrap();
    assert_eq!(a.id, "req-7");
    assert_eq!(a.model_name, "resnet18");
    assert_eq!(a.model_version, "1");
    assert_eq!(a.outputs.len(), 1);
    assert_eq!(a.outputs[0].name, "output");
    assert_eq!(a.outputs[0].datatype, "FP32");
    assert_eq!(a.outputs[0].shape, dims_i64(&yd));
    assert_eq!(a.raw_output_contents.len(), 1);
    let raw_out = floats(&a.raw_output_contents[0]);
    close(&raw_out, &y);

    // Typed contents, the output named: the same numbers, bit for bit.
    let mut typed = input("input", "FP32", &dims_i64(&xd));
    typed.contents = Some(InferTensorContents {
        fp32_contents: x.clone(),
        ..Default::default()
    });
    let b = g
        .infer(ModelInferRequest {
            model_name: "resnet18".into(),
            model_version: "1".into(),
            inputs: vec![typed],
            outputs: vec![InferRequestedOutputTensor {
                name: "output".into(),
                ..Default::default()
            }],
            ..Default::default()
        })
        .unwrap();
    assert_eq!(floats(&b.raw_output_contents[0]), raw_out);

    // One row: a session at batch 1 gives the first row.
    let one = g
        .infer(raw_request(
            "resnet18",
            "input",
            &[1, 3, 32, 32],
            &x[..3 * 32 * 32],
        ))
        .unwrap();
    assert_eq!(one.outputs[0].shape, vec![1, 10]);
    close(&floats(&one.raw_output_contents[0]), &y[..10]);

    let s = g.stats("resnet18");
    let s = &s.model_stats[0];
    assert_eq!(s.name, "resnet18");
    assert_eq!(s.version, "1");
    assert_eq!(s.inference_count, 5);
    assert_eq!(s.execution_count, 3);
    let inf = s.inference_stats.as_ref().unwrap();
    assert_eq!(inf.success.as_ref().unwrap().count, 3);
    assert!(inf.compute_infer.as_ref().unwrap().ns > 0);
    assert!(s.batch_stats.iter().any(|b| b.batch_size == 2));
    assert_eq!(g.stats("").model_stats.len(), 2);
}

#[test]
fn http_and_grpc_share_the_models() {
    let r = repo("grpc-both");
    let g = start(&r, &["--http", "127.0.0.1:0"]);
    let base = after(&g.serve.line, "inference protocol at http://")
        .and_then(|u| u.strip_suffix("/v2"))
        .unwrap_or_else(|| panic!("no HTTP address in {:?}", g.serve.line))
        .to_string();
    let (xd, x) = npy("resnet18.input.npy");
    let body = serde_json::json!({ "inputs": [{ "name": "input", "shape": xd,
                                               "datatype": "FP32", "data": x }] });
    let rest = minreq::post(format!("http://{base}/v2/models/resnet18/infer"))
        .with_timeout(60)
        .with_body(body.to_string())
        .send()
        .unwrap();
    assert_eq!(rest.status_code, 200);
    let rest: serde_json::Value = serde_json::from_slice(rest.as_bytes()).unwrap();
    let rest: Vec<f32> = rest["outputs"][0]["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    let grpc = g
        .infer(raw_request("resnet18", "input", &dims_i64(&xd), &x))
        .unwrap();
    // The same session at batch 2: the same floats (JSON holds them exactly).
    assert_eq!(floats(&grpc.raw_output_contents[0]), rest);
    // One model, one set of statistics: both requests counted.
    let s = &g.stats("resnet18").model_stats[0];
    assert_eq!(s.execution_count, 2);
    assert_eq!(s.inference_count, 4);
}

/// The status of a request that must fail, after checking its code.
fn refused(g: &Grpc, req: ModelInferRequest, code: Code) -> String {
    match g.infer(req) {
        Ok(r) => panic!("answered: {r:?}"),
        Err(s) => {
            assert_eq!(s.code(), code, "{s:?}");
            s.message().to_string()
        }
    }
}

#[test]
fn bad_requests_get_the_protocols_statuses() {
    let r = repo("grpc-errors");
    let g = start(&r, &["--http-max-body", "40KiB"]);
    let x = vec![0.0f32; 3 * 32 * 32];
    let ok = || raw_request("resnet18", "input", &[1, 3, 32, 32], &x);
    let check = |req: ModelInferRequest, code: Code, says: &str| {
        let m = refused(&g, req, code);
        assert!(m.contains(says), "{m:?} does not say {says:?}");
    };

    let mut q = ok();
    q.model_name = "nope".into();
    check(q, Code::NotFound, "unknown model `nope`");
    let mut q = ok();
    q.model_version = "9".into();
    check(q, Code::NotFound, "no version 9");
    let mut c = g.client.clone();
    let e =
        g.rt.block_on(c.model_metadata(ModelMetadataRequest {
            name: "nope".into(),
            version: String::new(),
        }))
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    check(
        raw_request("garbage", "x", &[1], &[0.0]),
        Code::Unavailable,
        "not available",
    );

    // Shapes, datatypes and sizes.
    check(
        raw_request("resnet18", "input", &[1, 3, 32, 31], &x[..3 * 32 * 31]),
        Code::InvalidArgument,
        "does not match",
    );
    check(
        raw_request("resnet18", "input", &[5, 3, 32, 32], &[]),
        Code::InvalidArgument,
        "max_batch_size",
    );
    check(
        raw_request("resnet18", "input", &[-1, 3, 32, 32], &[]),
        Code::InvalidArgument,
        "negative",
    );
    let mut q = ok();
    q.inputs[0].datatype = "INT64".into();
    check(q, Code::InvalidArgument, "datatype INT64");
    let mut q = ok();
    q.raw_input_contents[0].pop();
    check(q, Code::InvalidArgument, "12287 bytes of data");
    let mut q = ok();
    q.raw_input_contents.push(Vec::new());
    check(
        q,
        Code::InvalidArgument,
        "2 raw_input_contents for 1 inputs",
    );
    let mut q = ok();
    q.inputs[0].name = "z".into();
    check(q, Code::InvalidArgument, "unknown input `z`");
    let mut q = ok();
    q.inputs.push(q.inputs[0].clone());
    q.raw_input_contents.push(q.raw_input_contents[0].clone());
    check(q, Code::InvalidArgument, "given twice");
    let mut q = ok();
    q.inputs.clear();
    q.raw_input_contents.clear();
    check(q, Code::InvalidArgument, "`input` is missing");
    let mut q = ok();
    q.raw_input_contents.clear();
    check(q, Code::InvalidArgument, "has no data");
    let mut q = ok();
    q.inputs[0].contents = Some(InferTensorContents {
        fp32_contents: x.clone(),
        ..Default::default()
    });
    check(q, Code::InvalidArgument, "one or the other");
    // Typed contents in the wrong list, or too few.
    let mut q = ok();
    q.raw_input_contents.clear();
    q.inputs[0].contents = Some(InferTensorContents {
        int64_contents: vec![0; 3 * 32 * 32],
        ..Default::default()
    });
    check(q, Code::InvalidArgument, "contents.fp32_contents");
    let mut q = ok();
    q.raw_input_contents.clear();
    q.inputs[0].contents = Some(InferTensorContents {
        fp32_contents: vec![0.0; 7],
        ..Default::default()
    });
    check(q, Code::InvalidArgument, "7 data elements");
    let mut q = ok();
    q.outputs.push(InferRequestedOutputTensor {
        name: "q".into(),
        ..Default::default()
    });
    check(q, Code::InvalidArgument, "unknown output `q`");

    // Over --http-max-body (40 KiB; this message is about 48 KiB): refused
    // by tonic before it is decoded.
    let big = raw_request(
        "resnet18",
        "input",
        &[4, 3, 32, 32],
        &vec![0.3; 4 * 3 * 32 * 32],
    );
    let e = g.infer(big).unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("--http-max-body"), "{e:?}");

    // Failures leave the service serving; only successes are counted as
    // inferences.
    let fine = g.infer(ok()).unwrap();
    assert_eq!(fine.outputs[0].shape, vec![1, 10]);
    assert_eq!(g.stats("resnet18").model_stats[0].inference_count, 1);
    let mut serve = g.serve;
    assert!(serve.is_running());
}

#[test]
fn flags_are_checked_at_start() {
    use util::serve::refusal;
    let (_, err) = refusal(&["--device", "cpu", "--model-repository", "/nonexistent"]);
    assert!(err.contains("--grpc"), "{err}");
    // The gRPC port does not authenticate: other hosts only when asked.
    let (_, err) = refusal(&["--device", "cpu", "--grpc", "0.0.0.0:0"]);
    assert!(err.contains("--allow-unauthenticated-remote"), "{err}");
    assert!(err.contains("--grpc"), "{err}");
}
