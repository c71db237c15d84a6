//! A captured job saved to a directory, to run it again without its
//! framework: `lanes bench train --job DIR` times and profiles it on the
//! executor. Written by importers that build graphs outside Rust
//! (`lanes.torch`'s `save_to=`).
//!
//! The directory holds `job.json` (the graph in its serde form, what to
//! fetch and whether a Run trains), `variables.safetensors` (the initial
//! values, a checkpoint as `crate::checkpoint` writes it) and
//! `feeds.safetensors` (one example of every placeholder). Loading checks
//! sizes, formats, that every variable is present with its type and that
//! the feeds are exactly the graph's placeholders.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::checkpoint::{self, CheckpointError};
use crate::graph::{Graph, Op, VarValues};

/// Largest `job.json` read (graphs are small; weights live beside them).
pub const MAX_JOB_JSON: u64 = 256 << 20;

/// A job as saved: graph, fetch key, kind, initial values, example feeds.
#[derive(Debug, Clone)]
pub struct SavedJob {
    pub graph: Graph,
    /// The fetch key a Run returns (the loss when training).
    pub fetch: String,
    /// True when one Run is a training step.
    pub training: bool,
    pub vars: VarValues,
    pub feeds: VarValues,
}

#[derive(Serialize, Deserialize)]
struct Header {
    version: u32,
    fetch: String,
    training: bool,
    graph: Graph,
}

const VERSION: u32 = 1;

/// Why a job could not be saved or loaded.
#[derive(Debug, thiserror::Error)]
pub enum SavedError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error("{0}")]
    Checkpoint(#[from] CheckpointError),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SavedError + '_ {
    move |source| SavedError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `job` into `dir` (created if missing).
pub fn save(dir: impl AsRef<Path>, job: &SavedJob) -> Result<(), SavedError> {
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let header = Header {
        version: VERSION,
        fetch: job.fetch.clone(),
        training: job.training,
        graph: job.graph.clone(),
    };
    let path = dir.join("job.json");
    let text = serde_json::to_vec(&header).map_err(|e| SavedError::Format {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    std::fs::write(&path, text).map_err(io(&path))?;
    checkpoint::save(dir.join("variables.safetensors"), &job.vars)?;
    checkpoint::save(dir.join("feeds.safetensors"), &job.feeds)?;
    Ok(())
}

/// Reads a job [`save`] wrote, checking it (see the module's documentation).
pub fn load(dir: impl AsRef<Path>) -> Result<SavedJob, SavedError> {
    let dir = dir.as_ref();
    let path = dir.join("job.json");
    let bad = |reason: String| SavedError::Format {
        path: path.clone(),
        reason,
    };
    let len = std::fs::metadata(&path).map_err(io(&path))?.len();
    if len > MAX_JOB_JSON {
        return Err(bad(format!(
            "{len} bytes, more than the {MAX_JOB_JSON} a job file may have"
        )));
    }
    let text = std::fs::read(&path).map_err(io(&path))?;
    let h: Header = serde_json::from_slice(&text).map_err(|e| bad(e.to_string()))?;
    if h.version != VERSION {
        return Err(bad(format!(
            "version {} (this build reads version {VERSION})",
            h.version
        )));
    }
    if h.graph.resolve(&h.fetch).is_none() {
        return Err(bad(format!("no node `{}` to fetch", h.fetch)));
    }
    let vars = checkpoint::load_for(dir.join("variables.safetensors"), &h.graph)?;
    let feeds_path = dir.join("feeds.safetensors");
    let mut feeds = checkpoint::load(&feeds_path)?;
    let mut wanted = VarValues::new();
    for n in &h.graph.nodes {
        if let Op::Placeholder(ty) = &n.op {
            let t = feeds.remove(&n.name).ok_or_else(|| SavedError::Format {
                path: feeds_path.clone(),
                reason: format!("no example for placeholder `{}`", n.name),
            })?;
            if &t.ty() != ty {
                return Err(SavedError::Format {
                    path: feeds_path.clone(),
                    reason: format!("`{}` is {} but the graph feeds {ty}", n.name, t.ty()),
                });
            }
            wanted.insert(n.name.clone(), t);
        }
    }
    if let Some(extra) = feeds.keys().next() {
        return Err(SavedError::Format {
            path: feeds_path,
            reason: format!("`{extra}` is not a placeholder of the graph"),
        });
    }
    Ok(SavedJob {
        graph: h.graph,
        fetch: h.fetch,
        training: h.training,
        vars,
        feeds: wanted,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::graph::GraphBuilder;
    use crate::tensor::{Tensor, TensorType};

    fn job() -> SavedJob {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([2, 3]));
        let w = g.variable("w", Tensor::full([3, 4], 0.5));
        let y = g.matmul(x, w);
        g.set_name(y, "y");
        let (graph, vars) = g.finish().unwrap();
        let feeds = VarValues::from([("x".to_string(), Tensor::full([2, 3], 1.0))]);
        SavedJob {
            graph,
            fetch: "y".into(),
            training: false,
            vars,
            feeds,
        }
    }

    #[test]
    fn round_trip_and_checks() {
        let dir = std::env::temp_dir().join(format!("lanes-saved-{}", std::process::id()));
        let j = job();
        save(&dir, &j).unwrap();
        let back = load(&dir).unwrap();
        assert_eq!(back.graph, j.graph);
        assert_eq!(back.vars, j.vars);
        assert_eq!(back.feeds, j.feeds);
        assert_eq!(back.fetch, "y");
        // A feed of the wrong shape is refused, naming it.
        let mut wrong = j.clone();
        wrong.feeds = VarValues::from([("x".to_string(), Tensor::full([3, 3], 1.0))]);
        save(&dir, &wrong).unwrap();
        let e = load(&dir).unwrap_err().to_string();
        assert!(e.contains("`x`"), "{e}");
        // A job saved before graphs had entries (no `entries` key) loads
        // with none.
        save(&dir, &j).unwrap();
        let text = std::fs::read_to_string(dir.join("job.json")).unwrap();
        assert!(text.contains(",\"entries\":[]"), "{text}");
        std::fs::write(dir.join("job.json"), text.replace(",\"entries\":[]", "")).unwrap();
        assert_eq!(load(&dir).unwrap().graph, j.graph);
        // A file that is not a job.
        std::fs::write(dir.join("job.json"), b"{\"version\": 1}").unwrap();
        assert!(matches!(load(&dir), Err(SavedError::Format { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
