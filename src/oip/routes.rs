//! The REST routes (KServe v2 and Triton's extensions) on axum.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State as St};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use super::body::Chunks;
use super::control::{self, Param};
use super::encoding;
use super::error::ApiError;
use super::infer::{self, State};
use super::model::Model;
use super::response;
use super::tensors::{self, datatype};

/// The protocol's header naming the JSON part's length.
pub const HEADER_LENGTH: &str = "inference-header-content-length";

/// JSON bodies larger than this (in bytes, or about this many bytes of
/// numbers in a response) are parsed or written on the blocking pool.
const LARGE_JSON: usize = 64 << 10;

type S = Arc<State>;
type Result<T> = std::result::Result<T, ApiError>;

/// The path's `{name}` and, on `/versions/{version}` routes, the version.
type Names = Path<HashMap<String, String>>;

fn names(p: &HashMap<String, String>) -> (String, Option<String>) {
    (
        p.get("name").cloned().unwrap_or_default(),
        p.get("version").cloned(),
    )
}

pub fn router(state: S) -> Router {
    let mut r = Router::new()
        .route("/v2/health/live", get(|| async { StatusCode::OK }))
        .route("/v2/health/ready", get(ready))
        .route("/v2", get(server_metadata))
        .route("/v2/models/stats", get(all_stats))
        .route("/v2/repository/index", post(index))
        .route("/v2/repository/models/{name}/load", post(load))
        .route("/v2/repository/models/{name}/unload", post(unload))
        .route("/v2/systemsharedmemory/status", get(shm_status_all))
        .route(
            "/v2/systemsharedmemory/unregister",
            post(shm_unregister_all),
        )
        .route(
            "/v2/systemsharedmemory/region/{name}/status",
            get(shm_status),
        )
        .route(
            "/v2/systemsharedmemory/region/{name}/register",
            post(shm_register),
        )
        .route(
            "/v2/systemsharedmemory/region/{name}/unregister",
            post(shm_unregister),
        );
    for base in ["/v2/models/{name}", "/v2/models/{name}/versions/{version}"] {
        r = r
            .route(base, get(metadata))
            .route(&format!("{base}/ready"), get(model_ready))
            .route(&format!("{base}/config"), get(config))
            .route(&format!("{base}/stats"), get(stats))
            .route(&format!("{base}/infer"), post(infer));
    }
    r.fallback(|| async { ApiError::NotFound("no such endpoint".into()) })
        .with_state(state)
}

async fn ready(St(s): St<S>) -> StatusCode {
    if s.ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn server_metadata(St(s): St<S>) -> Json<Value> {
    Json(json!({
        "name": super::SERVER_NAME,
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": super::extensions(&super::EXTENSIONS, s.shm.enabled()),
    }))
}

fn tensor_list(m: &Model, specs: &[super::model::TensorSpec]) -> Vec<Value> {
    specs
        .iter()
        .map(|s| json!({ "name": s.name, "datatype": datatype(s.dtype), "shape": m.info.shape(s) }))
        .collect()
}

async fn metadata(St(s): St<S>, Path(p): Names) -> Result<Json<Value>> {
    let (name, version) = names(&p);
    let m = s.models.get(&name, version.as_deref())?;
    Ok(Json(json!({
        "name": m.info.name,
        "versions": [m.info.version],
        "platform": super::PLATFORM,
        "inputs": tensor_list(&m, &m.info.inputs),
        "outputs": tensor_list(&m, &m.info.outputs),
    })))
}

async fn model_ready(St(s): St<S>, Path(p): Names) -> Result<StatusCode> {
    let (name, version) = names(&p);
    s.models
        .get(&name, version.as_deref())
        .map(|_| StatusCode::OK)
}

async fn config(St(s): St<S>, Path(p): Names) -> Result<Json<Value>> {
    let (name, version) = names(&p);
    let m = s.models.get(&name, version.as_deref())?;
    Ok(Json(super::config::of(&m).json()))
}

async fn all_stats(St(s): St<S>) -> Json<Value> {
    stats_of(&s.models.ready())
}

async fn stats(St(s): St<S>, Path(p): Names) -> Result<Json<Value>> {
    let (name, version) = names(&p);
    Ok(stats_of(&[s.models.get(&name, version.as_deref())?]))
}

fn stats_of(models: &[Arc<Model>]) -> Json<Value> {
    let list: Vec<Value> = models
        .iter()
        .map(|m| m.stats.json(&m.info.name, &m.info.version))
        .collect();
    Json(json!({ "model_stats": list }))
}

fn too_large(limit: usize) -> ApiError {
    ApiError::TooLarge(format!(
        "the request body exceeds {limit} bytes (--http-max-body)"
    ))
}

/// Refuses a body whose `Content-Length` is over `limit` before reading it.
fn check_length(headers: &HeaderMap, limit: usize) -> Result<()> {
    let n = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match n {
        Some(n) if n > limit as u64 => Err(too_large(limit)),
        _ => Ok(()),
    }
}

/// A failure reading the body: over the limit (an error whose source is
/// http-body-util's `LengthLimitError`, as a limit layer reports it) or
/// a broken connection or framing.
fn read_error(e: axum::Error, limit: usize) -> ApiError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(x) = src {
        if x.is::<http_body_util::LengthLimitError>() {
            return too_large(limit);
        }
        src = x.source();
    }
    ApiError::BadRequest(format!("cannot read the request body: {e}"))
}

/// Reads a small body of at most `limit` bytes into one buffer.
async fn body(req: Request, limit: usize) -> Result<(HeaderMap, axum::body::Bytes)> {
    let (parts, body) = req.into_parts();
    check_length(&parts.headers, limit)?;
    match axum::body::to_bytes(body, limit).await {
        Ok(b) => Ok((parts.headers, b)),
        Err(e) => Err(read_error(e, limit)),
    }
}

/// Reads a body of at most `limit` bytes as the pieces hyper hands over,
/// without gathering them (an inference request's binary data is copied
/// once, later, to where the service reads it).
async fn body_chunks(req: Request, limit: usize) -> Result<(HeaderMap, Chunks)> {
    use http_body_util::BodyExt;
    let (parts, mut body) = req.into_parts();
    check_length(&parts.headers, limit)?;
    let mut chunks = Chunks::default();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| read_error(e, limit))?;
        // Trailers are not data; a request has none that matter.
        if let Ok(data) = frame.into_data() {
            if chunks.len().saturating_add(data.len()) > limit {
                return Err(too_large(limit));
            }
            chunks.push(data);
        }
    }
    Ok((parts.headers, chunks))
}

async fn infer(St(s): St<S>, Path(p): Names, req: Request) -> Response {
    let (name, version) = names(&p);
    match infer_inner(s, name, version, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn infer_inner(
    s: S,
    name: String,
    version: Option<String>,
    req: Request,
) -> Result<Response> {
    let _permit = s.permit()?;
    let model = s.models.get(&name, version.as_deref())?;
    let (headers, mut bytes) = body_chunks(req, s.max_body).await?;
    if let Some(coding) = encoding::request_coding(headers.get(header::CONTENT_ENCODING))? {
        let limit = s.max_body;
        let inflated =
            tokio::task::spawn_blocking(move || encoding::inflate(coding, &bytes, limit))
                .await
                .map_err(|e| ApiError::Internal(format!("inflating the body stopped: {e}")))??;
        bytes = Chunks::one(axum::body::Bytes::from(inflated));
    }
    let answer_in = encoding::response_coding(headers.get(header::ACCEPT_ENCODING));
    let header_len = match headers.get(HEADER_LENGTH) {
        None => None,
        Some(v) => Some(v.to_str().map_err(|_| {
            ApiError::BadRequest("Inference-Header-Content-Length is not text".into())
        })?),
    };
    let json_len = tensors::json_len(bytes.len(), header_len)?;
    let m = Arc::clone(&model);
    let regions = Arc::clone(&s);
    let decode = move || {
        let json_part = bytes
            .prefix(json_len)
            .ok_or_else(|| ApiError::Internal("the body is shorter than its header".into()))?;
        let binary = bytes
            .slice(json_len, bytes.len() - json_len)
            .ok_or_else(|| ApiError::Internal("the body is shorter than its header".into()))?;
        tensors::decode(&m.info, &json_part, binary, &regions.shm)
    };
    // Parsing a large JSON body takes milliseconds: off the runtime's
    // threads, which serve every connection.
    let decoded = if json_len > LARGE_JSON {
        tokio::task::spawn_blocking(decode)
            .await
            .map_err(|e| ApiError::Internal(format!("decoding stopped: {e}")))??
    } else {
        decode()?
    };
    let (model, picked) = infer::run(
        &s,
        model,
        &name,
        version.as_deref(),
        decoded.rows,
        decoded.feeds,
        decoded.outputs.iter().map(|(n, _)| n.as_str()),
    )
    .await?;
    let json_elements: usize = decoded
        .outputs
        .iter()
        .zip(&picked)
        .filter(|((_, out), _)| matches!(out, response::Out::Json))
        .map(|(_, t)| t.numel())
        .sum();
    response::write_shm_outputs(
        decoded.outputs.iter().map(|(n, o)| {
            let slice = match o {
                response::Out::Shm(s) => Some(s),
                _ => None,
            };
            (n.as_str(), slice)
        }),
        &picked,
    )?;
    let (id, wanted) = (decoded.id, decoded.outputs);
    let encode = move || response::encode(&model.info, id, &wanted, &picked);
    let enc = if json_elements * 8 > LARGE_JSON {
        tokio::task::spawn_blocking(encode)
            .await
            .map_err(|e| ApiError::Internal(format!("encoding stopped: {e}")))?
    } else {
        encode()
    };
    let body = match answer_in {
        None => enc.body,
        Some(c) if enc.body.len() > LARGE_JSON => {
            let raw = enc.body;
            tokio::task::spawn_blocking(move || encoding::compress(c, &raw))
                .await
                .map_err(|e| ApiError::Internal(format!("compressing stopped: {e}")))?
        }
        Some(c) => encoding::compress(c, &enc.body),
    };
    let mut resp = Response::new(Body::from(body));
    let h = resp.headers_mut();
    if let Some(c) = answer_in {
        // Inference-Header-Content-Length stays the uncompressed JSON's.
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static(c.name()));
    }
    match enc.header_len {
        Some(n) => {
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            h.insert(HEADER_LENGTH, HeaderValue::from(n));
        }
        None => {
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
    }
    Ok(resp)
}

/// Largest body of an index or unload request (a load's may carry a
/// model file: `--http-max-body`).
const CONTROL_BODY: usize = 1 << 20;

/// An index's or unload's body, of at most [`CONTROL_BODY`] bytes: JSON
/// or empty.
async fn control_body(req: Request) -> Result<Value> {
    let (_, bytes) = body(req, CONTROL_BODY).await?;
    parse_control(&bytes)
}

fn parse_control(bytes: &[u8]) -> Result<Value> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(json!({}));
    }
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::BadRequest(format!("malformed request body: {e}")))
}

async fn index(St(s): St<S>, req: Request) -> Result<Json<Value>> {
    let body = control_body(req).await?;
    let only_ready = match body.get("ready") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::BadRequest("`ready` must be a boolean".into())),
    };
    let list: Vec<Value> = control::index(&s, only_ready)
        .into_iter()
        .map(|e| {
            let mut v = json!({ "name": e.name, "state": e.state.to_string() });
            if let Some(ver) = e.version {
                v["version"] = Value::from(ver);
            }
            if let Some(r) = e.reason {
                v["reason"] = Value::from(r);
            }
            v
        })
        .collect();
    Ok(Json(Value::Array(list)))
}

/// A load or unload body's `parameters`, as the protocol's kinds: a
/// `file:` parameter's base64 string decoded to its bytes.
fn params(body: &Value) -> Result<Vec<(String, Param)>> {
    use base64::Engine;
    let Some(p) = body.get("parameters") else {
        return Ok(Vec::new());
    };
    let p = p
        .as_object()
        .ok_or_else(|| ApiError::BadRequest("`parameters` must be an object".into()))?;
    let mut out = Vec::with_capacity(p.len());
    for (k, v) in p {
        let param = match v {
            Value::String(s) if k.starts_with("file:") => Param::Bytes(
                base64::engine::general_purpose::STANDARD
                    .decode(s)
                    .map_err(|e| {
                        ApiError::BadRequest(format!("parameter `{k}` is not base64: {e}"))
                    })?,
            ),
            Value::Bool(b) => Param::Bool(*b),
            Value::String(s) => Param::Text(s.clone()),
            Value::Number(n) => Param::Int(n.as_i64().ok_or_else(|| {
                ApiError::BadRequest(format!("parameter `{k}`: {n} is not an integer"))
            })?),
            _ => {
                return Err(ApiError::BadRequest(format!(
                    "parameter `{k}` must be a string, a boolean or an integer"
                )))
            }
        };
        out.push((k.clone(), param));
    }
    Ok(out)
}

/// A load's body may carry a model file (base64 in `parameters`): it is
/// bounded by `--http-max-body` and counted among the requests in flight
/// as an inference request is, and read off the runtime's threads.
async fn load(St(s): St<S>, Path(name): Path<String>, req: Request) -> Result<StatusCode> {
    let _permit = s.permit()?;
    let (_, bytes) = body(req, s.max_body).await?;
    let read = move || -> Result<Vec<(String, Param)>> { params(&parse_control(&bytes)?) };
    let params = tokio::task::spawn_blocking(read)
        .await
        .map_err(|e| ApiError::Internal(format!("reading the load request stopped: {e}")))??;
    control::load(&s, name, params).await?;
    Ok(StatusCode::OK)
}

async fn unload(St(s): St<S>, Path(name): Path<String>, req: Request) -> Result<StatusCode> {
    let body = control_body(req).await?;
    params(&body)?;
    control::unload(&s, name).await?;
    Ok(StatusCode::OK)
}

/// A registration's body (Triton's system shared memory extension).
#[derive(Debug, serde::Deserialize)]
struct RegisterBody {
    key: String,
    #[serde(default)]
    offset: u64,
    byte_size: u64,
}

fn shm_status_json(list: Vec<super::shm::RegionStatus>) -> Json<Value> {
    let list: Vec<Value> = list
        .into_iter()
        .map(|r| json!({ "name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size }))
        .collect();
    Json(Value::Array(list))
}

async fn shm_status_all(St(s): St<S>) -> Result<Json<Value>> {
    Ok(shm_status_json(s.shm.status(None)?))
}

async fn shm_status(St(s): St<S>, Path(name): Path<String>) -> Result<Json<Value>> {
    Ok(shm_status_json(s.shm.status(Some(&name))?))
}

async fn shm_register(St(s): St<S>, Path(name): Path<String>, req: Request) -> Result<StatusCode> {
    let (_, bytes) = body(req, CONTROL_BODY).await?;
    let b: RegisterBody = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::BadRequest(format!("malformed registration: {e}")))?;
    s.shm.register(&name, &b.key, b.offset, b.byte_size)?;
    Ok(StatusCode::OK)
}

async fn shm_unregister(St(s): St<S>, Path(name): Path<String>) -> Result<StatusCode> {
    s.shm.unregister(Some(&name))?;
    Ok(StatusCode::OK)
}

async fn shm_unregister_all(St(s): St<S>) -> Result<StatusCode> {
    s.shm.unregister(None)?;
    Ok(StatusCode::OK)
}
