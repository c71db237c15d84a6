//! Gradients that route values: max-reduction, slice, embedding lookup and
//! the cross-entropy loss.

use super::{dims, fin, fout, iin, split, R};
use crate::exec::{TensorMut, TensorRef};

/// (x, y, dy) -> dx: each reduced group's dy goes to its first maximum.
pub(super) fn reduce_max(
    axes: &[usize],
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> R {
    let (x, y, dy) = (fin(inputs, 0)?, fin(inputs, 1)?, fin(inputs, 2)?);
    let xd = dims(inputs, 0)?;
    let dx = fout(outputs, 0)?;
    if dx.len() != x.len() || y.len() != dy.len() {
        return Err("operand lengths differ".into());
    }
    if let Some(a) = axes.iter().find(|&&a| a >= xd.len()) {
        return Err(format!("axis {a} out of range for rank {}", xd.len()));
    }
    // Strides of the reduced tensor in x's index space (0 on reduced axes).
    let mut strides = vec![0usize; xd.len()];
    let mut s = 1;
    for (k, &d) in xd.iter().enumerate().rev() {
        if !axes.contains(&k) {
            strides[k] = s;
            s *= d;
        }
    }
    if s != y.len() {
        return Err(format!("y holds {} values, expected {s}", y.len()));
    }
    dx.fill(0.0);
    let mut taken = vec![false; y.len()];
    let mut idx = vec![0usize; xd.len()];
    for (i, &v) in x.iter().enumerate() {
        let r: usize = idx.iter().zip(&strides).map(|(a, b)| a * b).sum();
        if !taken[r] && v == y[r] {
            dx[i] = dy[r];
            taken[r] = true;
        }
        for k in (0..xd.len()).rev() {
            idx[k] += 1;
            if idx[k] < xd[k] {
                break;
            }
            idx[k] = 0;
        }
    }
    Ok(())
}

/// (dy) -> dx: dy placed at start.. along `axis`, zeros elsewhere.
pub(super) fn slice(
    axis: usize,
    start: usize,
    input_dim: usize,
    inputs: &[TensorRef<'_>],
    outputs: &mut [TensorMut<'_>],
) -> R {
    let dy = fin(inputs, 0)?;
    let (outer, len, inner) = split(dims(inputs, 0)?, axis)?;
    let dx = fout(outputs, 0)?;
    if start + len > input_dim || dx.len() != outer * input_dim * inner {
        return Err(format!(
            "slice {start}..{} does not fit length {input_dim}",
            start + len
        ));
    }
    dx.fill(0.0);
    for o in 0..outer {
        let src = &dy[o * len * inner..(o + 1) * len * inner];
        let at = (o * input_dim + start) * inner;
        dx[at..at + len * inner].copy_from_slice(src);
    }
    Ok(())
}

/// (indices, dy) -> dtable: rows of dy summed into their table rows.
pub(super) fn embedding(num: usize, inputs: &[TensorRef<'_>], outputs: &mut [TensorMut<'_>]) -> R {
    let (idx, dy) = (iin(inputs, 0)?, fin(inputs, 1)?);
    let dt = fout(outputs, 0)?;
    let d = dt.len().checked_div(num).unwrap_or(0);
    if d * idx.len() != dy.len() || d * num != dt.len() {
        return Err("dy does not match indices and table".into());
    }
    dt.fill(0.0);
    for (k, &i) in idx.iter().enumerate() {
        let row = usize::try_from(i)
            .ok()
            .filter(|&r| r < num)
            .ok_or_else(|| format!("index {i} out of range for {num} embeddings"))?;
        for (t, g) in dt[row * d..(row + 1) * d]
            .iter_mut()
            .zip(&dy[k * d..(k + 1) * d])
        {
            *t += g;
        }
    }
    Ok(())
}

/// (logits [N, C], labels [N], dloss) -> (softmax(logits) - onehot) · dloss / N.
pub(super) fn cross_entropy(inputs: &[TensorRef<'_>], outputs: &mut [TensorMut<'_>]) -> R {
    let (z, labels, dl) = (fin(inputs, 0)?, iin(inputs, 1)?, fin(inputs, 2)?);
    let zd = dims(inputs, 0)?;
    let dx = fout(outputs, 0)?;
    let (n, c) = match zd {
        [n, c] => (*n, *c),
        _ => return Err(format!("logits must be [N, C], got {zd:?}")),
    };
    let g = *dl.first().ok_or("dloss is empty")?;
    if labels.len() != n || dx.len() != z.len() || n == 0 {
        return Err("labels or output do not match logits".into());
    }
    let scale = g / n as f32;
    for r in 0..n {
        let row = &z[r * c..(r + 1) * c];
        let out = &mut dx[r * c..(r + 1) * c];
        let label = usize::try_from(labels[r])
            .ok()
            .filter(|&l| l < c)
            .ok_or_else(|| format!("label {} out of range for {c} classes", labels[r]))?;
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = row.iter().map(|v| (v - m).exp()).sum();
        for (o, v) in out.iter_mut().zip(row) {
            *o = (v - m).exp() / sum * scale;
        }
        out[label] -= scale;
    }
    Ok(())
}
