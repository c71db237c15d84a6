//! Checkpoints: a job's variables to and from safetensors files, the format
//! PyTorch users already have. Names are the variable node names; f32 and
//! i64 tensors are stored little-endian as safetensors requires.
//!
//! Loading validates everything: the file's framing and header (through the
//! `safetensors` crate), the dtypes this crate supports, and, with
//! [`load_for`], that every variable of a graph is present with its type.

use crate::graph::{Graph, VarValues};
use crate::tensor::{DType, Tensor, TensorType};
use safetensors::{Dtype, SafeTensorError, SafeTensors};
use std::path::{Path, PathBuf};

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("checkpoint {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a valid safetensors checkpoint: {reason}")]
    Format { reason: String },
    #[error("tensor `{name}` has dtype {dtype}, which Lanes does not support (only F32 and I64)")]
    UnsupportedDtype { name: String, dtype: String },
    #[error("tensor `{name}`: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("checkpoint has no tensor for variable `{name}`")]
    Missing { name: String },
    #[error("variable `{name}` is {expected} in the graph but {got} in the checkpoint")]
    TypeMismatch {
        name: String,
        expected: TensorType,
        got: TensorType,
    },
}

impl From<SafeTensorError> for CheckpointError {
    fn from(e: SafeTensorError) -> Self {
        CheckpointError::Format {
            reason: format!("{e:?}"),
        }
    }
}

/// Serialises variables into safetensors bytes.
pub fn to_bytes(vars: &VarValues) -> Result<Vec<u8>, CheckpointError> {
    let raw: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = vars
        .iter()
        .map(|(n, t)| {
            let dt = match t.dtype() {
                DType::F32 => Dtype::F32,
                DType::I64 => Dtype::I64,
                DType::F16 => Dtype::F16,
                DType::BF16 => Dtype::BF16,
            };
            (n.clone(), dt, t.shape().dims().to_vec(), t.to_le_bytes())
        })
        .collect();
    let mut views = Vec::with_capacity(raw.len());
    for (n, dt, shape, bytes) in &raw {
        views.push((
            n.as_str(),
            safetensors::tensor::TensorView::new(*dt, shape.clone(), bytes)?,
        ));
    }
    Ok(safetensors::serialize(views, &None)?)
}

/// Parses safetensors bytes into variables.
pub fn from_bytes(bytes: &[u8]) -> Result<VarValues, CheckpointError> {
    let st = SafeTensors::deserialize(bytes)?;
    let mut out = VarValues::new();
    for (name, view) in st.iter() {
        let dtype = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::I64 => DType::I64,
            Dtype::F16 => DType::F16,
            Dtype::BF16 => DType::BF16,
            other => {
                return Err(CheckpointError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        let ty = TensorType::new(dtype, view.shape().to_vec());
        let t =
            Tensor::from_le_bytes(&ty, view.data()).map_err(|e| CheckpointError::BadTensor {
                name: name.to_string(),
                reason: e.to_string(),
            })?;
        out.insert(name.to_string(), t);
    }
    Ok(out)
}

/// Writes variables to a safetensors file.
pub fn save(path: impl AsRef<Path>, vars: &VarValues) -> Result<(), CheckpointError> {
    let path = path.as_ref();
    let bytes = to_bytes(vars)?;
    std::fs::write(path, bytes).map_err(|source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads every tensor of a safetensors file.
pub fn load(path: impl AsRef<Path>) -> Result<VarValues, CheckpointError> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    from_bytes(&bytes)
}

/// Reads a checkpoint for `graph`: every variable of the graph must be
/// present with its declared type; tensors the graph does not use are ignored
/// (e.g. optimizer state when loading into an inference graph).
pub fn load_for(path: impl AsRef<Path>, graph: &Graph) -> Result<VarValues, CheckpointError> {
    let mut all = load(path)?;
    select_for(&mut all, graph)
}

/// Picks `graph`'s variables out of `all`, checking names and types.
pub fn select_for(all: &mut VarValues, graph: &Graph) -> Result<VarValues, CheckpointError> {
    let mut out = VarValues::new();
    for (_, name, ty) in graph.variables() {
        let t = all.remove(name).ok_or_else(|| CheckpointError::Missing {
            name: name.to_string(),
        })?;
        if &t.ty() != ty {
            return Err(CheckpointError::TypeMismatch {
                name: name.to_string(),
                expected: ty.clone(),
                got: t.ty(),
            });
        }
        out.insert(name.to_string(), t);
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::graph::GraphBuilder;

    fn vars() -> VarValues {
        let mut v = VarValues::new();
        v.insert(
            "a/weight".into(),
            Tensor::from_f32([2, 2], vec![1.0, -2.0, 3.5, f32::MIN]).unwrap(),
        );
        v.insert("step".into(), Tensor::from_i64([1], vec![42]).unwrap());
        v
    }

    #[test]
    fn round_trip_is_exact() {
        let b = to_bytes(&vars()).unwrap();
        assert_eq!(from_bytes(&b).unwrap(), vars());
    }

    #[test]
    fn bad_bytes_are_typed_errors() {
        assert!(matches!(
            from_bytes(b"nonsense"),
            Err(CheckpointError::Format { .. })
        ));
        let mut b = to_bytes(&vars()).unwrap();
        b.truncate(b.len() - 3);
        assert!(matches!(
            from_bytes(&b),
            Err(CheckpointError::Format { .. })
        ));
        let raw = [0u8; 4];
        let view = safetensors::tensor::TensorView::new(Dtype::I32, vec![1], &raw).unwrap();
        let b = safetensors::serialize([("h", view)], &None).unwrap();
        assert!(matches!(
            from_bytes(&b),
            Err(CheckpointError::UnsupportedDtype { .. })
        ));
    }

    #[test]
    fn half_tensors_round_trip_with_safetensors_dtypes() {
        let mut v = VarValues::new();
        let h: Vec<crate::f16> = [1.0f32, -0.5, 65504.0]
            .iter()
            .map(|&x| crate::f16::from_f32(x))
            .collect();
        let b: Vec<crate::bf16> = [3.0f32, -1.0e30]
            .iter()
            .map(|&x| crate::bf16::from_f32(x))
            .collect();
        v.insert("h".into(), Tensor::from_f16([3], h).unwrap());
        v.insert("b".into(), Tensor::from_bf16([1, 2], b).unwrap());
        let bytes = to_bytes(&v).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("h").unwrap().dtype(), Dtype::F16);
        assert_eq!(st.tensor("b").unwrap().dtype(), Dtype::BF16);
        // 1.0 as f16 is 0x3c00, stored little-endian.
        assert_eq!(&st.tensor("h").unwrap().data()[..2], &[0x00, 0x3c]);
        assert_eq!(from_bytes(&bytes).unwrap(), v);
    }

    #[test]
    fn load_for_checks_names_and_types() {
        let dir = std::env::temp_dir().join(format!("lanes-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.safetensors");
        save(&path, &vars()).unwrap();
        let mut g = GraphBuilder::new();
        g.variable("a/weight", Tensor::full([2, 2], 0.0));
        let (graph, _) = g.finish().unwrap();
        let got = load_for(&path, &graph).unwrap();
        assert_eq!(got.len(), 1);
        let mut g = GraphBuilder::new();
        g.variable("a/weight", Tensor::full([4], 0.0));
        let (graph, _) = g.finish().unwrap();
        assert!(matches!(
            load_for(&path, &graph),
            Err(CheckpointError::TypeMismatch { .. })
        ));
        let mut g = GraphBuilder::new();
        g.variable("other", Tensor::full([4], 0.0));
        let (graph, _) = g.finish().unwrap();
        assert!(matches!(
            load_for(&path, &graph),
            Err(CheckpointError::Missing { .. })
        ));
        assert!(matches!(
            load(dir.join("absent")),
            Err(CheckpointError::Io { .. })
        ));
        std::fs::remove_dir_all(&dir).ok();
    }
}
