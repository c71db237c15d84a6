//! Triton's model repository extension (index, load, unload) as both
//! doors serve it: each reads its own message into these forms (a load's
//! parameters as [`Param`]s) and writes the answer back in its own; what a
//! request means, and the loading itself, is here once.

use std::sync::Arc;

use super::error::ApiError;
use super::infer::State;
use super::model::{IndexEntry, ModelState};
use super::repository::{file_version, parse_config_json, ModelConfig, MODEL_FILE};

/// A load or unload parameter as a door read it: the protocol's kinds.
#[derive(Debug, Clone, PartialEq)]
pub enum Param {
    Bool(bool),
    Int(i64),
    Text(String),
    /// A file's bytes (gRPC's `bytes_param`; base64 over HTTP, decoded by
    /// the door).
    Bytes(Vec<u8>),
}

impl Param {
    /// The kind's name, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            Param::Bool(_) => "a boolean",
            Param::Int(_) => "an integer",
            Param::Text(_) => "a string",
            Param::Bytes(_) => "bytes",
        }
    }
}

/// The repository's models and those loaded from requests, with their
/// states; only those loaded now with `only_ready`.
pub fn index(state: &State, only_ready: bool) -> Vec<IndexEntry> {
    state
        .models
        .index()
        .into_iter()
        .filter(|e| !only_ready || e.state == ModelState::Ready)
        .collect()
}

/// What a load request brings besides the model's name (Triton's
/// override of the repository): a configuration, a model file.
#[derive(Debug, Default, PartialEq)]
pub struct Override {
    /// The `config` parameter, read; the repository's `config.pbtxt` is
    /// not.
    pub config: Option<ModelConfig>,
    /// The `file:VERSION/model.onnx` parameter: the version and the
    /// file's bytes; the repository is not read.
    pub file: Option<(u64, Vec<u8>)>,
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::BadRequest(msg.into())
}

/// Reads a load's parameters: `config` (a string), at most one
/// `file:VERSION/model.onnx` (bytes), and `config` wherever a file is
/// sent. Parameters of other names are ignored, as Triton does.
pub fn override_of(params: Vec<(String, Param)>) -> Result<Override, ApiError> {
    let mut over = Override::default();
    let mut file_param: Option<String> = None;
    for (k, v) in params {
        if k == "config" {
            let Param::Text(text) = v else {
                return Err(bad(format!(
                    "parameter `config` must be a string (the model configuration as JSON), not {}",
                    v.kind()
                )));
            };
            let c =
                parse_config_json(&text).map_err(|e| bad(format!("parameter `config`: {e}")))?;
            over.config = Some(c);
        } else if k.starts_with("file:") {
            let Some(version) = file_version(&k) else {
                return Err(bad(format!(
                    "parameter `{k}`: only `file:VERSION/{MODEL_FILE}` (an ONNX model, VERSION a positive integer) is read"
                )));
            };
            let Param::Bytes(bytes) = v else {
                return Err(bad(format!(
                    "parameter `{k}` must be the file's bytes (bytes_param over gRPC, base64 over HTTP), not {}",
                    v.kind()
                )));
            };
            if let Some(first) = &file_param {
                return Err(bad(format!(
                    "one model file per load: `{first}` and `{k}` were sent"
                )));
            }
            file_param = Some(k);
            over.file = Some((version, bytes));
        }
    }
    if over.file.is_some() && over.config.is_none() {
        return Err(bad(
            "a load that sends a model file needs the `config` parameter too (the model configuration as JSON; `{}` for the defaults)",
        ));
    }
    Ok(over)
}

/// Loads (or reloads) `name`: from the repository, or from the model
/// file and configuration the parameters carry (a later load without them
/// reads the repository again).
pub async fn load(
    state: &Arc<State>,
    name: String,
    params: Vec<(String, Param)>,
) -> Result<(), ApiError> {
    let over = override_of(params)?;
    let st = Arc::clone(state);
    tokio::task::spawn_blocking(move || st.models.load(&name, over))
        .await
        .map_err(|e| ApiError::Internal(format!("the load stopped: {e}")))?
}

/// Unloads `name` once its queued requests are served. Parameters
/// (`unload_dependents`) change nothing: no model depends on another.
pub async fn unload(state: &Arc<State>, name: String) -> Result<(), ApiError> {
    let st = Arc::clone(state);
    tokio::task::spawn_blocking(move || st.models.unload(&name))
        .await
        .map_err(|e| ApiError::Internal(format!("the unload stopped: {e}")))?
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn p(k: &str, v: Param) -> (String, Param) {
        (k.to_string(), v)
    }

    fn refused(params: Vec<(String, Param)>) -> String {
        match override_of(params) {
            Err(ApiError::BadRequest(m)) => m,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_file_and_its_config_are_read() {
        let o = override_of(vec![
            p("config", Param::Text(r#"{"max_batch_size": 2}"#.into())),
            p("file:3/model.onnx", Param::Bytes(vec![1, 2])),
            p("unload_dependents", Param::Bool(true)),
        ])
        .unwrap();
        assert_eq!(o.config.unwrap().max_batch_size, Some(2));
        assert_eq!(o.file, Some((3, vec![1, 2])));
        // No parameters: the repository as it is.
        assert_eq!(override_of(vec![]).unwrap(), Override::default());
        let o = override_of(vec![p("config", Param::Text("{}".into()))]).unwrap();
        assert_eq!(o.config, Some(ModelConfig::default()));
        assert_eq!(o.file, None);
    }

    #[test]
    fn bad_parameters_say_what_is_wrong() {
        let cfg = || p("config", Param::Text("{}".into()));
        let e = refused(vec![p("file:1/model.onnx", Param::Bytes(vec![1]))]);
        assert!(e.contains("needs the `config` parameter"), "{e}");
        let e = refused(vec![cfg(), p("file:1/model.plan", Param::Bytes(vec![1]))]);
        assert!(e.contains("only `file:VERSION/model.onnx`"), "{e}");
        let e = refused(vec![
            cfg(),
            p("file:1/model.onnx", Param::Text("AAAA".into())),
        ]);
        assert!(
            e.contains("must be the file's bytes") && e.contains("not a string"),
            "{e}"
        );
        let e = refused(vec![
            cfg(),
            p("file:1/model.onnx", Param::Bytes(vec![1])),
            p("file:2/model.onnx", Param::Bytes(vec![2])),
        ]);
        assert!(e.contains("one model file per load"), "{e}");
        let e = refused(vec![p("config", Param::Bytes(vec![b'{', b'}']))]);
        assert!(
            e.contains("`config` must be a string") && e.contains("not bytes"),
            "{e}"
        );
        let e = refused(vec![p("config", Param::Text("max_batch_size: 2".into()))]);
        assert!(e.contains("parameter `config`: not JSON"), "{e}");
    }
}
