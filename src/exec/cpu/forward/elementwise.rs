//! Elementwise ops with numpy broadcasting, activations, softmax.

use lanes_adaptor::graph::op::{dropout_keep, dropout_threshold};
use lanes_adaptor::{bf16, f16, DType, Op};
use rayon::prelude::*;

use super::{broadcast_strides, gather, split};
use crate::exec::{DataMut, DataRef, ExecError, TensorMut, TensorRef};

/// Below this many elements a kernel runs on one thread.
const PAR_MIN: usize = 1 << 15;

/// Add, Sub, Mul, Div with numpy broadcasting.
pub(super) fn binary(
    op: &Op,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let f: fn(f32, f32) -> f32 = match op {
        Op::Add => |a, b| a + b,
        Op::Sub => |a, b| a - b,
        Op::Mul => |a, b| a * b,
        _ => |a, b| a / b,
    };
    let out_dims = outputs[0].dims().to_vec();
    let y = outputs[0].f32s()?;
    let a = expand(&inputs[0], &out_dims)?;
    let b = expand(&inputs[1], &out_dims)?;
    if y.len() >= PAR_MIN {
        y.par_iter_mut()
            .zip(a.par_iter().zip(b.par_iter()))
            .for_each(|(y, (&a, &b))| *y = f(a, b));
    } else {
        for (y, (&a, &b)) in y.iter_mut().zip(a.iter().zip(b.iter())) {
            *y = f(a, b);
        }
    }
    Ok(())
}

/// Where: `a` where `cond` is non-zero, else `b`, all three broadcast.
pub(super) fn select(
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let out_dims = outputs[0].dims().to_vec();
    let y = outputs[0].f32s()?;
    let c = expand(&inputs[0], &out_dims)?;
    let a = expand(&inputs[1], &out_dims)?;
    let b = expand(&inputs[2], &out_dims)?;
    for (y, ((&c, &a), &b)) in y.iter_mut().zip(c.iter().zip(a.iter()).zip(b.iter())) {
        *y = if c != 0.0 { a } else { b };
    }
    Ok(())
}

/// Cast between dtypes: f32 to i64 truncates toward zero, saturating (NaN
/// becomes 0); to f32, f16 and bf16 rounds to nearest, ties to even (a half
/// value widens to f32 exactly, so a float cast rounds once; an i64 rounds
/// from its f64 value, exact up to 2^53).
pub(super) fn cast(
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let (from, to) = (inputs[0].ty.dtype, outputs[0].ty.dtype);
    if from.is_half() || to.is_half() {
        match (&inputs[0].data, &mut outputs[0].data) {
            (DataRef::I64(x), DataMut::F16(y)) => {
                for (y, &x) in y.iter_mut().zip(x.iter()) {
                    *y = f16::from_f64(x as f64);
                }
            }
            (DataRef::I64(x), DataMut::BF16(y)) => {
                for (y, &x) in y.iter_mut().zip(x.iter()) {
                    *y = bf16::from_f64(x as f64);
                }
            }
            (_, DataMut::I64(_)) => return Err(ExecError::dtype(DType::F32, to)),
            _ => {
                let x = inputs[0].to_f32_vec()?;
                outputs[0].store_f32(&x)?;
            }
        }
        return Ok(());
    }
    match (&inputs[0].data, &mut outputs[0].data) {
        (DataRef::F32(x), DataMut::F32(y)) => y.copy_from_slice(x),
        (DataRef::I64(x), DataMut::I64(y)) => y.copy_from_slice(x),
        (DataRef::F32(x), DataMut::I64(y)) => {
            for (y, &x) in y.iter_mut().zip(x.iter()) {
                *y = x as i64;
            }
        }
        (DataRef::I64(x), DataMut::F32(y)) => {
            for (y, &x) in y.iter_mut().zip(x.iter()) {
                *y = x as f32;
            }
        }
        _ => return Err(ExecError::dtype(from, to)),
    }
    Ok(())
}

/// A dropout mask: 0 where `dropout_keep` drops the element, else 1 / (1 - p).
pub(super) fn dropout_mask(
    p: f32,
    salt: u32,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let seed = inputs[0].i64s()?.first().copied().unwrap_or(0);
    let y = outputs[0].f32s()?;
    let threshold = dropout_threshold(p);
    let scale = 1.0 / (1.0 - p);
    let f = |(i, y): (usize, &mut f32)| {
        *y = if dropout_keep(seed, salt, i as u64, threshold) {
            scale
        } else {
            0.0
        };
    };
    if y.len() >= PAR_MIN {
        y.par_iter_mut().enumerate().for_each(f);
    } else {
        y.iter_mut().enumerate().for_each(f);
    }
    Ok(())
}

/// The input's values broadcast to `out` (borrowed when already that shape).
fn expand<'a>(t: &TensorRef<'a>, out: &[usize]) -> Result<std::borrow::Cow<'a, [f32]>, ExecError> {
    let v = t.f32s()?;
    if t.dims() == out {
        return Ok(std::borrow::Cow::Borrowed(v));
    }
    let mut dst = vec![0.0; super::prod(out)];
    gather(v, out, &broadcast_strides(t.dims(), out), &mut dst);
    Ok(std::borrow::Cow::Owned(dst))
}

/// Exact (erf) GELU.
pub(crate) fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// Logistic sigmoid, stable for large |x|.
pub(crate) fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// Relu, Gelu, Sigmoid, Tanh, Exp, Log, Sqrt, Scale, Erf, IsNan, Clip.
pub(super) fn unary(
    op: &Op,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let x = inputs[0].f32s()?;
    let y = outputs[0].f32s()?;
    let factor = match op {
        Op::Scale(s) => *s,
        _ => 1.0,
    };
    let f = |x: f32| -> f32 {
        match op {
            Op::Relu => x.max(0.0),
            Op::Gelu => gelu(x),
            Op::Sigmoid => sigmoid(x),
            Op::Tanh => x.tanh(),
            Op::Exp => x.exp(),
            Op::Log => x.ln(),
            Op::Sqrt => x.sqrt(),
            Op::Erf => libm::erff(x),
            Op::IsNan => f32::from(u8::from(x.is_nan())),
            Op::HardSigmoid => (x + 3.0).clamp(0.0, 6.0) / 6.0,
            Op::HardSwish => x * (x + 3.0).clamp(0.0, 6.0) / 6.0,
            // NaN stays NaN, as PyTorch's clamp and ONNX Clip give it.
            Op::Clip { min, max } if !x.is_nan() => x.clamp(*min, *max),
            Op::Clip { .. } => x,
            _ => x * factor,
        }
    };
    if y.len() >= PAR_MIN {
        y.par_iter_mut()
            .zip(x.par_iter())
            .for_each(|(y, &x)| *y = f(x));
    } else {
        for (y, &x) in y.iter_mut().zip(x) {
            *y = f(x);
        }
    }
    Ok(())
}

/// Softmax or log-softmax over `axis`, subtracting the maximum first.
pub(super) fn softmax(
    axis: usize,
    log: bool,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> Result<(), ExecError> {
    let x = inputs[0].f32s()?;
    let (outer, len, inner) = split(inputs[0].dims(), axis);
    let y = outputs[0].f32s()?;
    let block = len * inner;
    if block == 0 {
        return Ok(());
    }
    let run = |(xb, yb): (&[f32], &mut [f32])| {
        for i in 0..inner {
            let m = (0..len)
                .map(|j| xb[j * inner + i])
                .fold(f32::NEG_INFINITY, f32::max);
            let m = if m.is_finite() { m } else { 0.0 };
            let mut sum = 0.0f32;
            for j in 0..len {
                let e = (xb[j * inner + i] - m).exp();
                yb[j * inner + i] = e;
                sum += e;
            }
            if log {
                let ls = sum.ln() + m;
                for j in 0..len {
                    yb[j * inner + i] = xb[j * inner + i] - ls;
                }
            } else {
                for j in 0..len {
                    yb[j * inner + i] /= sum;
                }
            }
        }
    };
    if outer * block >= PAR_MIN {
        x.par_chunks(block)
            .zip(y.par_chunks_mut(block))
            .for_each(run);
    } else {
        x.chunks(block).zip(y.chunks_mut(block)).for_each(run);
    }
    Ok(())
}
