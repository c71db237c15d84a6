//! NumPy arrays ↔ Lanes tensors.
//!
//! Feeds: a float32, float16 or int64 array is read through NumPy's buffer;
//! a C-contiguous one is copied once, in one `memcpy`, into the tensor the
//! request owns (the wire then sends that tensor's bytes as they are).
//! Outputs: the vector a reply was decoded into becomes the NumPy array's
//! memory (no copy); the array owns it from then on.
//!
//! NumPy has no bfloat16 of its own; `ml_dtypes.bfloat16` (what JAX and
//! TensorFlow use) is one. An array whose dtype is named `bfloat16` is read
//! through its raw 16-bit values, and a bf16 result is returned as such an
//! array when `ml_dtypes` imports, else refused with a `TypeError`.

use crate::errors::{client_error, local, FeedError};
use lanes_adaptor::wire::copy_bytes;
use lanes_adaptor::{bf16, f16, DType, FeedBuffers, Tensor, TensorData, TensorType, VarValues};
use numpy::{PyArray1, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Whether `value` is an array of a dtype named `bfloat16` (ml_dtypes').
fn is_bfloat16(value: &Bound<'_, PyAny>) -> bool {
    value
        .getattr("dtype")
        .and_then(|d| d.getattr("name"))
        .and_then(|n| n.extract::<String>())
        .is_ok_and(|n| n == "bfloat16")
}

/// A bfloat16 array's values as bf16 (C order), read through a `uint16`
/// view of the same memory.
fn bf16_values(value: &Bound<'_, PyAny>) -> PyResult<(Vec<usize>, Vec<bf16>)> {
    let bits = value.call_method1("view", ("uint16",))?;
    let a = bits.extract::<PyReadonlyArrayDyn<'_, u16>>()?;
    let shape = a.shape().to_vec();
    let v = a.as_array().iter().map(|&b| bf16::from_bits(b)).collect();
    Ok((shape, v))
}

/// One feed: a float32, float16, bfloat16 or int64 array (any layout),
/// anything else refused with the dtypes Lanes takes.
pub fn tensor_from_numpy(name: &str, value: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let py = value.py();
    if let Ok(a) = value.extract::<PyReadonlyArrayDyn<'_, f16>>() {
        let shape = a.shape().to_vec();
        let data = match a.as_slice() {
            Ok(s) => s.to_vec(),
            Err(_) => a.as_array().iter().copied().collect(),
        };
        return Tensor::from_f16(shape, data).map_err(|e| crate::errors::tensor_error(name, e));
    }
    if is_bfloat16(value) {
        let (shape, data) = bf16_values(value)?;
        return Tensor::from_bf16(shape, data).map_err(|e| crate::errors::tensor_error(name, e));
    }
    if let Ok(a) = value.extract::<PyReadonlyArrayDyn<'_, f32>>() {
        let shape = a.shape().to_vec();
        let data = match a.as_slice() {
            Ok(s) => s.to_vec(),
            Err(_) => a.as_array().iter().copied().collect(),
        };
        return Tensor::from_f32(shape, data).map_err(|e| crate::errors::tensor_error(name, e));
    }
    if let Ok(a) = value.extract::<PyReadonlyArrayDyn<'_, i64>>() {
        let shape = a.shape().to_vec();
        let data = match a.as_slice() {
            Ok(s) => s.to_vec(),
            Err(_) => a.as_array().iter().copied().collect(),
        };
        return Tensor::from_i64(shape, data).map_err(|e| crate::errors::tensor_error(name, e));
    }
    let what = match value.getattr("dtype") {
        Ok(d) => format!(
            "an array of dtype {}",
            d.str().map(|s| s.to_string()).unwrap_or_default()
        ),
        Err(_) => format!(
            "a {}",
            value
                .get_type()
                .name()
                .map(|s| s.to_string())
                .unwrap_or_default()
        ),
    };
    Err(local(
        py,
        FeedError::new_err(format!(
            "feed `{name}`: got {what}; Lanes takes NumPy arrays of dtype float32, float16, bfloat16 (ml_dtypes) or int64 (convert with .astype(numpy.float32))"
        )),
    ))
}

/// The type of a float32, float16, bfloat16 or int64 array; `None` for
/// anything else.
pub fn feed_type(value: &Bound<'_, PyAny>) -> Option<TensorType> {
    if let Ok(a) = value.extract::<PyReadonlyArrayDyn<'_, f16>>() {
        return Some(TensorType::new(DType::F16, a.shape().to_vec()));
    }
    if is_bfloat16(value) {
        let shape = value.getattr("shape").ok()?.extract::<Vec<usize>>().ok()?;
        return Some(TensorType::new(DType::BF16, shape));
    }
    if let Ok(a) = value.extract::<PyReadonlyArrayDyn<'_, f32>>() {
        return Some(TensorType::f32(a.shape().to_vec()));
    }
    if let Ok(a) = value.extract::<PyReadonlyArrayDyn<'_, i64>>() {
        return Some(TensorType::i64(a.shape().to_vec()));
    }
    None
}

/// Copies the array `value` into feed `name`'s buffer (one `memcpy` when it
/// is C-contiguous, else element by element in C order). The buffer's type
/// was made from this array's ([`feed_type`]).
pub fn write_feed(buffers: &mut FeedBuffers, name: &str, value: &Bound<'_, PyAny>) -> PyResult<()> {
    fn fill<T: Copy + Send + Sync + numpy::Element>(dst: &mut [T], a: &PyReadonlyArrayDyn<'_, T>) {
        match a.as_slice() {
            Ok(s) if s.len() == dst.len() => copy_bytes(dst, s),
            _ => dst
                .iter_mut()
                .zip(a.as_array().iter())
                .for_each(|(d, s)| *d = *s),
        }
    }
    if let Ok(a) = value.extract::<PyReadonlyArrayDyn<'_, f32>>() {
        fill(buffers.f32s_mut(name).map_err(client_error)?, &a);
        return Ok(());
    }
    if let Ok(a) = value.extract::<PyReadonlyArrayDyn<'_, i64>>() {
        fill(buffers.i64s_mut(name).map_err(client_error)?, &a);
        return Ok(());
    }
    if value.extract::<PyReadonlyArrayDyn<'_, f16>>().is_ok() || is_bfloat16(value) {
        // Half feeds go through a tensor (one more copy than the above).
        let t = tensor_from_numpy(name, value)?;
        return buffers.write(name, &t).map_err(client_error);
    }
    Err(local(
        value.py(),
        FeedError::new_err(format!(
            "feed `{name}`: Lanes takes NumPy arrays of dtype float32, float16, bfloat16 or int64"
        )),
    ))
}

/// A tensor as a NumPy array that owns the tensor's vector (no copy).
pub fn tensor_to_numpy<'py>(py: Python<'py>, t: Tensor) -> PyResult<Bound<'py, PyAny>> {
    let dims = t.shape().dims().to_vec();
    Ok(match t.into_data() {
        TensorData::F32(v) => PyArray1::from_vec(py, v).reshape(dims)?.into_any(),
        TensorData::I64(v) => PyArray1::from_vec(py, v).reshape(dims)?.into_any(),
        TensorData::F16(v) => PyArray1::from_vec(py, v).reshape(dims)?.into_any(),
        TensorData::BF16(v) => {
            let bfloat16 = py
                .import("ml_dtypes")
                .and_then(|m| m.getattr("bfloat16"))
                .map_err(|e| {
                    pyo3::exceptions::PyTypeError::new_err(format!(
                        "a bfloat16 result needs the ml_dtypes package for its NumPy dtype \
                         (pip install ml-dtypes), or Cast it to float32 in the graph: {e}"
                    ))
                })?;
            let bits: Vec<u16> = v.iter().map(|x| x.to_bits()).collect();
            PyArray1::from_vec(py, bits)
                .reshape(dims)?
                .into_any()
                .call_method1("view", (bfloat16,))?
        }
    })
}

/// `{name: array}` from a dict of arrays.
pub fn values_from_dict(d: &Bound<'_, PyDict>) -> PyResult<VarValues> {
    let mut out = VarValues::new();
    for (k, v) in d.iter() {
        let name: String = k.extract()?;
        let t = tensor_from_numpy(&name, &v)?;
        out.insert(name, t);
    }
    Ok(out)
}

/// A dict of arrays from named tensors.
pub fn values_to_dict<'py>(py: Python<'py>, values: VarValues) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, t) in values {
        d.set_item(k, tensor_to_numpy(py, t)?)?;
    }
    Ok(d)
}
