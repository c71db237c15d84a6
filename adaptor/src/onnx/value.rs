//! Host tensors: the values the importer knows before any Run (initializers,
//! `Constant` nodes, shapes, and whatever is computed from them only), with
//! ONNX's element types narrowed to the three the importer works in.

use super::proto::{tensor_proto::DataType, TensorProto};
use crate::tensor::{Tensor, TensorData};

type R<T> = Result<T, String>;

/// Values of a host tensor, row-major.
#[derive(Debug, Clone, PartialEq)]
pub enum HostData {
    F32(Vec<f32>),
    I64(Vec<i64>),
    Bool(Vec<bool>),
}

/// Element type of a host or run-time value as the importer sees it. At run
/// time `Bool` travels as an f32 mask of 0s and 1s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Elem {
    F32,
    I64,
    Bool,
}

impl std::fmt::Display for Elem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Elem::F32 => "float",
            Elem::I64 => "int64",
            Elem::Bool => "bool",
        })
    }
}

/// A tensor known at import time.
#[derive(Debug, Clone, PartialEq)]
pub struct Host {
    pub dims: Vec<usize>,
    pub data: HostData,
}

/// Number of elements of `dims`, or why not (overflow, over `limit`).
pub fn numel(dims: &[usize], limit: usize) -> R<usize> {
    let n = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| format!("shape {dims:?} overflows"))?;
    if n > limit {
        return Err(format!(
            "tensor of shape {dims:?} has {n} elements, more than the import limit of {limit}"
        ));
    }
    Ok(n)
}

impl Host {
    pub fn new(dims: Vec<usize>, data: HostData) -> R<Self> {
        let n = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| format!("shape {dims:?} overflows"))?;
        let len = match &data {
            HostData::F32(v) => v.len(),
            HostData::I64(v) => v.len(),
            HostData::Bool(v) => v.len(),
        };
        if n != len {
            return Err(format!("shape {dims:?} needs {n} values, got {len}"));
        }
        Ok(Host { dims, data })
    }
    pub fn i64s(dims: Vec<usize>, v: Vec<i64>) -> R<Self> {
        Host::new(dims, HostData::I64(v))
    }
    pub fn elem(&self) -> Elem {
        match self.data {
            HostData::F32(_) => Elem::F32,
            HostData::I64(_) => Elem::I64,
            HostData::Bool(_) => Elem::Bool,
        }
    }
    pub fn len(&self) -> usize {
        match &self.data {
            HostData::F32(v) => v.len(),
            HostData::I64(v) => v.len(),
            HostData::Bool(v) => v.len(),
        }
    }
    /// The values as integers (shapes, axes, indices); floats must be whole.
    pub fn as_i64s(&self) -> R<Vec<i64>> {
        match &self.data {
            HostData::I64(v) => Ok(v.clone()),
            HostData::Bool(v) => Ok(v.iter().map(|&b| i64::from(b)).collect()),
            HostData::F32(v) => v
                .iter()
                .map(|&x| {
                    if x.fract() == 0.0 && x.abs() < 9.0e18 {
                        Ok(x as i64)
                    } else {
                        Err(format!("{x} is not an integer"))
                    }
                })
                .collect(),
        }
    }
    /// The values as floats.
    pub fn as_f32s(&self) -> Vec<f32> {
        match &self.data {
            HostData::F32(v) => v.clone(),
            HostData::I64(v) => v.iter().map(|&x| x as f32).collect(),
            HostData::Bool(v) => v.iter().map(|&b| f32::from(u8::from(b))).collect(),
        }
    }
    /// The single value of a one-element tensor, as f32.
    pub fn scalar_f32(&self) -> R<f32> {
        match self.as_f32s().as_slice() {
            [x] => Ok(*x),
            v => Err(format!("expected one value, got {}", v.len())),
        }
    }
    /// The single value of a one-element tensor, as i64.
    pub fn scalar_i64(&self) -> R<i64> {
        match self.as_i64s()?.as_slice() {
            [x] => Ok(*x),
            v => Err(format!("expected one value, got {}", v.len())),
        }
    }
    /// The tensor as the graph holds it (bool becomes a 0/1 f32 mask).
    pub fn to_tensor(&self) -> R<Tensor> {
        let data = match &self.data {
            HostData::F32(v) => TensorData::F32(v.clone()),
            HostData::I64(v) => TensorData::I64(v.clone()),
            HostData::Bool(_) => TensorData::F32(self.as_f32s()),
        };
        Tensor::new(self.dims.clone(), data).map_err(|e| e.to_string())
    }
    /// Same values, new dims (same element count).
    pub fn reshaped(&self, dims: Vec<usize>) -> R<Self> {
        Host::new(dims, self.data.clone())
    }
    /// Picks elements by linear index.
    pub fn pick(&self, dims: Vec<usize>, idx: &[usize]) -> R<Self> {
        let get = |i: usize| -> R<usize> {
            if i < self.len() {
                Ok(i)
            } else {
                Err(format!("index {i} out of range for {} values", self.len()))
            }
        };
        let data = match &self.data {
            HostData::F32(v) => HostData::F32(
                idx.iter()
                    .map(|&i| get(i).map(|i| v[i]))
                    .collect::<R<_>>()?,
            ),
            HostData::I64(v) => HostData::I64(
                idx.iter()
                    .map(|&i| get(i).map(|i| v[i]))
                    .collect::<R<_>>()?,
            ),
            HostData::Bool(v) => HostData::Bool(
                idx.iter()
                    .map(|&i| get(i).map(|i| v[i]))
                    .collect::<R<_>>()?,
            ),
        };
        Host::new(dims, data)
    }
}

/// Reads an ONNX tensor (typed fields or raw little-endian bytes). Integer
/// types become i64, floating types f32 (fp16 and bf16 exactly: every
/// half value is an f32), bool stays bool.
pub fn from_proto(t: &TensorProto, limit: usize) -> R<Host> {
    if t.data_location == Some(1) {
        return Err("tensor data stored outside the model file is not supported".into());
    }
    if t.segment.is_some() {
        return Err("segmented tensors are not supported".into());
    }
    let dims: Vec<usize> = t
        .dims
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| format!("negative dimension {d}")))
        .collect::<R<_>>()?;
    let n = numel(&dims, limit)?;
    let dt = DataType::try_from(t.data_type.unwrap_or(0))
        .map_err(|_| format!("unknown data type {}", t.data_type.unwrap_or(0)))?;
    let raw = t.raw_data.as_deref();
    let raw_of = |size: usize| -> R<Option<&[u8]>> {
        match raw {
            Some(r) if !r.is_empty() || n == 0 => {
                if Some(r.len()) != n.checked_mul(size) {
                    return Err(format!(
                        "raw data holds {} bytes, shape {dims:?} needs {}",
                        r.len(),
                        n.saturating_mul(size)
                    ));
                }
                Ok(Some(r))
            }
            _ => Ok(None),
        }
    };
    let check = |len: usize| -> R<()> {
        if len != n {
            return Err(format!(
                "shape {dims:?} needs {n} values, the tensor holds {len}"
            ));
        }
        Ok(())
    };
    let data = match dt {
        DataType::Float => match raw_of(4)? {
            Some(r) => HostData::F32(
                r.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            None => {
                check(t.float_data.len())?;
                HostData::F32(t.float_data.clone())
            }
        },
        DataType::Double => match raw_of(8)? {
            Some(r) => HostData::F32(
                r.chunks_exact(8)
                    .map(|c| {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(c);
                        f64::from_le_bytes(b) as f32
                    })
                    .collect(),
            ),
            None => {
                check(t.double_data.len())?;
                HostData::F32(t.double_data.iter().map(|&x| x as f32).collect())
            }
        },
        DataType::Int64 => match raw_of(8)? {
            Some(r) => HostData::I64(
                r.chunks_exact(8)
                    .map(|c| {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(c);
                        i64::from_le_bytes(b)
                    })
                    .collect(),
            ),
            None => {
                check(t.int64_data.len())?;
                HostData::I64(t.int64_data.clone())
            }
        },
        DataType::Int32 | DataType::Int16 | DataType::Int8 | DataType::Uint8 | DataType::Uint16 => {
            let size = match dt {
                DataType::Int32 => 4,
                DataType::Int16 | DataType::Uint16 => 2,
                _ => 1,
            };
            match raw_of(size)? {
                Some(r) => HostData::I64(
                    r.chunks_exact(size)
                        .map(|c| match dt {
                            DataType::Int32 => {
                                i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            }
                            DataType::Int16 => i64::from(i16::from_le_bytes([c[0], c[1]])),
                            DataType::Uint16 => i64::from(u16::from_le_bytes([c[0], c[1]])),
                            DataType::Int8 => i64::from(c[0] as i8),
                            _ => i64::from(c[0]),
                        })
                        .collect(),
                ),
                None => {
                    check(t.int32_data.len())?;
                    HostData::I64(t.int32_data.iter().map(|&x| i64::from(x)).collect())
                }
            }
        }
        DataType::Float16 | DataType::Bfloat16 => {
            // Raw: little-endian 16-bit patterns; typed: one pattern per
            // int32_data element (the ONNX spec's layout for both).
            let bits: Vec<u16> = match raw_of(2)? {
                Some(r) => r
                    .chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect(),
                None => {
                    check(t.int32_data.len())?;
                    t.int32_data
                        .iter()
                        .map(|&x| {
                            u16::try_from(x)
                                .map_err(|_| format!("{x} is not a 16-bit float pattern"))
                        })
                        .collect::<R<_>>()?
                }
            };
            HostData::F32(if dt == DataType::Float16 {
                bits.iter()
                    .map(|&b| half::f16::from_bits(b).to_f32())
                    .collect()
            } else {
                bits.iter()
                    .map(|&b| half::bf16::from_bits(b).to_f32())
                    .collect()
            })
        }
        DataType::Bool => match raw_of(1)? {
            Some(r) => HostData::Bool(r.iter().map(|&b| b != 0).collect()),
            None => {
                check(t.int32_data.len())?;
                HostData::Bool(t.int32_data.iter().map(|&x| x != 0).collect())
            }
        },
        other => {
            return Err(format!(
                "tensors of type {} are not supported",
                other.as_str_name()
            ))
        }
    };
    Host::new(dims, data)
}

/// The element type an ONNX data type code is read as, for `Cast` and the
/// value infos of inputs.
pub fn elem_of(code: i32) -> R<Elem> {
    let dt = DataType::try_from(code).map_err(|_| format!("unknown data type {code}"))?;
    Ok(match dt {
        DataType::Float | DataType::Double | DataType::Float16 | DataType::Bfloat16 => Elem::F32,
        DataType::Int64
        | DataType::Int32
        | DataType::Int16
        | DataType::Int8
        | DataType::Uint8
        | DataType::Uint16 => Elem::I64,
        DataType::Bool => Elem::Bool,
        other => return Err(format!("type {} is not supported", other.as_str_name())),
    })
}

/// Converts values to `to`, as ONNX's Cast does (float to int truncates).
pub fn cast(h: &Host, to: Elem) -> R<Host> {
    let data = match to {
        Elem::F32 => HostData::F32(h.as_f32s()),
        Elem::I64 => HostData::I64(match &h.data {
            HostData::F32(v) => v.iter().map(|&x| x as i64).collect(),
            HostData::I64(v) => v.clone(),
            HostData::Bool(v) => v.iter().map(|&b| i64::from(b)).collect(),
        }),
        Elem::Bool => HostData::Bool(match &h.data {
            HostData::F32(v) => v.iter().map(|&x| x != 0.0).collect(),
            HostData::I64(v) => v.iter().map(|&x| x != 0).collect(),
            HostData::Bool(v) => v.clone(),
        }),
    };
    Host::new(h.dims.clone(), data)
}

/// Numpy broadcast of two shapes.
pub fn broadcast(a: &[usize], b: &[usize]) -> R<Vec<usize>> {
    let n = a.len().max(b.len());
    let at = |s: &[usize], i: usize| {
        if i < n - s.len() {
            1
        } else {
            s[i - (n - s.len())]
        }
    };
    (0..n)
        .map(|i| {
            let (x, y) = (at(a, i), at(b, i));
            if x == y || y == 1 {
                Ok(x)
            } else if x == 1 {
                Ok(y)
            } else {
                Err(format!("shapes {a:?} and {b:?} do not broadcast"))
            }
        })
        .collect()
}

/// Linear indices into a tensor of `dims` for every element of `out`
/// (which `dims` broadcasts to), row-major.
pub fn broadcast_index(dims: &[usize], out: &[usize]) -> Vec<usize> {
    let off = out.len() - dims.len().min(out.len());
    let mut strides = vec![0usize; out.len()];
    let mut s = 1usize;
    for i in (0..dims.len()).rev() {
        if dims[i] != 1 {
            strides[i + off] = s;
        }
        s = s.saturating_mul(dims[i]);
    }
    let total: usize = out.iter().product();
    let mut idx = Vec::with_capacity(total);
    let mut pos = vec![0usize; out.len()];
    for _ in 0..total {
        idx.push(pos.iter().zip(&strides).map(|(p, s)| p * s).sum());
        for ax in (0..out.len()).rev() {
            pos[ax] += 1;
            if pos[ax] < out[ax] {
                break;
            }
            pos[ax] = 0;
        }
    }
    idx
}
