//! What the HTTP and gRPC front doors share: the models' table and the
//! limits (one [`State`]), and the way a checked request is run on its
//! model ([`run`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use lanes_adaptor::Tensor;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::ApiError;
use super::model::{Job, Model, Models};
use super::shm::Regions;
use super::tensors::Feed;
use super::OipConfig;

/// What the front doors share.
#[derive(Debug)]
pub struct State {
    pub models: Models,
    /// The shared memory regions registered (Triton's system shared
    /// memory extension; refusing all when it is off).
    pub shm: Regions,
    /// Largest request (an HTTP body, a gRPC message).
    pub max_body: usize,
    in_flight: Arc<Semaphore>,
    max_in_flight: usize,
    stopping: Option<Arc<AtomicBool>>,
}

impl State {
    pub fn new(models: Models, config: &OipConfig) -> State {
        State {
            models,
            shm: Regions::new(config.system_shared_memory, config.shm_limits),
            max_body: config.max_body_bytes,
            in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
            max_in_flight: config.max_in_flight,
            stopping: config.stopping.clone(),
        }
    }

    /// Whether the service takes requests (not once it is stopping).
    pub fn ready(&self) -> bool {
        !self
            .stopping
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Relaxed))
    }

    /// A place among the requests in flight that may carry large bodies
    /// (inference, and loads with their model files; over both front
    /// doors), or the refusal when all are taken.
    pub fn permit(&self) -> Result<OwnedSemaphorePermit, ApiError> {
        Arc::clone(&self.in_flight)
            .try_acquire_owned()
            .map_err(|_| {
                ApiError::Overloaded(format!(
                    "{} inference and load requests are in flight already (--http-max-in-flight)",
                    self.max_in_flight
                ))
            })
    }
}

/// Runs checked `feeds` of `rows` rows on `model` (found as `name` at
/// `version`) and returns the outputs named in `wanted`, in that order,
/// with the model that answered.
pub async fn run<'a>(
    state: &State,
    model: Arc<Model>,
    name: &str,
    version: Option<&str>,
    rows: usize,
    feeds: Vec<(String, Feed)>,
    wanted: impl Iterator<Item = &'a str>,
) -> Result<(Arc<Model>, Vec<Tensor>), ApiError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let job = Job {
        rows,
        feeds,
        arrived: Instant::now(),
        reply: tx,
    };
    // A reload replaces the model while requests are on their way: those
    // that reach the old one after it stopped go to the new one (whose
    // service session checks the feeds again).
    let model = match model.submit(job) {
        Ok(()) => model,
        Err((e, job)) => match state.models.get(name, version) {
            Ok(now) if !Arc::ptr_eq(&now, &model) => {
                now.submit(job).map_err(|(e, _)| e)?;
                now
            }
            _ => return Err(e),
        },
    };
    let outputs = rx
        .await
        .map_err(|_| ApiError::Internal(format!("model `{name}` stopped before answering")))??;
    let mut outputs: Vec<Option<Tensor>> = outputs.into_iter().map(Some).collect();
    let mut picked = Vec::new();
    for w in wanted {
        let t = model
            .info
            .outputs
            .iter()
            .position(|o| o.name == w)
            .and_then(|k| outputs.get_mut(k))
            .and_then(Option::take)
            .ok_or_else(|| ApiError::Internal(format!("model `{name}` did not return `{w}`")))?;
        picked.push(t);
    }
    Ok((model, picked))
}
