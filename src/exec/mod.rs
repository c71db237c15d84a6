//! Executors. [`cpu`] is the reference backend: every op runs on it and the
//! CUDA backend is tested against it.
//!
//! Kernels see tensors as typed slices plus their type, so the same kernel
//! serves tensors held in their own buffers and tensors placed in an arena.

pub mod cpu;
pub mod cuda;
mod program;

pub use program::{Backend, GpuShare, Program};

use std::sync::Arc;

use lanes_adaptor::wire::shm::{AttachedSegment, SharedFeed};
use lanes_adaptor::{DType, Tensor, TensorData, TensorType};

/// A feed's values as the executors read them: a decoded [`Tensor`], or a
/// [`SharedFeed`], a view of the job's shared-memory segment that is read
/// where the job wrote it (the CPU backend copies it into its arena, the
/// CUDA backend copies it to the device from the segment, registered
/// page-locked once).
pub trait HostFeed {
    fn ty(&self) -> TensorType;
    /// The values as little-endian bytes (`ty().bytes()` of them).
    fn bytes(&self) -> &[u8];
    /// The values as a tensor (a fetched placeholder).
    fn to_tensor(&self) -> Result<Tensor, ExecError>;
    /// The shared segment the bytes lie in, if any.
    fn segment(&self) -> Option<&Arc<AttachedSegment>> {
        None
    }
    /// Where in that segment they start.
    fn offset(&self) -> Option<usize> {
        None
    }
}

impl HostFeed for Tensor {
    fn ty(&self) -> TensorType {
        Tensor::ty(self)
    }
    fn bytes(&self) -> &[u8] {
        match self.data() {
            TensorData::F32(v) => bytemuck::cast_slice(v),
            TensorData::I64(v) => bytemuck::cast_slice(v),
        }
    }
    fn to_tensor(&self) -> Result<Tensor, ExecError> {
        Ok(self.clone())
    }
}

impl HostFeed for SharedFeed {
    fn ty(&self) -> TensorType {
        self.ty.clone()
    }
    fn bytes(&self) -> &[u8] {
        SharedFeed::bytes(self)
    }
    fn to_tensor(&self) -> Result<Tensor, ExecError> {
        SharedFeed::to_tensor(self, None).map_err(|e| ExecError::Op {
            node: self.name.clone(),
            op: "placeholder",
            reason: e.to_string(),
        })
    }
    fn segment(&self) -> Option<&Arc<AttachedSegment>> {
        Some(SharedFeed::segment(self))
    }
    fn offset(&self) -> Option<usize> {
        Some(SharedFeed::offset(self))
    }
}

/// Read-only view of a tensor's values.
#[derive(Debug, Clone, Copy)]
pub enum DataRef<'a> {
    F32(&'a [f32]),
    I64(&'a [i64]),
}

/// Writable view of a tensor's values.
#[derive(Debug)]
pub enum DataMut<'a> {
    F32(&'a mut [f32]),
    I64(&'a mut [i64]),
}

/// A tensor input of a kernel.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    pub ty: &'a TensorType,
    pub data: DataRef<'a>,
}

/// A tensor a kernel writes: an output, or a variable updated in place.
#[derive(Debug)]
pub struct TensorMut<'a> {
    pub ty: &'a TensorType,
    pub data: DataMut<'a>,
}

impl<'a> TensorRef<'a> {
    pub fn f32s(&self) -> Result<&'a [f32], ExecError> {
        match self.data {
            DataRef::F32(v) => Ok(v),
            DataRef::I64(_) => Err(ExecError::dtype(DType::F32, DType::I64)),
        }
    }
    pub fn i64s(&self) -> Result<&'a [i64], ExecError> {
        match self.data {
            DataRef::I64(v) => Ok(v),
            DataRef::F32(_) => Err(ExecError::dtype(DType::I64, DType::F32)),
        }
    }
    pub fn dims(&self) -> &'a [usize] {
        self.ty.shape.dims()
    }
}

impl TensorMut<'_> {
    pub fn f32s(&mut self) -> Result<&mut [f32], ExecError> {
        match &mut self.data {
            DataMut::F32(v) => Ok(v),
            DataMut::I64(_) => Err(ExecError::dtype(DType::F32, DType::I64)),
        }
    }
    pub fn i64s(&mut self) -> Result<&mut [i64], ExecError> {
        match &mut self.data {
            DataMut::I64(v) => Ok(v),
            DataMut::F32(_) => Err(ExecError::dtype(DType::I64, DType::F32)),
        }
    }
    pub fn dims(&self) -> &[usize] {
        self.ty.shape.dims()
    }
}

/// Why an iteration could not run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExecError {
    #[error("no feed for placeholder `{name}`")]
    MissingFeed { name: String },
    #[error("feed `{name}` does not name a placeholder")]
    UnknownFeed { name: String },
    #[error("feed `{name}` must be {expected}, got {got}")]
    FeedType {
        name: String,
        expected: TensorType,
        got: TensorType,
    },
    #[error("fetch `{key}` names no output of the graph")]
    UnknownFetch { key: String },
    #[error("variable `{name}` has no value")]
    MissingVariable { name: String },
    #[error("variable `{name}` must be {expected}, got {got}")]
    VariableType {
        name: String,
        expected: TensorType,
        got: TensorType,
    },
    #[error("node `{node}` ({op}): {reason}")]
    Op {
        node: String,
        op: &'static str,
        reason: String,
    },
    #[error("kernel expected {expected} data, got {got}")]
    DType { expected: DType, got: DType },
    #[error("device unavailable: {reason}")]
    NoDevice { reason: String },
}

impl ExecError {
    pub fn dtype(expected: DType, got: DType) -> Self {
        ExecError::DType { expected, got }
    }
}
