//! `.npy` files as tensors, and comparing results against references
//! within a tolerance (`lanes import --check`, the ONNX import tests).

use std::path::Path;

use lanes_adaptor::{DType, Tensor, TensorData, TensorType};
use ndarray::ArrayD;
use ndarray_npy::{read_npy, ReadNpyError};

/// Why an `.npy` file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum NpyError {
    #[error("cannot read `{path}`: {source}")]
    Read { path: String, source: ReadNpyError },
    #[error("`{path}`: {reason}")]
    Shape { path: String, reason: String },
    #[error("cannot write `{path}`: {reason}")]
    Write { path: String, reason: String },
}

/// Reads an `.npy` array (float32/float64 as f32, float16 (`<f2`) as f16,
/// int64/int32 as i64, bool as a 0/1 f32 mask; C order).
pub fn read(path: impl AsRef<Path>) -> Result<Tensor, NpyError> {
    let path = path.as_ref();
    let shape_err = |reason: String| NpyError::Shape {
        path: path.display().to_string(),
        reason,
    };
    if let Some(t) = read_f16(path).map_err(shape_err)? {
        return Ok(t);
    }
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

/// The `.npy` magic string, followed by the format version.
const MAGIC: &[u8] = b"\x93NUMPY";

/// An `.npy` file of `<f2` values as an f16 tensor; `None` for a file of
/// another dtype (or one that is not `.npy`: the general reader says why).
/// ndarray-npy has no f16 element, so this reads the format itself
/// (version 1 to 3 headers, C order).
fn read_f16(path: &Path) -> Result<Option<Tensor>, String> {
    let Ok(bytes) = std::fs::read(path) else {
        return Ok(None);
    };
    let Some(rest) = bytes.strip_prefix(MAGIC) else {
        return Ok(None);
    };
    let (len, rest) = match rest {
        [1, _, a, b, rest @ ..] => (usize::from(u16::from_le_bytes([*a, *b])), rest),
        [2 | 3, _, a, b, c, d, rest @ ..] => {
            let n = u32::from_le_bytes([*a, *b, *c, *d]);
            (usize::try_from(n).map_err(|e| e.to_string())?, rest)
        }
        _ => return Ok(None),
    };
    let Some((header, data)) = rest.split_at_checked(len) else {
        return Err("the header runs past the end of the file".into());
    };
    let header = String::from_utf8_lossy(header);
    if value_of(&header, "descr").map(|d| d.trim_matches(['\'', '"'])) != Some("<f2") {
        return Ok(None);
    }
    if value_of(&header, "fortran_order") != Some("False") {
        return Err("float16 arrays must be in C order".into());
    }
    let shape = value_of(&header, "shape")
        .and_then(|s| s.strip_prefix('('))
        .and_then(|s| s.strip_suffix(')'))
        .ok_or("the header has no shape")?
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.parse::<usize>().map_err(|e| format!("shape `{d}`: {e}")))
        .collect::<Result<Vec<usize>, _>>()?;
    let ty = TensorType::new(DType::F16, shape);
    Tensor::from_le_bytes(&ty, data)
        .map(Some)
        .map_err(|e| e.to_string())
}

/// The text of `key`'s value in an `.npy` header (a Python dict literal
/// of strings, booleans and one tuple).
fn value_of<'h>(header: &'h str, key: &str) -> Option<&'h str> {
    let at = header
        .find(&format!("'{key}'"))
        .or_else(|| header.find(&format!("\"{key}\"")))?;
    let rest = header[at + key.len() + 2..]
        .trim_start()
        .strip_prefix(':')?;
    let rest = rest.trim_start();
    let end = if rest.starts_with('(') {
        rest.find(')')? + 1
    } else {
        rest.find([',', '}']).unwrap_or(rest.len())
    };
    Some(rest[..end].trim())
}

/// Writes a tensor as an `.npy` file (version 1 header, C order): f32 as
/// `<f4`, f16 as `<f2`, i64 as `<i8`. NumPy has no bfloat16 (ml_dtypes adds
/// one), so a bf16 tensor is refused.
pub fn write(path: impl AsRef<Path>, t: &Tensor) -> Result<(), NpyError> {
    let path = path.as_ref();
    let fail = |reason: String| NpyError::Write {
        path: path.display().to_string(),
        reason,
    };
    let descr = match t.dtype() {
        DType::F32 => "<f4",
        DType::F16 => "<f2",
        DType::I64 => "<i8",
        DType::BF16 => return Err(fail("NumPy's .npy format has no bfloat16".into())),
    };
    let dims: Vec<String> = t.shape().dims().iter().map(|d| d.to_string()).collect();
    let shape = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Magic (6) + version (2) + length (2) + header + newline: a multiple
    // of 64 bytes, as NumPy writes it.
    let total = (MAGIC.len() + 4 + header.len() + 1).div_ceil(64) * 64;
    let pad = total - (MAGIC.len() + 4 + header.len() + 1);
    header.push_str(&" ".repeat(pad));
    header.push('\n');
    let len = u16::try_from(header.len()).map_err(|_| fail("the shape is too long".into()))?;
    let mut out = Vec::with_capacity(total + t.numel() * t.dtype().size());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&t.to_le_bytes());
    std::fs::write(path, out).map_err(|e| fail(e.to_string()))
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
        (g, w) if g.dtype() == w.dtype() => match (g.to_f32_vec(), w.to_f32_vec()) {
            (Some(g), Some(w)) => g
                .iter()
                .zip(&w)
                .map(|(&a, &b)| (f64::from(a), f64::from(b)))
                .collect(),
            _ => return Err(format!("dtype {} cannot be compared", got.dtype())),
        },
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

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use lanes_adaptor::f16;

    fn temp(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("lanes-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    #[test]
    fn f16_npy_round_trips_bit_for_bit() {
        let v: Vec<f16> = [1.0f32, -2.5, 65504.0, 6.0e-8, f32::INFINITY, 0.1]
            .iter()
            .map(|&x| f16::from_f32(x))
            .collect();
        let t = Tensor::from_f16([2, 3], v).unwrap();
        let path = temp("h.npy");
        write(&path, &t).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        // The header as NumPy writes it: padded to 64 bytes, `<f2`, C order.
        assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
        let start = 10 + usize::from(u16::from_le_bytes([bytes[8], bytes[9]]));
        assert_eq!(start % 64, 0);
        assert_eq!(bytes.len(), start + 12);
        let header = String::from_utf8_lossy(&bytes[10..start]);
        assert!(header.contains("'descr': '<f2'"), "{header}");
        assert!(header.contains("'shape': (2, 3)"), "{header}");
        assert!(header.ends_with('\n'));
        assert_eq!(&bytes[start..start + 2], &[0x00, 0x3c]);
        assert_eq!(read(&path).unwrap(), t);
        // 1-D shapes are written as a one-element tuple.
        let one = Tensor::from_f16([3], vec![f16::ONE; 3]).unwrap();
        write(&path, &one).unwrap();
        assert_eq!(read(&path).unwrap(), one);
        // f32 and i64 through the same writer, read back by ndarray-npy.
        let f = Tensor::from_f32([2, 2], vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        write(&path, &f).unwrap();
        assert_eq!(read(&path).unwrap(), f);
        let i = Tensor::from_i64([3], vec![1, -2, 3]).unwrap();
        write(&path, &i).unwrap();
        assert_eq!(read(&path).unwrap(), i);
        let b = Tensor::zeros(&TensorType::new(DType::BF16, [2]));
        assert!(matches!(write(&path, &b), Err(NpyError::Write { .. })));
    }

    #[test]
    fn a_truncated_f16_file_is_an_error() {
        let t = Tensor::from_f16([4], vec![f16::ONE; 4]).unwrap();
        let path = temp("short.npy");
        write(&path, &t).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        assert!(matches!(read(&path), Err(NpyError::Shape { .. })));
        std::fs::write(&path, &bytes[..20]).unwrap();
        assert!(read(&path).is_err());
    }

    #[test]
    fn half_tensors_compare_as_their_values() {
        let a = Tensor::from_bf16([2], vec![lanes_adaptor::bf16::ONE; 2]).unwrap();
        let b = Tensor::from_bf16([2], vec![lanes_adaptor::bf16::from_f32(1.01); 2]).unwrap();
        assert!(compare(&a, &b, 0.02, 0.0).unwrap().ok());
        assert!(!compare(&a, &b, 0.001, 0.0).unwrap().ok());
        let f = Tensor::from_f32([2], vec![1.0; 2]).unwrap();
        assert!(compare(&a, &f, 1.0, 1.0).is_err());
    }
}
