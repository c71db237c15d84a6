//! Triton's model configuration extension: a loaded model's
//! configuration, gathered once here ([`of`]) and written as JSON by the
//! REST route (`GET /v2/models/NAME/config`) or as the `ModelConfig`
//! message by the gRPC method.

use lanes_adaptor::DType;
use serde_json::{json, Value};

use super::model::{Model, TensorSpec};
use super::repository::DynamicBatching;
use super::tensors::config_type;

/// An input's or output's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorConfig {
    pub name: String,
    pub dtype: DType,
    /// Without the batch dimension when the model batches.
    pub dims: Vec<i64>,
}

impl TensorConfig {
    /// Triton's name of the element type (`TYPE_FP32`).
    pub fn data_type(&self) -> &'static str {
        config_type(self.dtype)
    }
}

/// What a model's configuration says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelConfig {
    pub name: String,
    pub platform: &'static str,
    pub backend: &'static str,
    /// Versions served (the newest, one).
    pub latest_versions: u32,
    pub max_batch_size: usize,
    pub inputs: Vec<TensorConfig>,
    pub outputs: Vec<TensorConfig>,
    /// One instance group: the model's name, `KIND_MODEL` (the service
    /// places the sessions), one instance.
    pub instances: u32,
    pub dynamic_batching: Option<DynamicBatching>,
}

/// The backend's name in a configuration.
const BACKEND: &str = "lanes";

/// The instance group's kind: the service, not the configuration, places
/// the model.
pub const INSTANCE_KIND: &str = "KIND_MODEL";

fn tensors(specs: &[TensorSpec]) -> Vec<TensorConfig> {
    specs
        .iter()
        .map(|t| TensorConfig {
            name: t.name.clone(),
            dtype: t.dtype,
            dims: t.dims.iter().map(|&d| d as i64).collect(),
        })
        .collect()
}

/// Model `m`'s configuration.
pub fn of(m: &Model) -> ModelConfig {
    ModelConfig {
        name: m.info.name.clone(),
        platform: super::PLATFORM,
        backend: BACKEND,
        latest_versions: 1,
        max_batch_size: m.info.max_batch_size,
        inputs: tensors(&m.info.inputs),
        outputs: tensors(&m.info.outputs),
        instances: 1,
        dynamic_batching: m.info.batching.clone(),
    }
}

impl ModelConfig {
    /// As Triton's REST route writes it.
    pub fn json(&self) -> Value {
        let list = |ts: &[TensorConfig]| -> Vec<Value> {
            ts.iter()
                .map(|t| json!({ "name": t.name, "data_type": t.data_type(), "dims": t.dims }))
                .collect()
        };
        let mut c = json!({
            "name": self.name,
            "platform": self.platform,
            "backend": self.backend,
            "version_policy": { "latest": { "num_versions": self.latest_versions } },
            "max_batch_size": self.max_batch_size,
            "input": list(&self.inputs),
            "output": list(&self.outputs),
            "instance_group": [{ "name": self.name, "kind": INSTANCE_KIND, "count": self.instances }],
        });
        if let Some(b) = &self.dynamic_batching {
            c["dynamic_batching"] = json!({
                "max_queue_delay_microseconds": b.max_queue_delay_us,
                "preferred_batch_size": b.preferred_batch_sizes,
            });
        }
        c
    }
}
