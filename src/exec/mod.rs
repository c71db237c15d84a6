//! Executors. [`cpu`] is the reference backend: every op runs on it and the
//! CUDA backend is tested against it.
//!
//! Kernels see tensors as typed slices plus their type, so the same kernel
//! serves tensors held in their own buffers and tensors placed in an arena.

pub mod cpu;
pub mod cuda;
pub mod gate;
mod program;

pub use program::{Backend, GpuShare, Program, StandbyTimes};

use std::sync::Arc;

use lanes_adaptor::wire::shm::{AttachedSegment, SharedFeed};
use lanes_adaptor::{bf16, f16, DType, Tensor, TensorData, TensorType};

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
        self.data().ne_bytes()
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

/// What fills a Run's output places (one per output, in order), given to
/// [`FetchInto::write`].
pub type FillOutputs<'a> = dyn FnMut(&mut [&mut [u8]]) -> Result<(), ExecError> + 'a;

/// Where a Run's fetched values may be written instead of returned: the
/// reply slot in the job's segment, which the CUDA backend fills straight
/// from the device (the segment's pages registered page-locked once).
pub trait FetchInto {
    /// The segment whose writable mapping holds the places, if any.
    fn segment(&self) -> Option<&Arc<AttachedSegment>>;
    /// Takes outputs of `types`: `write` fills one place per output,
    /// exactly its type's bytes, in order. `Ok(false)`: not taken (`write`
    /// not called), return them instead.
    fn write(
        &mut self,
        types: &[TensorType],
        write: &mut FillOutputs<'_>,
    ) -> Result<bool, ExecError>;
}

/// A Run's fetched values: returned, or written where the caller asked
/// ([`FetchInto`]).
#[derive(Debug)]
pub enum Fetched {
    Tensors(Vec<Tensor>),
    Written,
}

impl Fetched {
    /// `values` written into `into` when it takes them (copied from the
    /// host: the CPU backend's outputs), else returned.
    pub fn give(values: Vec<Tensor>, into: Option<&mut dyn FetchInto>) -> Result<Self, ExecError> {
        let Some(into) = into else {
            return Ok(Fetched::Tensors(values));
        };
        let types: Vec<TensorType> = values.iter().map(Tensor::ty).collect();
        let written = into.write(&types, &mut |places| {
            for (place, t) in places.iter_mut().zip(&values) {
                lanes_adaptor::wire::write_tensor(place, t);
            }
            Ok(())
        })?;
        Ok(if written {
            Fetched::Written
        } else {
            Fetched::Tensors(values)
        })
    }

    /// The values returned (none when they were written elsewhere).
    pub fn into_tensors(self) -> Vec<Tensor> {
        match self {
            Fetched::Tensors(t) => t,
            Fetched::Written => Vec::new(),
        }
    }
}

/// Read-only view of a tensor's values.
#[derive(Debug, Clone, Copy)]
pub enum DataRef<'a> {
    F32(&'a [f32]),
    I64(&'a [i64]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

/// Writable view of a tensor's values.
#[derive(Debug)]
pub enum DataMut<'a> {
    F32(&'a mut [f32]),
    I64(&'a mut [i64]),
    F16(&'a mut [f16]),
    BF16(&'a mut [bf16]),
}

impl<'a> From<&'a TensorData> for DataRef<'a> {
    fn from(d: &'a TensorData) -> Self {
        match d {
            TensorData::F32(v) => DataRef::F32(v),
            TensorData::I64(v) => DataRef::I64(v),
            TensorData::F16(v) => DataRef::F16(v),
            TensorData::BF16(v) => DataRef::BF16(v),
        }
    }
}

impl<'a> From<&'a mut TensorData> for DataMut<'a> {
    fn from(d: &'a mut TensorData) -> Self {
        match d {
            TensorData::F32(v) => DataMut::F32(v),
            TensorData::I64(v) => DataMut::I64(v),
            TensorData::F16(v) => DataMut::F16(v),
            TensorData::BF16(v) => DataMut::BF16(v),
        }
    }
}

impl DataRef<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            DataRef::F32(_) => DType::F32,
            DataRef::I64(_) => DType::I64,
            DataRef::F16(_) => DType::F16,
            DataRef::BF16(_) => DType::BF16,
        }
    }
    /// An owned copy of the values.
    pub fn to_data(&self) -> TensorData {
        match *self {
            DataRef::F32(v) => TensorData::F32(v.to_vec()),
            DataRef::I64(v) => TensorData::I64(v.to_vec()),
            DataRef::F16(v) => TensorData::F16(v.to_vec()),
            DataRef::BF16(v) => TensorData::BF16(v.to_vec()),
        }
    }
}

impl DataMut<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            DataMut::F32(_) => DType::F32,
            DataMut::I64(_) => DType::I64,
            DataMut::F16(_) => DType::F16,
            DataMut::BF16(_) => DType::BF16,
        }
    }
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
            other => Err(ExecError::dtype(DType::F32, other.dtype())),
        }
    }
    pub fn i64s(&self) -> Result<&'a [i64], ExecError> {
        match self.data {
            DataRef::I64(v) => Ok(v),
            other => Err(ExecError::dtype(DType::I64, other.dtype())),
        }
    }
    pub fn f16s(&self) -> Result<&'a [f16], ExecError> {
        match self.data {
            DataRef::F16(v) => Ok(v),
            other => Err(ExecError::dtype(DType::F16, other.dtype())),
        }
    }
    pub fn bf16s(&self) -> Result<&'a [bf16], ExecError> {
        match self.data {
            DataRef::BF16(v) => Ok(v),
            other => Err(ExecError::dtype(DType::BF16, other.dtype())),
        }
    }
    /// A half tensor's values as their raw 16-bit patterns (for copies).
    pub fn half_bits(&self) -> Result<&'a [u16], ExecError> {
        use half::slice::HalfFloatSliceExt;
        match self.data {
            DataRef::F16(v) => Ok(v.reinterpret_cast()),
            DataRef::BF16(v) => Ok(v.reinterpret_cast()),
            other => Err(ExecError::dtype(DType::F16, other.dtype())),
        }
    }
    /// A float tensor's values widened to f32 (exact for f16 and bf16).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>, ExecError> {
        match self.data {
            DataRef::F32(v) => Ok(v.to_vec()),
            DataRef::F16(v) => Ok(v.iter().map(|x| x.to_f32()).collect()),
            DataRef::BF16(v) => Ok(v.iter().map(|x| x.to_f32()).collect()),
            DataRef::I64(_) => Err(ExecError::dtype(DType::F32, DType::I64)),
        }
    }
    pub fn dims(&self) -> &'a [usize] {
        self.ty.shape.dims()
    }
}

impl TensorMut<'_> {
    pub fn f32s(&mut self) -> Result<&mut [f32], ExecError> {
        let got = self.data.dtype();
        match &mut self.data {
            DataMut::F32(v) => Ok(v),
            _ => Err(ExecError::dtype(DType::F32, got)),
        }
    }
    pub fn i64s(&mut self) -> Result<&mut [i64], ExecError> {
        let got = self.data.dtype();
        match &mut self.data {
            DataMut::I64(v) => Ok(v),
            _ => Err(ExecError::dtype(DType::I64, got)),
        }
    }
    /// A half tensor's values as their raw 16-bit patterns (for copies).
    pub fn half_bits(&mut self) -> Result<&mut [u16], ExecError> {
        use half::slice::HalfFloatSliceExt;
        let got = self.data.dtype();
        match &mut self.data {
            DataMut::F16(v) => Ok(v.reinterpret_cast_mut()),
            DataMut::BF16(v) => Ok(v.reinterpret_cast_mut()),
            _ => Err(ExecError::dtype(DType::F16, got)),
        }
    }
    /// Writes f32 values into a float tensor, rounded to its dtype (to
    /// nearest, ties to even).
    pub fn store_f32(&mut self, v: &[f32]) -> Result<(), ExecError> {
        use half::slice::HalfFloatSliceExt;
        let n = v.len();
        let short = |len: usize| ExecError::Op {
            node: String::new(),
            op: "store",
            reason: format!("{n} values for a buffer of {len}"),
        };
        match &mut self.data {
            DataMut::F32(y) if y.len() == n => y.copy_from_slice(v),
            DataMut::F16(y) if y.len() == n => y.convert_from_f32_slice(v),
            DataMut::BF16(y) if y.len() == n => y.convert_from_f32_slice(v),
            DataMut::I64(_) => return Err(ExecError::dtype(DType::F32, DType::I64)),
            DataMut::F32(y) => return Err(short(y.len())),
            DataMut::F16(y) => return Err(short(y.len())),
            DataMut::BF16(y) => return Err(short(y.len())),
        }
        Ok(())
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
    /// The fetches lie in different parts of the graph (the main iteration
    /// and an entry, or two entries): see `lanes_adaptor::Entry`.
    #[error("fetches: {reason}")]
    FetchParts { reason: String },
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
    #[error("{dtype} tensors are not supported by the {backend} backend yet")]
    UnsupportedDType { dtype: DType, backend: &'static str },
}

impl ExecError {
    pub fn dtype(expected: DType, got: DType) -> Self {
        ExecError::DType { expected, got }
    }
}

/// The part of `graph` a Run fetching `fetches` runs; an unknown fetch or
/// fetches from two parts are the Run's error. (A graph without entries
/// has one part: its fetches are checked where it runs.)
pub(crate) fn part_of(
    graph: &lanes_adaptor::ValidGraph,
    fetches: &[String],
) -> Result<lanes_adaptor::Part, ExecError> {
    if !graph.has_entries() {
        return Ok(lanes_adaptor::Part::Main);
    }
    part_for(graph, &resolve_fetches(graph.graph(), fetches)?)
}

/// `fetches` (`name` or `name:slot`) as outlets of `g`; an unknown key is
/// the Run's error.
pub(crate) fn resolve_fetches(
    g: &lanes_adaptor::Graph,
    fetches: &[String],
) -> Result<Vec<lanes_adaptor::Outlet>, ExecError> {
    fetches
        .iter()
        .map(|k| {
            g.resolve(k)
                .ok_or_else(|| ExecError::UnknownFetch { key: k.clone() })
        })
        .collect()
}

/// The part of `graph` a Run fetching `outs` runs; outlets of two parts
/// are the Run's error.
pub(crate) fn part_for(
    graph: &lanes_adaptor::ValidGraph,
    outs: &[lanes_adaptor::Outlet],
) -> Result<lanes_adaptor::Part, ExecError> {
    graph
        .part_for(outs)
        .map_err(|reason| ExecError::FetchParts { reason })
}
