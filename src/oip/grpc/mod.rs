//! The Open Inference Protocol over gRPC (`lanes serve --grpc ADDR`): the
//! service `inference.GRPCInferenceService` on tonic.
//!
//! A thin front door beside the REST one: it reads a request from the
//! protocol's messages and hands it to the same models' table, checks and
//! batching (`super::infer`, `super::tensors`); only the reading and the
//! writing are its own. Inputs come as `raw_input_contents` (what
//! tritonclient sends) or as typed `contents`; outputs go back as
//! `raw_output_contents`. Request messages may be gzip- or
//! deflate-compressed. Errors are gRPC statuses
//! ([`super::ApiError::grpc_code`]); a request message over
//! `--http-max-body` is refused by tonic before it is read.

#[allow(
    clippy::all,
    clippy::pedantic,
    missing_docs,
    missing_debug_implementations,
    unused_qualifications
)]
/// The protocol's messages, server and client, generated from
/// `inference.proto` by `gen/` (checked in, so that building Lanes needs no
/// protobuf compiler).
pub mod proto {
    include!("inference.rs");
}

use std::future::Future;
use std::sync::Arc;

use lanes_adaptor::{DType, TensorData};
use tonic::codegen::http;
use tonic::{Request, Response, Status};

use super::body::Chunks;
use super::control::{self, Param};
use super::error::ApiError;
use super::infer::{self, State};
use super::model::ModelInfo;
use super::tensors::{self, datatype, Feeds};
use proto::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use proto::model_infer_request::InferInputTensor;
use proto::model_infer_response::InferOutputTensor;
use proto::model_metadata_response::TensorMetadata;
use proto::model_repository_parameter::ParameterChoice;
use proto::repository_index_response::ModelIndex;
use proto::*;

/// Serves the protocol on `listener` until `shutdown` resolves.
pub(super) async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<State>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let max = state.max_body;
    // Compressed request messages are taken (tritonclient's
    // `compression_algorithm`), inflated by tonic into at most `max` bytes;
    // responses are not compressed (clients announce gzip whether or not
    // they asked for it, and it costs CPU on both sides).
    let service = GrpcInferenceServiceServer::new(Service { state })
        .accept_compressed(tonic::codec::CompressionEncoding::Gzip)
        .accept_compressed(tonic::codec::CompressionEncoding::Deflate)
        .max_decoding_message_size(max)
        .max_encoding_message_size(usize::MAX);
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        .layer(tower::util::MapResponseLayer::new(move |r| {
            too_large(r, max)
        }))
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}

/// tonic refuses a request message over its limit with OUT_OF_RANGE; the
/// protocol's clients, like gRPC's own libraries, expect
/// RESOURCE_EXHAUSTED, and the user wants the flag that sets the limit.
fn too_large(
    mut r: http::Response<tonic::body::Body>,
    max: usize,
) -> http::Response<tonic::body::Body> {
    let over = Status::from_header_map(r.headers()).is_some_and(|s| {
        s.code() == tonic::Code::OutOfRange && s.message().contains("message length too large")
    });
    if over {
        let s = Status::resource_exhausted(format!(
            "the request message exceeds {max} bytes (--http-max-body)"
        ));
        // Only fails on a message that is no header value; this one is.
        let _ = s.add_header(r.headers_mut());
    }
    r
}

#[derive(Debug)]
struct Service {
    state: Arc<State>,
}

/// The protocol leaves a version empty to mean "whichever is loaded".
fn version(v: &str) -> Option<&str> {
    (!v.is_empty()).then_some(v)
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::BadRequest(msg.into())
}

/// A request read and checked against its model.
#[derive(Debug)]
struct Decoded {
    rows: usize,
    feeds: Vec<(String, tensors::Feed)>,
    /// The outputs asked for (all, in the model's order, when none named).
    outputs: Vec<String>,
}

/// An input's typed contents: the list its datatype takes, and no other.
fn typed(
    input: &InferInputTensor,
    slot: &tensors::InputSlot,
    c: InferTensorContents,
) -> Result<lanes_adaptor::Tensor, ApiError> {
    let others = [
        !c.bool_contents.is_empty(),
        !c.int_contents.is_empty(),
        !c.uint_contents.is_empty(),
        !c.uint64_contents.is_empty(),
        !c.fp64_contents.is_empty(),
        !c.bytes_contents.is_empty(),
    ];
    if matches!(slot.dtype, DType::F16 | DType::BF16) {
        // The protocol has no typed list for 16-bit floats.
        return Err(bad(format!(
            "input `{}`: {} data travels in raw_input_contents only",
            input.name, input.datatype
        )));
    }
    let wrong = match slot.dtype {
        DType::F32 => !c.int64_contents.is_empty(),
        DType::I64 | DType::F16 | DType::BF16 => !c.fp32_contents.is_empty(),
    };
    if wrong || others.iter().any(|&x| x) {
        let list = match slot.dtype {
            DType::F32 | DType::F16 | DType::BF16 => "fp32_contents",
            DType::I64 => "int64_contents",
        };
        return Err(bad(format!(
            "input `{}`: {} data goes in contents.{list}, and only there",
            input.name, input.datatype
        )));
    }
    let data = match slot.dtype {
        DType::I64 => TensorData::I64(c.int64_contents),
        DType::F32 | DType::F16 | DType::BF16 => TensorData::F32(c.fp32_contents),
    };
    tensors::typed_tensor(&input.name, slot, data)
}

/// Reads and checks an inference request's tensors.
fn decode(model: &ModelInfo, req: ModelInferRequest) -> Result<Decoded, ApiError> {
    let mut raw = req.raw_input_contents;
    if !raw.is_empty() && raw.len() != req.inputs.len() {
        return Err(bad(format!(
            "{} raw_input_contents for {} inputs: give one per input, in the inputs' order",
            raw.len(),
            req.inputs.len()
        )));
    }
    let mut feeds = Feeds::new(model);
    for (i, mut input) in req.inputs.into_iter().enumerate() {
        let slot = feeds.check(&input.name, &input.datatype, &input.shape)?;
        let contents = input.contents.take();
        let feed = match (raw.get_mut(i), contents) {
            (Some(_), Some(_)) => {
                return Err(bad(format!(
                "input `{}` has contents, and the request raw_input_contents: use one or the other",
                input.name
            )))
            }
            (Some(bytes), None) => {
                // The message's own buffer, moved (no copy) until it is
                // written where the service reads it.
                let bytes = axum::body::Bytes::from(std::mem::take(bytes));
                tensors::raw_feed(&input.name, &slot, Chunks::one(bytes))?
            }
            (None, Some(c)) => tensors::Feed::Tensor(typed(&input, &slot, c)?),
            (None, None) => return Err(bad(format!("input `{}` has no data", input.name))),
        };
        feeds.put(slot, feed);
    }
    let (rows, feeds) = feeds.finish()?;
    let outputs = if req.outputs.is_empty() {
        model.outputs.iter().map(|s| s.name.clone()).collect()
    } else {
        let mut v: Vec<String> = Vec::with_capacity(req.outputs.len());
        for o in req.outputs {
            tensors::check_output(model, &o.name, v.iter().map(String::as_str))?;
            v.push(o.name);
        }
        v
    };
    Ok(Decoded {
        rows,
        feeds,
        outputs,
    })
}

fn shape_i64(dims: &[usize]) -> Vec<i64> {
    dims.iter().map(|&d| d as i64).collect()
}

fn duration(v: &serde_json::Value) -> Option<StatisticDuration> {
    Some(StatisticDuration {
        count: v["count"].as_u64().unwrap_or(0),
        ns: v["ns"].as_u64().unwrap_or(0),
    })
}

/// A model's statistics, from the form the REST side serves.
fn statistics(j: &serde_json::Value) -> ModelStatistics {
    let s = &j["inference_stats"];
    let batches = j["batch_stats"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    ModelStatistics {
        name: j["name"].as_str().unwrap_or_default().to_string(),
        version: j["version"].as_str().unwrap_or_default().to_string(),
        last_inference: j["last_inference"].as_u64().unwrap_or(0),
        inference_count: j["inference_count"].as_u64().unwrap_or(0),
        execution_count: j["execution_count"].as_u64().unwrap_or(0),
        inference_stats: Some(InferStatistics {
            success: duration(&s["success"]),
            fail: duration(&s["fail"]),
            queue: duration(&s["queue"]),
            compute_input: duration(&s["compute_input"]),
            compute_infer: duration(&s["compute_infer"]),
            compute_output: duration(&s["compute_output"]),
            cache_hit: duration(&s["cache_hit"]),
            cache_miss: duration(&s["cache_miss"]),
        }),
        batch_stats: batches
            .iter()
            .map(|b| InferBatchStatistics {
                batch_size: b["batch_size"].as_u64().unwrap_or(0),
                compute_input: duration(&b["compute_input"]),
                compute_infer: duration(&b["compute_infer"]),
                compute_output: duration(&b["compute_output"]),
            })
            .collect(),
    }
}

/// A load's or unload's parameters, as the protocol's kinds (one with no
/// value is refused).
fn params(
    map: std::collections::HashMap<String, ModelRepositoryParameter>,
) -> Result<Vec<(String, Param)>, ApiError> {
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        let p = match v.parameter_choice {
            Some(ParameterChoice::BoolParam(b)) => Param::Bool(b),
            Some(ParameterChoice::Int64Param(i)) => Param::Int(i),
            Some(ParameterChoice::StringParam(s)) => Param::Text(s),
            Some(ParameterChoice::BytesParam(b)) => Param::Bytes(b),
            None => return Err(bad(format!("parameter `{k}` has no value"))),
        };
        out.push((k, p));
    }
    // The map's order is arbitrary; the answers (the first bad parameter
    // named) should not be.
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

type Answer<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl GrpcInferenceService for Service {
    async fn server_live(&self, _: Request<ServerLiveRequest>) -> Answer<ServerLiveResponse> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(&self, _: Request<ServerReadyRequest>) -> Answer<ServerReadyResponse> {
        Ok(Response::new(ServerReadyResponse {
            ready: self.state.ready(),
        }))
    }

    async fn model_ready(&self, req: Request<ModelReadyRequest>) -> Answer<ModelReadyResponse> {
        let r = req.get_ref();
        // Not loaded, unknown or another version: not ready (as over HTTP,
        // where tritonclient reads any answer but 200 as false).
        let ready = self.state.models.get(&r.name, version(&r.version)).is_ok();
        Ok(Response::new(ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        _: Request<ServerMetadataRequest>,
    ) -> Answer<ServerMetadataResponse> {
        Ok(Response::new(ServerMetadataResponse {
            name: super::SERVER_NAME.into(),
            version: env!("CARGO_PKG_VERSION").into(),
            extensions: super::GRPC_EXTENSIONS.iter().map(|&e| e.into()).collect(),
        }))
    }

    async fn model_metadata(
        &self,
        req: Request<ModelMetadataRequest>,
    ) -> Answer<ModelMetadataResponse> {
        let r = req.get_ref();
        let m = self.state.models.get(&r.name, version(&r.version))?;
        let list = |specs: &[super::model::TensorSpec]| -> Vec<TensorMetadata> {
            specs
                .iter()
                .map(|s| TensorMetadata {
                    name: s.name.clone(),
                    datatype: datatype(s.dtype).into(),
                    shape: m.info.shape(s),
                })
                .collect()
        };
        Ok(Response::new(ModelMetadataResponse {
            name: m.info.name.clone(),
            versions: vec![m.info.version.clone()],
            platform: super::PLATFORM.into(),
            inputs: list(&m.info.inputs),
            outputs: list(&m.info.outputs),
        }))
    }

    async fn model_infer(&self, req: Request<ModelInferRequest>) -> Answer<ModelInferResponse> {
        let _permit = self.state.permit()?;
        let req = req.into_inner();
        let name = req.model_name.clone();
        let ver = version(&req.model_version).map(str::to_owned);
        let id = req.id.clone();
        let model = self.state.models.get(&name, ver.as_deref())?;
        let d = decode(&model.info, req)?;
        let (model, picked) = infer::run(
            &self.state,
            model,
            &name,
            ver.as_deref(),
            d.rows,
            d.feeds,
            d.outputs.iter().map(String::as_str),
        )
        .await?;
        let mut outputs = Vec::with_capacity(picked.len());
        let mut raw = Vec::with_capacity(picked.len());
        for (o, t) in d.outputs.into_iter().zip(picked) {
            outputs.push(InferOutputTensor {
                name: o,
                datatype: datatype(t.dtype()).into(),
                shape: shape_i64(t.shape().dims()),
                parameters: Default::default(),
                contents: None,
            });
            raw.push(tensors::le_bytes(&t).into_owned());
        }
        Ok(Response::new(ModelInferResponse {
            model_name: model.info.name.clone(),
            model_version: model.info.version.clone(),
            id,
            parameters: Default::default(),
            outputs,
            raw_output_contents: raw,
        }))
    }

    async fn model_statistics(
        &self,
        req: Request<ModelStatisticsRequest>,
    ) -> Answer<ModelStatisticsResponse> {
        let r = req.get_ref();
        let models = if r.name.is_empty() {
            self.state.models.ready()
        } else {
            vec![self.state.models.get(&r.name, version(&r.version))?]
        };
        let model_stats = models
            .iter()
            .map(|m| statistics(&m.stats.json(&m.info.name, &m.info.version)))
            .collect();
        Ok(Response::new(ModelStatisticsResponse { model_stats }))
    }

    async fn repository_index(
        &self,
        req: Request<RepositoryIndexRequest>,
    ) -> Answer<RepositoryIndexResponse> {
        let models = control::index(&self.state, req.get_ref().ready)
            .into_iter()
            .map(|e| ModelIndex {
                name: e.name,
                version: e.version.unwrap_or_default(),
                state: e.state.to_string(),
                reason: e.reason.unwrap_or_default(),
            })
            .collect();
        Ok(Response::new(RepositoryIndexResponse { models }))
    }

    async fn repository_model_load(
        &self,
        req: Request<RepositoryModelLoadRequest>,
    ) -> Answer<RepositoryModelLoadResponse> {
        let _permit = self.state.permit()?;
        let r = req.into_inner();
        control::load(&self.state, r.model_name, params(r.parameters)?).await?;
        Ok(Response::new(RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        req: Request<RepositoryModelUnloadRequest>,
    ) -> Answer<RepositoryModelUnloadResponse> {
        let r = req.into_inner();
        params(r.parameters)?;
        control::unload(&self.state, r.model_name).await?;
        Ok(Response::new(RepositoryModelUnloadResponse {}))
    }
}
