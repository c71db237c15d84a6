//! Tensors as they travel between a job and the service: a dtype, a static
//! shape, and the values in row-major order.

pub use half::{bf16, f16};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of a tensor. `F32` for values, `I64` for indices and
/// labels, `F16` and `BF16` for half-precision values (docs/precision.md).
///
/// The variants' order is their bincode index on the wire: new ones go last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    F32,
    I64,
    F16,
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
        }
    }
    /// A floating-point dtype: f32, f16 or bf16.
    pub fn is_float(self) -> bool {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => true,
            DType::I64 => false,
        }
    }
    /// A 16-bit floating-point dtype: f16 or bf16.
    pub fn is_half(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        })
    }
}

/// A static shape. The empty shape is a scalar (one element).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }
    pub fn scalar() -> Self {
        Shape(Vec::new())
    }
    pub fn dims(&self) -> &[usize] {
        &self.0
    }
    pub fn rank(&self) -> usize {
        self.0.len()
    }
    /// Number of elements, `None` on overflow.
    pub fn checked_numel(&self) -> Option<usize> {
        self.0.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }
    /// Number of elements. Shapes built by [`crate::graph::GraphBuilder`] or
    /// accepted by validation never overflow; for others this saturates.
    pub fn numel(&self) -> usize {
        self.checked_numel().unwrap_or(usize::MAX)
    }
    /// Row-major strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut s = vec![1usize; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            s[i] = s[i + 1].saturating_mul(self.0[i + 1]);
        }
        s
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}
impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}
impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "]")
    }
}

/// The type of a wire: dtype and shape.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Shape,
}

impl TensorType {
    pub fn new(dtype: DType, shape: impl Into<Shape>) -> Self {
        TensorType {
            dtype,
            shape: shape.into(),
        }
    }
    pub fn f32(shape: impl Into<Shape>) -> Self {
        Self::new(DType::F32, shape)
    }
    pub fn i64(shape: impl Into<Shape>) -> Self {
        Self::new(DType::I64, shape)
    }
    /// Size in bytes, `None` on overflow.
    pub fn checked_bytes(&self) -> Option<usize> {
        self.shape.checked_numel()?.checked_mul(self.dtype.size())
    }
    pub fn bytes(&self) -> usize {
        self.checked_bytes().unwrap_or(usize::MAX)
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

/// Values of a tensor, row-major.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum TensorData {
    F32(Vec<f32>),
    I64(Vec<i64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl TensorData {
    pub fn dtype(&self) -> DType {
        match self {
            TensorData::F32(_) => DType::F32,
            TensorData::I64(_) => DType::I64,
            TensorData::F16(_) => DType::F16,
            TensorData::BF16(_) => DType::BF16,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(v) => v.len(),
            TensorData::I64(v) => v.len(),
            TensorData::F16(v) => v.len(),
            TensorData::BF16(v) => v.len(),
        }
    }
    /// The values' storage as bytes in the host's byte order (the wire's
    /// little-endian form on little-endian hosts), without a copy.
    pub fn ne_bytes(&self) -> &[u8] {
        use half::slice::HalfFloatSliceExt;
        match self {
            TensorData::F32(v) => bytemuck::cast_slice(v),
            TensorData::I64(v) => bytemuck::cast_slice(v),
            TensorData::F16(v) => bytemuck::cast_slice(v.reinterpret_cast()),
            TensorData::BF16(v) => bytemuck::cast_slice(v.reinterpret_cast()),
        }
    }
    /// [`TensorData::ne_bytes`], writable.
    pub fn ne_bytes_mut(&mut self) -> &mut [u8] {
        use half::slice::HalfFloatSliceExt;
        match self {
            TensorData::F32(v) => bytemuck::cast_slice_mut(v),
            TensorData::I64(v) => bytemuck::cast_slice_mut(v),
            TensorData::F16(v) => bytemuck::cast_slice_mut(v.reinterpret_cast_mut()),
            TensorData::BF16(v) => bytemuck::cast_slice_mut(v.reinterpret_cast_mut()),
        }
    }
    /// `n` zeros of `dtype`.
    pub fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::F32 => TensorData::F32(vec![0.0; n]),
            DType::I64 => TensorData::I64(vec![0; n]),
            DType::F16 => TensorData::F16(vec![f16::ZERO; n]),
            DType::BF16 => TensorData::BF16(vec![bf16::ZERO; n]),
        }
    }
    /// Float values widened to f32 (exact for f16 and bf16); `None` for i64.
    pub fn to_f32_vec(&self) -> Option<Vec<f32>> {
        match self {
            TensorData::F32(v) => Some(v.clone()),
            TensorData::F16(v) => Some(v.iter().map(|x| x.to_f32()).collect()),
            TensorData::BF16(v) => Some(v.iter().map(|x| x.to_f32()).collect()),
            TensorData::I64(_) => None,
        }
    }
    /// f32 values rounded (to nearest, ties to even) to a float `dtype`;
    /// `None` for i64.
    pub fn from_f32_rounded(dtype: DType, v: &[f32]) -> Option<Self> {
        match dtype {
            DType::F32 => Some(TensorData::F32(v.to_vec())),
            DType::F16 => Some(TensorData::F16(
                v.iter().map(|&x| f16::from_f32(x)).collect(),
            )),
            DType::BF16 => Some(TensorData::BF16(
                v.iter().map(|&x| bf16::from_f32(x)).collect(),
            )),
            DType::I64 => None,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Error building a tensor from parts that do not agree.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TensorError {
    #[error("tensor of shape {shape} needs {expected} elements, got {got}")]
    Length {
        shape: Shape,
        expected: usize,
        got: usize,
    },
    #[error("tensor of type {ty} needs {expected} bytes, got {got}")]
    Bytes {
        ty: TensorType,
        expected: usize,
        got: usize,
    },
    #[error("tensor shape {shape} overflows")]
    Overflow { shape: Shape },
    #[error("expected a {expected} tensor, got {got}")]
    DType { expected: DType, got: DType },
}

/// A tensor: type plus values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tensor {
    shape: Shape,
    data: TensorData,
}

impl Tensor {
    /// Builds a tensor; the number of values must match the shape.
    pub fn new(shape: impl Into<Shape>, data: TensorData) -> Result<Self, TensorError> {
        let shape = shape.into();
        let expected = shape.checked_numel().ok_or_else(|| TensorError::Overflow {
            shape: shape.clone(),
        })?;
        if expected != data.len() {
            return Err(TensorError::Length {
                shape,
                expected,
                got: data.len(),
            });
        }
        Ok(Tensor { shape, data })
    }
    pub fn from_f32(shape: impl Into<Shape>, v: Vec<f32>) -> Result<Self, TensorError> {
        Self::new(shape, TensorData::F32(v))
    }
    pub fn from_i64(shape: impl Into<Shape>, v: Vec<i64>) -> Result<Self, TensorError> {
        Self::new(shape, TensorData::I64(v))
    }
    pub fn from_f16(shape: impl Into<Shape>, v: Vec<f16>) -> Result<Self, TensorError> {
        Self::new(shape, TensorData::F16(v))
    }
    pub fn from_bf16(shape: impl Into<Shape>, v: Vec<bf16>) -> Result<Self, TensorError> {
        Self::new(shape, TensorData::BF16(v))
    }
    pub fn scalar(v: f32) -> Self {
        Tensor {
            shape: Shape::scalar(),
            data: TensorData::F32(vec![v]),
        }
    }
    pub fn zeros(ty: &TensorType) -> Self {
        Tensor {
            shape: ty.shape.clone(),
            data: TensorData::zeros(ty.dtype, ty.shape.numel()),
        }
    }
    pub fn full(shape: impl Into<Shape>, v: f32) -> Self {
        let shape = shape.into();
        let n = shape.numel();
        Tensor {
            shape,
            data: TensorData::F32(vec![v; n]),
        }
    }
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }
    pub fn ty(&self) -> TensorType {
        TensorType::new(self.dtype(), self.shape.clone())
    }
    pub fn data(&self) -> &TensorData {
        &self.data
    }
    pub fn into_data(self) -> TensorData {
        self.data
    }
    pub fn numel(&self) -> usize {
        self.data.len()
    }
    fn wrong(&self, expected: DType) -> TensorError {
        TensorError::DType {
            expected,
            got: self.dtype(),
        }
    }
    pub fn f32s(&self) -> Result<&[f32], TensorError> {
        match &self.data {
            TensorData::F32(v) => Ok(v),
            _ => Err(self.wrong(DType::F32)),
        }
    }
    pub fn i64s(&self) -> Result<&[i64], TensorError> {
        match &self.data {
            TensorData::I64(v) => Ok(v),
            _ => Err(self.wrong(DType::I64)),
        }
    }
    pub fn f16s(&self) -> Result<&[f16], TensorError> {
        match &self.data {
            TensorData::F16(v) => Ok(v),
            _ => Err(self.wrong(DType::F16)),
        }
    }
    pub fn bf16s(&self) -> Result<&[bf16], TensorError> {
        match &self.data {
            TensorData::BF16(v) => Ok(v),
            _ => Err(self.wrong(DType::BF16)),
        }
    }
    pub fn f32s_mut(&mut self) -> Result<&mut [f32], TensorError> {
        let got = self.dtype();
        match &mut self.data {
            TensorData::F32(v) => Ok(v),
            _ => Err(TensorError::DType {
                expected: DType::F32,
                got,
            }),
        }
    }
    /// A float tensor's values widened to f32 (exact for f16 and bf16).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>, TensorError> {
        self.data.to_f32_vec().ok_or_else(|| self.wrong(DType::F32))
    }
    /// Same values, new shape with the same number of elements.
    pub fn reshape(self, shape: impl Into<Shape>) -> Result<Self, TensorError> {
        Self::new(shape, self.data)
    }
    /// Values as little-endian bytes (the wire's tensor frame).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match &self.data {
            TensorData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            TensorData::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            TensorData::F16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            TensorData::BF16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
    /// Rebuilds a tensor from its type and little-endian bytes.
    pub fn from_le_bytes(ty: &TensorType, bytes: &[u8]) -> Result<Self, TensorError> {
        let expected = ty.checked_bytes().ok_or_else(|| TensorError::Overflow {
            shape: ty.shape.clone(),
        })?;
        if expected != bytes.len() {
            return Err(TensorError::Bytes {
                ty: ty.clone(),
                expected,
                got: bytes.len(),
            });
        }
        let data = match ty.dtype {
            DType::F32 => TensorData::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            DType::I64 => TensorData::I64(
                bytes
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                    .collect(),
            ),
            DType::F16 => TensorData::F16(
                bytes
                    .chunks_exact(2)
                    .map(|c| f16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
            DType::BF16 => TensorData::BF16(
                bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                    .collect(),
            ),
        };
        Ok(Tensor {
            shape: ty.shape.clone(),
            data,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn le_bytes_round_trip() {
        let t = Tensor::from_f32([2, 2], vec![1.0, -2.5, 3.25, f32::MIN]).unwrap();
        let b = t.to_le_bytes();
        assert_eq!(b.len(), 16);
        assert_eq!(Tensor::from_le_bytes(&t.ty(), &b).unwrap(), t);
        let i = Tensor::from_i64([3], vec![1, -1, i64::MAX]).unwrap();
        assert_eq!(Tensor::from_le_bytes(&i.ty(), &i.to_le_bytes()).unwrap(), i);
    }

    #[test]
    fn half_le_bytes_round_trip() {
        let h = Tensor::from_f16(
            [4],
            [1.0f32, -2.5, 65504.0, 6.0e-8]
                .iter()
                .map(|&x| f16::from_f32(x))
                .collect(),
        )
        .unwrap();
        let b = h.to_le_bytes();
        assert_eq!(b.len(), 8);
        // 1.0 in f16 is 0x3c00, little-endian.
        assert_eq!(&b[..2], &[0x00, 0x3c]);
        assert_eq!(Tensor::from_le_bytes(&h.ty(), &b).unwrap(), h);
        let nan = bf16::from_bits(0x7fc1);
        let g = Tensor::from_bf16(
            [2, 2],
            vec![
                bf16::ONE,
                bf16::NEG_INFINITY,
                nan,
                bf16::MIN_POSITIVE_SUBNORMAL,
            ],
        )
        .unwrap();
        let b = g.to_le_bytes();
        assert_eq!(b.len(), 8);
        // 1.0 in bf16 is 0x3f80; NaN payloads survive.
        assert_eq!(&b[..2], &[0x80, 0x3f]);
        let back = Tensor::from_le_bytes(&g.ty(), &b).unwrap();
        let bits: Vec<u16> = back.bf16s().unwrap().iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits, vec![0x3f80, 0xff80, 0x7fc1, 0x0001]);
        assert!(matches!(
            Tensor::from_le_bytes(&TensorType::new(DType::BF16, [3]), &[0u8; 5]),
            Err(TensorError::Bytes {
                expected: 6,
                got: 5,
                ..
            })
        ));
    }

    #[test]
    fn dtype_facts() {
        assert_eq!(DType::F16.size(), 2);
        assert_eq!(DType::BF16.size(), 2);
        assert_eq!(DType::F16.to_string(), "f16");
        assert_eq!(DType::BF16.to_string(), "bf16");
        assert!(DType::F16.is_float() && DType::BF16.is_float() && DType::F32.is_float());
        assert!(!DType::I64.is_float());
        assert_eq!(TensorType::new(DType::BF16, [3, 5]).bytes(), 30);
        // bincode indices of the dtypes already on the wire stay put.
        let idx = |d: DType| bincode::serialize(&d).unwrap();
        assert_eq!(idx(DType::F32), vec![0, 0, 0, 0]);
        assert_eq!(idx(DType::I64), vec![1, 0, 0, 0]);
        assert_eq!(idx(DType::F16), vec![2, 0, 0, 0]);
        assert_eq!(idx(DType::BF16), vec![3, 0, 0, 0]);
    }

    #[test]
    fn wrong_lengths_are_errors() {
        assert!(Tensor::from_f32([2, 3], vec![0.0; 5]).is_err());
        let ty = TensorType::f32([2]);
        assert!(matches!(
            Tensor::from_le_bytes(&ty, &[0u8; 7]),
            Err(TensorError::Bytes {
                expected: 8,
                got: 7,
                ..
            })
        ));
        let huge = TensorType::f32([usize::MAX, 2]);
        assert!(matches!(
            Tensor::from_le_bytes(&huge, &[]),
            Err(TensorError::Overflow { .. })
        ));
    }
}
