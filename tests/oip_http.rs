//! The Open Inference Protocol over HTTP against a real `lanes serve
//! --http … --model-repository …` child process: metadata, infer with
//! JSON and binary tensors compared with PyTorch's outputs, the
//! repository, statistics, dynamic batching, and each error case.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use serde_json::{json, Value};
use util::oip::{close, fixture, npy, put, repo, Repo};
use util::serve::Serve;

struct Http {
    serve: Serve,
    base: String,
}

fn start(repo: &Repo, extra: &[&str]) -> Http {
    let dir = repo.0.to_str().unwrap();
    let mut args = vec!["--http", "127.0.0.1:0", "--model-repository", dir];
    args.extend_from_slice(extra);
    let serve = Serve::start(&args);
    let base = serve
        .line
        .split("inference protocol at ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|u| u.strip_suffix("/v2"))
        .unwrap_or_else(|| panic!("no HTTP address in {:?}", serve.line))
        .to_string();
    Http { serve, base }
}

struct Got {
    status: i32,
    header_len: Option<usize>,
    body: Vec<u8>,
}

impl Got {
    fn json(&self) -> Value {
        let end = self.header_len.unwrap_or(self.body.len());
        serde_json::from_slice(&self.body[..end])
            .unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(&self.body)))
    }
    fn error(&self) -> String {
        self.json()["error"]
            .as_str()
            .expect("an error message")
            .to_string()
    }
}

impl Http {
    fn get(&self, path: &str) -> Got {
        let r = minreq::get(format!("{}{path}", self.base))
            .with_timeout(60)
            .send()
            .unwrap();
        got(r)
    }
    fn post(&self, path: &str, body: Vec<u8>, header_len: Option<usize>) -> Got {
        let mut req = minreq::post(format!("{}{path}", self.base))
            .with_timeout(60)
            .with_body(body);
        if let Some(n) = header_len {
            req = req.with_header("Inference-Header-Content-Length", n.to_string());
        }
        got(req.send().unwrap())
    }
    fn post_json(&self, path: &str, v: &Value) -> Got {
        self.post(path, v.to_string().into_bytes(), None)
    }
}

fn got(r: minreq::Response) -> Got {
    Got {
        status: r.status_code,
        header_len: r
            .headers
            .get("inference-header-content-length")
            .map(|v| v.parse().unwrap()),
        body: r.as_bytes().to_vec(),
    }
}

fn json_request(name: &str, dims: &[usize], data: &[f32]) -> Value {
    json!({ "inputs": [{ "name": name, "shape": dims, "datatype": "FP32", "data": data }] })
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

#[test]
fn metadata_infer_json_and_binary_and_statistics() {
    let r = repo("infer");
    let h = start(&r, &[]);
    assert_eq!(h.get("/v2/health/live").status, 200);
    assert_eq!(h.get("/v2/health/ready").status, 200);
    let meta = h.get("/v2").json();
    assert_eq!(meta["name"], "lanes");
    assert!(meta["extensions"]
        .as_array()
        .unwrap()
        .contains(&json!("binary_tensor_data")));

    let m = h.get("/v2/models/resnet18").json();
    assert_eq!(m["inputs"][0]["shape"], json!([-1, 3, 32, 32]));
    assert_eq!(m["outputs"][0]["datatype"], "FP32");
    assert_eq!(h.get("/v2/models/resnet18/versions/1").status, 200);
    assert_eq!(h.get("/v2/models/resnet18/ready").status, 200);
    let c = h.get("/v2/models/resnet18/config").json();
    assert_eq!(c["max_batch_size"], 4);
    assert_eq!(c["input"][0]["dims"], json!([3, 32, 32]));
    // No config.pbtxt: the batch found from the file's symbolic dimension.
    let c = h.get("/v2/models/conv/config").json();
    assert_eq!(c["max_batch_size"], lanes::oip::DEFAULT_MAX_BATCH);

    // JSON in and out, against PyTorch's outputs at batch 2.
    let (xd, x) = npy("resnet18.input.npy");
    let (yd, y) = npy("resnet18.output.npy");
    let a = h.post_json("/v2/models/resnet18/infer", &json_request("input", &xd, &x));
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    let out = &a.json()["outputs"][0];
    assert_eq!(out["shape"], json!(yd));
    let json_out = floats(&out["data"]);
    close(&json_out, &y);

    // Binary in and out: the same numbers, bit for bit.
    let raw: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let head = json!({
        "id": "req-7",
        "inputs": [{ "name": "input", "shape": xd, "datatype": "FP32",
                     "parameters": { "binary_data_size": raw.len() } }],
        "parameters": { "binary_data_output": true },
    })
    .to_string()
    .into_bytes();
    let n = head.len();
    let b = h.post("/v2/models/resnet18/infer", [head, raw].concat(), Some(n));
    assert_eq!(b.status, 200, "{}", String::from_utf8_lossy(&b.body));
    let hl = b.header_len.expect("a binary response");
    let head = b.json();
    assert_eq!(head["id"], "req-7");
    assert_eq!(head["outputs"][0]["parameters"]["binary_data_size"], 80);
    let bin: Vec<f32> = b.body[hl..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(bin, json_out);

    // One row: a session at batch 1 gives the first row.
    let one = h.post_json(
        "/v2/models/resnet18/infer",
        &json_request("input", &[1, 3, 32, 32], &x[..3 * 32 * 32]),
    );
    assert_eq!(one.status, 200);
    close(&floats(&one.json()["outputs"][0]["data"]), &y[..10]);

    let s = h.get("/v2/models/resnet18/stats").json();
    let s = &s["model_stats"][0];
    assert_eq!(s["name"], "resnet18");
    assert_eq!(s["version"], "1");
    assert_eq!(s["inference_count"], 5);
    assert_eq!(s["execution_count"], 3);
    assert_eq!(s["inference_stats"]["success"]["count"], 3);
    assert!(
        s["inference_stats"]["compute_infer"]["ns"]
            .as_u64()
            .unwrap()
            > 0
    );
    let all = h.get("/v2/models/stats").json();
    assert_eq!(all["model_stats"].as_array().unwrap().len(), 2);
}

#[test]
fn repository_index_load_and_unload() {
    let r = repo("repo");
    let h = start(&r, &[]);
    let index = h.post("/v2/repository/index", Vec::new(), None).json();
    let state = |name: &str| {
        index
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("{name} in {index}"))
    };
    assert_eq!(state("conv")["state"], "READY");
    assert_eq!(state("resnet18")["version"], "1");
    let g = state("garbage");
    assert_eq!(g["state"], "UNAVAILABLE");
    assert!(g["reason"].as_str().unwrap().contains("decode"), "{g}");
    let u = state("hardmax");
    assert!(u["reason"].as_str().unwrap().contains("Hardmax"), "{u}");
    let ready = h
        .post_json("/v2/repository/index", &json!({ "ready": true }))
        .json();
    assert_eq!(ready.as_array().unwrap().len(), 2);

    assert_eq!(
        h.post("/v2/repository/models/conv/unload", Vec::new(), None)
            .status,
        200
    );
    let not = h.get("/v2/models/conv/ready");
    assert_eq!(not.status, 400);
    assert!(not.error().contains("unloaded"), "{}", not.error());
    let x = vec![0.5f32; 4 * 9 * 9];
    let refused = h.post_json(
        "/v2/models/conv/infer",
        &json_request("x", &[1, 4, 9, 9], &x),
    );
    assert_eq!(refused.status, 400);
    assert_eq!(
        h.post("/v2/repository/models/conv/load", Vec::new(), None)
            .status,
        200
    );
    assert_eq!(h.get("/v2/models/conv/ready").status, 200);
    let ok = h.post_json(
        "/v2/models/conv/infer",
        &json_request("x", &[1, 4, 9, 9], &x),
    );
    assert_eq!(ok.status, 200, "{}", String::from_utf8_lossy(&ok.body));
    assert_eq!(ok.json()["outputs"][0]["shape"], json!([1, 6]));

    // A model file that does not parse: the load fails with its reason.
    let bad = h.post("/v2/repository/models/garbage/load", Vec::new(), None);
    assert_eq!(bad.status, 400);
    assert!(bad.error().contains("does not import"), "{}", bad.error());
    let none = h.post("/v2/repository/models/absent/load", Vec::new(), None);
    assert_eq!(none.status, 404);
    let file = h.post_json(
        "/v2/repository/models/conv/load",
        &json!({ "parameters": { "config": "{}", "file:1/model.onnx": "AAAA" } }),
    );
    // Three zero bytes: not an ONNX model.
    assert_eq!(file.status, 400);
    assert!(file.error().contains("does not import"), "{}", file.error());
    // The model loaded before stays loaded.
    assert_eq!(h.get("/v2/models/conv/ready").status, 200);
}

#[test]
fn bad_requests_get_the_protocols_errors() {
    let r = repo("errors");
    let h = start(&r, &["--http-max-body", "16KiB"]);
    let x = vec![0.0f32; 3 * 32 * 32];
    let infer = "/v2/models/resnet18/infer";

    let e = h.post_json(
        "/v2/models/nope/infer",
        &json_request("input", &[1, 3, 32, 32], &x),
    );
    assert_eq!(e.status, 404);
    assert!(e.error().contains("unknown model `nope`"), "{}", e.error());
    assert_eq!(h.get("/v2/models/nope").status, 404);
    assert_eq!(h.get("/v2/models/resnet18/versions/9").status, 404);
    assert_eq!(h.get("/v2/no/such/path").status, 404);

    let e = h.post_json(
        infer,
        &json_request("input", &[1, 3, 32, 31], &x[..3 * 32 * 31]),
    );
    assert_eq!(e.status, 400);
    assert!(e.error().contains("does not match"), "{}", e.error());
    let e = h.post_json(infer, &json_request("input", &[5, 3, 32, 32], &[]));
    assert_eq!(e.status, 400);
    assert!(e.error().contains("max_batch_size"), "{}", e.error());
    let wrong_type = json!({ "inputs": [{ "name": "input", "shape": [1, 3, 32, 32],
                                         "datatype": "INT64", "data": [0] }] });
    let e = h.post_json(infer, &wrong_type);
    assert_eq!(e.status, 400);
    assert!(e.error().contains("datatype INT64"), "{}", e.error());
    let e = h.post(infer, b"{\"inputs\": [".to_vec(), None);
    assert_eq!(e.status, 400);
    assert!(e.error().contains("malformed"), "{}", e.error());
    let e = h.post(infer, b"{}".to_vec(), Some(99));
    assert_eq!(e.status, 400);
    assert!(
        e.error().contains("Inference-Header-Content-Length"),
        "{}",
        e.error()
    );
    let head = json!({ "inputs": [{ "name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32",
                                    "parameters": { "binary_data_size": 12288 } }] })
    .to_string()
    .into_bytes();
    let n = head.len();
    let e = h.post(infer, [head, vec![0u8; 100]].concat(), Some(n));
    assert_eq!(e.status, 400);
    assert!(e.error().contains("binary bytes"), "{}", e.error());

    // Over --http-max-body (16 KiB; this body is about 60 KB).
    let big = json_request("input", &[1, 3, 32, 32], &vec![0.3; 3 * 32 * 32]);
    let e = h.post_json(infer, &big);
    assert_eq!(e.status, 413);
    assert!(e.error().contains("--http-max-body"), "{}", e.error());

    // A model that failed to load answers with its reason.
    let e = h.post_json("/v2/models/garbage/infer", &json_request("x", &[1], &[0.0]));
    assert_eq!(e.status, 400);
    assert!(e.error().contains("not available"), "{}", e.error());

    // Failures are counted; the service still serves.
    let ok = h.post_json(infer, &json_request("input", &[1, 3, 32, 32], &x));
    assert_eq!(ok.status, 200);
    let s = h.get("/v2/models/resnet18/stats").json();
    assert_eq!(s["model_stats"][0]["inference_count"], 1);
    let mut serve = h.serve;
    assert!(serve.is_running());
}

#[test]
fn flags_are_checked_at_start() {
    use util::serve::refusal;
    let (_, err) = refusal(&["--device", "cpu", "--model-repository", "/nonexistent"]);
    assert!(err.contains("--http"), "{err}");
    let (_, err) = refusal(&[
        "--device",
        "cpu",
        "--http",
        "127.0.0.1:0",
        "--model-repository",
        "/nonexistent",
    ]);
    assert!(err.contains("not a directory"), "{err}");
    // The HTTP port does not authenticate: other hosts only when asked.
    let (_, err) = refusal(&["--device", "cpu", "--http", "0.0.0.0:0"]);
    assert!(err.contains("--allow-unauthenticated-remote"), "{err}");
}

/// A binary request's body for `input` of shape `dims`, binary outputs.
fn binary_request(dims: &[usize], x: &[f32]) -> (Vec<u8>, usize) {
    let raw: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let head = json!({
        "inputs": [{ "name": "input", "shape": dims, "datatype": "FP32",
                     "parameters": { "binary_data_size": raw.len() } }],
        "parameters": { "binary_data_output": true },
    })
    .to_string()
    .into_bytes();
    let n = head.len();
    ([head, raw].concat(), n)
}

fn binary_floats(g: &Got) -> Vec<f32> {
    let hl = g.header_len.expect("a binary response");
    g.body[hl..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Binary data goes through the models' feed buffers (shared memory)
/// where the service takes them, and in the Runs themselves where it
/// does not: the same outputs either way, at each batch size, and again
/// from buffers written before (the second request).
#[test]
fn binary_inputs_with_and_without_shared_memory_give_the_same_outputs() {
    let (xd, x) = npy("resnet18.input.npy");
    let (_, y) = npy("resnet18.output.npy");
    let row = x.len() / xd[0];
    let mut outs = Vec::new();
    for (tag, extra) in [("feedbuf", &[][..]), ("noshm", &["--no-shared-memory"][..])] {
        let r = repo(tag);
        let h = start(&r, extra);
        for rows in [xd[0], 1, xd[0]] {
            let mut dims = xd.clone();
            dims[0] = rows;
            let (body, n) = binary_request(&dims, &x[..rows * row]);
            let g = h.post("/v2/models/resnet18/infer", body, Some(n));
            assert_eq!(g.status, 200, "{}", String::from_utf8_lossy(&g.body));
            let got = binary_floats(&g);
            close(&got, &y[..got.len()]);
            outs.push(got);
        }
    }
    assert_eq!(outs[0], outs[2]);
    assert_eq!(outs[0], outs[3]);
    assert_eq!(outs[1], outs[4]);
}

/// A repository with `waits`: a model that waits up to 20 s for a batch
/// of `rows` rows to fill.
fn waiting_repo(tag: &str, rows: usize) -> Repo {
    let r = repo(tag);
    let config = format!(
        "max_batch_size: {rows}\ndynamic_batching {{ max_queue_delay_microseconds: 20000000 }}"
    );
    put(&r.0, "waits", &fixture("ops_conv.onnx"), Some(&config));
    r
}

/// Sends a one-row request to `waits` from a thread of its own, its
/// input as binary data or JSON; the status and the output's values.
fn send_waiting(h: &Http, binary: bool) -> std::thread::JoinHandle<(i32, Vec<f32>)> {
    let url = format!("{}/v2/models/waits/infer", h.base);
    let x = [0.5f32; 4 * 9 * 9];
    let (body, header_len) = if binary {
        let raw: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        let head = json!({
            "inputs": [{ "name": "x", "shape": [1, 4, 9, 9], "datatype": "FP32",
                         "parameters": { "binary_data_size": raw.len() } }],
        })
        .to_string()
        .into_bytes();
        let n = head.len();
        ([head, raw].concat(), Some(n))
    } else {
        (
            json_request("x", &[1, 4, 9, 9], &x)
                .to_string()
                .into_bytes(),
            None,
        )
    };
    std::thread::spawn(move || {
        let mut req = minreq::post(url).with_timeout(60).with_body(body);
        if let Some(n) = header_len {
            req = req.with_header("Inference-Header-Content-Length", n.to_string());
        }
        let g = got(req.send().unwrap());
        let out = if g.status == 200 {
            floats(&g.json()["outputs"][0]["data"])
        } else {
            Vec::new()
        };
        (g.status, out)
    })
}

#[test]
fn concurrent_requests_are_gathered_into_one_run() {
    let r = waiting_repo("batching", 4);
    let h = start(&r, &[]);
    // Binary and JSON inputs in one batch.
    let threads: Vec<_> = (0..4).map(|i| send_waiting(&h, i % 2 == 1)).collect();
    let mut outs = Vec::new();
    for t in threads {
        let (status, out) = t.join().unwrap();
        assert_eq!(status, 200);
        assert!(!out.is_empty());
        outs.push(out);
    }
    // The same input, row by row: the same outputs.
    assert!(outs.iter().all(|o| *o == outs[0]));
    let s = h.get("/v2/models/waits/stats").json();
    let s = &s["model_stats"][0];
    assert_eq!(s["inference_count"], 4);
    assert_eq!(s["execution_count"], 1);
    assert_eq!(s["batch_stats"][0]["batch_size"], 4);
}

#[test]
fn requests_over_the_in_flight_limit_are_refused() {
    let r = waiting_repo("inflight", 8);
    let h = start(&r, &["--http-max-in-flight", "3"]);
    let waiting: Vec<_> = (0..3).map(|_| send_waiting(&h, false)).collect();
    // The limit is taken before the model is looked up: while fewer than
    // three wait, this is answered 404 at once, then 503.
    let x = [0.0f32];
    let mut refused = None;
    while waiting.iter().any(|t| !t.is_finished()) {
        let e = h.post_json("/v2/models/nope/infer", &json_request("x", &[1], &x));
        if e.status == 503 {
            refused = Some(e.error());
            break;
        }
        assert_eq!(e.status, 404);
    }
    let refused = refused.expect("a request over --http-max-in-flight was refused");
    assert!(refused.contains("--http-max-in-flight"), "{refused}");
    // A load (which may carry a model file) takes a place too; the three
    // requests wait for their batch until the unload below.
    let load = h.post("/v2/repository/models/waits/load", Vec::new(), None);
    assert_eq!(load.status, 503);
    assert!(
        load.error().contains("in flight already"),
        "{}",
        load.error()
    );
    // Unloading serves the requests queued (one batch of three) first.
    assert_eq!(
        h.post("/v2/repository/models/waits/unload", Vec::new(), None)
            .status,
        200
    );
    for t in waiting {
        assert_eq!(t.join().unwrap().0, 200);
    }
}

#[test]
fn a_session_the_service_reclaims_is_opened_again() {
    let r = repo("reclaim");
    let h = start(&r, &["--idle-timeout", "0.2"]);
    let x = vec![0.5f32; 4 * 9 * 9];
    let body = json_request("x", &[1, 4, 9, 9], &x);
    let first = h.post_json("/v2/models/conv/infer", &body);
    assert_eq!(first.status, 200);
    // Silent for many idle timeouts: the service reclaims the session
    // (it looks every 50 ms), and the next request opens it again.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let second = h.post_json("/v2/models/conv/infer", &body);
    assert_eq!(second.status, 200, "{}", second.error());
    assert_eq!(first.json()["outputs"], second.json()["outputs"]);
    let s = h.get("/v2/models/conv/stats").json();
    let input = &s["model_stats"][0]["inference_stats"]["compute_input"];
    assert!(
        input["ns"].as_u64().unwrap() > 0,
        "no session was opened again: {s}"
    );
    let log = h.serve.stop();
    assert!(
        log.contains("idle session reclaimed") && log.contains("oip:conv:b1"),
        "{log}"
    );
}

#[test]
fn a_reload_keeps_serving_the_model() {
    let r = repo("reload");
    let h = start(&r, &[]);
    let url = format!("{}/v2/models/conv/infer", h.base);
    let body = json_request("x", &[2, 4, 9, 9], &[0.25; 2 * 4 * 9 * 9]).to_string();
    let callers: Vec<_> = (0..2)
        .map(|_| {
            let (url, body) = (url.clone(), body.clone());
            std::thread::spawn(move || {
                (0..40)
                    .map(|_| {
                        let r = minreq::post(&url)
                            .with_timeout(60)
                            .with_body(body.clone())
                            .send()
                            .unwrap();
                        (r.status_code, r.as_str().unwrap_or("").to_string())
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for _ in 0..4 {
        assert_eq!(
            h.post("/v2/repository/models/conv/load", Vec::new(), None)
                .status,
            200
        );
    }
    for c in callers {
        for (status, body) in c.join().unwrap() {
            assert_eq!(status, 200, "{body}");
        }
    }
}
