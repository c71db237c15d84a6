//! `.npy` files as tensors, and comparing results against references
//! within a tolerance (`lanes import --check`, the ONNX import tests).

use std::path::Path;

use lanes_adaptor::{Tensor, TensorData};
use ndarray::ArrayD;
use ndarray_npy::{read_npy, ReadNpyError};

/// Why an `.npy` file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum NpyError {
    #[error("cannot read `{path}`: {source}")]
    Read { path: String, source: ReadNpyError },
    #[error("`{path}`: {reason}")]
    Shape { path: String, reason: String },
}

/// Reads an `.npy` array (float32/float64 as f32, int64/int32 as i64, bool
/// as a 0/1 f32 mask; C order).
pub fn read(path: impl AsRef<Path>) -> Result<Tensor, NpyError> {
    let path = path.as_ref();
    let shape_err = |reason: String| NpyError::Shape {
        path: path.display().to_string(),
        reason,
    };
    fn parts<T: Clone>(a: ArrayD<T>) -> (Vec<usize>, Vec<T>) {
        let shape = a.shape().to_vec();
        (shape, a.iter().cloned().collect())
    }
    let first = match read_npy::<_, ArrayD<f32>>(path) {
        Ok(a) => {
            let (s, v) = parts(a);
            return Tensor::new(s, TensorData::F32(v)).map_err(|e| shape_err(e.to_string()));
        }
        Err(e) => e,
    };
    if let Ok(a) = read_npy::<_, ArrayD<i64>>(path) {
        let (s, v) = parts(a);
        return Tensor::new(s, TensorData::I64(v)).map_err(|e| shape_err(e.to_string()));
    }
    if let Ok(a) = read_npy::<_, ArrayD<f64>>(path) {
        let (s, v) = parts(a);
        let v = v.into_iter().map(|x| x as f32).collect();
        return Tensor::new(s, TensorData::F32(v)).map_err(|e| shape_err(e.to_string()));
    }
    if let Ok(a) = read_npy::<_, ArrayD<i32>>(path) {
        let (s, v) = parts(a);
        let v = v.into_iter().map(i64::from).collect();
        return Tensor::new(s, TensorData::I64(v)).map_err(|e| shape_err(e.to_string()));
    }
    if let Ok(a) = read_npy::<_, ArrayD<bool>>(path) {
        let (s, v) = parts(a);
        let v = v.into_iter().map(|b| f32::from(u8::from(b))).collect();
        return Tensor::new(s, TensorData::F32(v)).map_err(|e| shape_err(e.to_string()));
    }
    Err(NpyError::Read {
        path: path.display().to_string(),
        source: first,
    })
}

/// How far a result is from its reference.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Agreement {
    /// Largest |got - want|.
    pub max_abs: f64,
    /// Largest |got - want| / |want| over elements with |want| > atol.
    pub max_rel: f64,
    /// Elements outside `|got - want| <= atol + rtol * |want|`.
    pub outside: usize,
    pub elements: usize,
}

impl Agreement {
    pub fn ok(&self) -> bool {
        self.outside == 0
    }
}

/// Compares `got` with `want` elementwise (`|got - want| <= atol + rtol *
/// |want|`, numpy's `allclose`); shapes and dtypes must agree. NaN matches
/// only NaN.
pub fn compare(got: &Tensor, want: &Tensor, rtol: f64, atol: f64) -> Result<Agreement, String> {
    if got.shape() != want.shape() {
        return Err(format!(
            "shape {} but the reference is {}",
            got.shape(),
            want.shape()
        ));
    }
    let pairs: Vec<(f64, f64)> = match (got.data(), want.data()) {
        (TensorData::F32(g), TensorData::F32(w)) => g
            .iter()
            .zip(w)
            .map(|(&a, &b)| (f64::from(a), f64::from(b)))
            .collect(),
        (TensorData::I64(g), TensorData::I64(w)) => g
            .iter()
            .zip(w)
            .map(|(&a, &b)| (a as f64, b as f64))
            .collect(),
        _ => {
            return Err(format!(
                "dtype {} but the reference is {}",
                got.dtype(),
                want.dtype()
            ))
        }
    };
    let mut a = Agreement {
        max_abs: 0.0,
        max_rel: 0.0,
        outside: 0,
        elements: pairs.len(),
    };
    for (g, w) in pairs {
        if g.is_nan() && w.is_nan() {
            continue;
        }
        let d = (g - w).abs();
        if d.is_nan() || d > atol + rtol * w.abs() {
            a.outside += 1;
        }
        let d = if d.is_nan() { f64::INFINITY } else { d };
        a.max_abs = a.max_abs.max(d);
        if w.abs() > atol {
            a.max_rel = a.max_rel.max(d / w.abs());
        }
    }
    Ok(a)
}
