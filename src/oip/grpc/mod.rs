//! The Open Inference Protocol over gRPC (`lanes serve --grpc ADDR`): the
//! service `inference.GRPCInferenceService` on tonic.
//!
//! A thin front door beside the REST one: it reads a request from the
//! protocol's messages and hands it to the same models' table, checks and
//! batching (`super::infer`, `super::tensors`); only the reading and the
//! writing are its own. Inputs come as `raw_input_contents` (what
//! tritonclient sends), as typed `contents` or in a registered shared
//! memory region (`super::shm`); outputs go back as `raw_output_contents`
//! or into a region. Request messages may be gzip- or
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
use super::config;
use super::control::{self, Param};
use super::error::ApiError;
use super::infer::{self, State};
use super::model::ModelInfo;
use super::response;
use super::shm::{self, ParamValue, Regions, ShmSlice};
use super::tensors::{self, datatype, Feeds};
use proto::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use proto::infer_parameter::ParameterChoice as InferChoice;
use proto::model_infer_request::InferInputTensor;
use proto::model_infer_response::InferOutputTensor;
use proto::model_metadata_response::TensorMetadata;
use proto::model_repository_parameter::ParameterChoice;
use proto::repository_index_response::ModelIndex;
use proto::system_shared_memory_status_response::RegionStatus;
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
    /// The outputs asked for (all, in the model's order, when none named),
    /// and the shared memory each is to be written into, if any.
    outputs: Vec<(String, Option<ShmSlice>)>,
}

/// A gRPC parameter as [`shm::params`] reads it.
fn grpc_param(p: &InferParameter) -> ParamValue<'_> {
    match &p.parameter_choice {
        Some(InferChoice::StringParam(s)) => ParamValue::Text(s),
        Some(InferChoice::Int64Param(i)) => ParamValue::Int(*i),
        Some(InferChoice::Uint64Param(u)) => ParamValue::UInt(*u),
        _ => ParamValue::Other,
    }
}

/// The shared memory parameters of a tensor's `parameters`.
fn grpc_shm(
    what: &str,
    tensor: &str,
    params: &std::collections::HashMap<String, InferParameter>,
) -> Result<Option<shm::ShmParams>, ApiError> {
    shm::params(what, tensor, |k| params.get(k).map(grpc_param))
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

/// Reads and checks an inference request's tensors; inputs and outputs
/// in shared memory are looked up in `regions`.
fn decode(
    model: &ModelInfo,
    req: ModelInferRequest,
    regions: &Regions,
) -> Result<Decoded, ApiError> {
    let mut raw = req.raw_input_contents;
    // raw_input_contents are the inputs' not in shared memory, in order.
    let mut in_shm = Vec::with_capacity(req.inputs.len());
    for input in &req.inputs {
        in_shm.push(grpc_shm("input", &input.name, &input.parameters)?);
    }
    let not_shm = in_shm.iter().filter(|p| p.is_none()).count();
    if !raw.is_empty() && raw.len() != not_shm {
        return Err(bad(format!(
            "{} raw_input_contents for {not_shm} inputs not in shared memory: give one per input, in the inputs' order",
            raw.len(),
        )));
    }
    let mut feeds = Feeds::new(model);
    let mut next_raw = 0usize;
    for (mut input, shm_params) in req.inputs.into_iter().zip(in_shm) {
        let slot = feeds.check(&input.name, &input.datatype, &input.shape)?;
        let contents = input.contents.take();
        if let Some(p) = shm_params {
            if contents.is_some() {
                return Err(bad(format!(
                    "input `{}` names a shared memory region and also carries contents",
                    input.name
                )));
            }
            let feed = tensors::shm_feed(regions, &input.name, &slot, &p)?;
            feeds.put(slot, feed);
            continue;
        }
        let i = next_raw;
        next_raw += 1;
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
        model
            .outputs
            .iter()
            .map(|s| (s.name.clone(), None))
            .collect()
    } else {
        let mut v: Vec<(String, Option<ShmSlice>)> = Vec::with_capacity(req.outputs.len());
        for o in req.outputs {
            tensors::check_output(model, &o.name, v.iter().map(|(n, _)| n.as_str()))?;
            let slice = grpc_shm("output", &o.name, &o.parameters)?
                .map(|p| regions.slice("output", &o.name, &p, None))
                .transpose()?;
            v.push((o.name, slice));
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

/// A model's configuration as the protocol's message.
fn config_message(c: &config::ModelConfig) -> ModelConfig {
    let data_type = |t: &config::TensorConfig| {
        DataType::from_str_name(t.data_type()).unwrap_or(DataType::TypeInvalid) as i32
    };
    let int = |n: usize| i32::try_from(n).unwrap_or(i32::MAX);
    ModelConfig {
        name: c.name.clone(),
        platform: c.platform.into(),
        backend: c.backend.into(),
        version_policy: Some(ModelVersionPolicy {
            policy_choice: Some(model_version_policy::PolicyChoice::Latest(
                model_version_policy::Latest {
                    num_versions: c.latest_versions,
                },
            )),
        }),
        max_batch_size: int(c.max_batch_size),
        input: c
            .inputs
            .iter()
            .map(|t| ModelInput {
                name: t.name.clone(),
                data_type: data_type(t),
                dims: t.dims.clone(),
            })
            .collect(),
        output: c
            .outputs
            .iter()
            .map(|t| ModelOutput {
                name: t.name.clone(),
                data_type: data_type(t),
                dims: t.dims.clone(),
            })
            .collect(),
        instance_group: vec![ModelInstanceGroup {
            name: c.name.clone(),
            count: i32::try_from(c.instances).unwrap_or(i32::MAX),
            kind: model_instance_group::Kind::from_str_name(config::INSTANCE_KIND)
                .unwrap_or_default() as i32,
        }],
        dynamic_batching: c.dynamic_batching.as_ref().map(|b| ModelDynamicBatching {
            preferred_batch_size: b.preferred_batch_sizes.iter().map(|&n| int(n)).collect(),
            max_queue_delay_microseconds: b.max_queue_delay_us,
        }),
    }
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
            extensions: super::extensions(&super::GRPC_EXTENSIONS, self.state.shm.enabled())
                .into_iter()
                .map(String::from)
                .collect(),
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

    async fn model_config(&self, req: Request<ModelConfigRequest>) -> Answer<ModelConfigResponse> {
        let r = req.get_ref();
        let m = self.state.models.get(&r.name, version(&r.version))?;
        Ok(Response::new(ModelConfigResponse {
            config: Some(config_message(&config::of(&m))),
        }))
    }

    async fn model_infer(&self, req: Request<ModelInferRequest>) -> Answer<ModelInferResponse> {
        let _permit = self.state.permit()?;
        let req = req.into_inner();
        let name = req.model_name.clone();
        let ver = version(&req.model_version).map(str::to_owned);
        let id = req.id.clone();
        let model = self.state.models.get(&name, ver.as_deref())?;
        let d = decode(&model.info, req, &self.state.shm)?;
        let (model, picked) = infer::run(
            &self.state,
            model,
            &name,
            ver.as_deref(),
            d.rows,
            d.feeds,
            d.outputs.iter().map(|(n, _)| n.as_str()),
        )
        .await?;
        response::write_shm_outputs(
            d.outputs.iter().map(|(n, s)| (n.as_str(), s.as_ref())),
            &picked,
        )?;
        // raw_output_contents are read by position among the outputs
        // (tritonclient's as_numpy): an output in shared memory keeps its
        // place with an empty entry, unless every output is in shared
        // memory (then there are none).
        let all_shm = d.outputs.iter().all(|(_, s)| s.is_some());
        let mut outputs = Vec::with_capacity(picked.len());
        let mut raw = Vec::with_capacity(picked.len());
        for ((o, slice), t) in d.outputs.into_iter().zip(picked) {
            let mut parameters = std::collections::HashMap::new();
            if let Some(s) = &slice {
                for (k, v) in response::shm_answer(s, &t) {
                    let choice = match v {
                        ParamValue::Text(x) => InferChoice::StringParam(x.to_string()),
                        ParamValue::Int(i) => InferChoice::Int64Param(i),
                        ParamValue::UInt(u) => {
                            InferChoice::Int64Param(i64::try_from(u).unwrap_or(i64::MAX))
                        }
                        ParamValue::Other => continue,
                    };
                    parameters.insert(
                        k.to_string(),
                        InferParameter {
                            parameter_choice: Some(choice),
                        },
                    );
                }
            }
            outputs.push(InferOutputTensor {
                name: o,
                datatype: datatype(t.dtype()).into(),
                shape: shape_i64(t.shape().dims()),
                parameters,
                contents: None,
            });
            match slice {
                Some(_) if all_shm => {}
                Some(_) => raw.push(Vec::new()),
                None => raw.push(response::le_bytes(&t).into_owned()),
            }
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

    async fn system_shared_memory_status(
        &self,
        req: Request<SystemSharedMemoryStatusRequest>,
    ) -> Answer<SystemSharedMemoryStatusResponse> {
        let name = &req.get_ref().name;
        let list = self
            .state
            .shm
            .status((!name.is_empty()).then_some(name.as_str()))?;
        let regions = list
            .into_iter()
            .map(|r| {
                let status = RegionStatus {
                    name: r.name.clone(),
                    key: r.key,
                    offset: r.offset,
                    byte_size: r.byte_size,
                };
                (r.name, status)
            })
            .collect();
        Ok(Response::new(SystemSharedMemoryStatusResponse { regions }))
    }

    async fn system_shared_memory_register(
        &self,
        req: Request<SystemSharedMemoryRegisterRequest>,
    ) -> Answer<SystemSharedMemoryRegisterResponse> {
        let r = req.get_ref();
        self.state
            .shm
            .register(&r.name, &r.key, r.offset, r.byte_size)?;
        Ok(Response::new(SystemSharedMemoryRegisterResponse {}))
    }

    async fn system_shared_memory_unregister(
        &self,
        req: Request<SystemSharedMemoryUnregisterRequest>,
    ) -> Answer<SystemSharedMemoryUnregisterResponse> {
        let name = &req.get_ref().name;
        self.state
            .shm
            .unregister((!name.is_empty()).then_some(name.as_str()))?;
        Ok(Response::new(SystemSharedMemoryUnregisterResponse {}))
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
