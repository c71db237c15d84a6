//! Constant folding: ONNX ops evaluated at import on values known then
//! (shapes at the chosen batch size, constants, initializers). This is what
//! turns `Shape → Gather → Unsqueeze → Concat → Reshape` chains, position
//! ids and mask arithmetic on constants into plain constants.

use super::attrs::Attrs;
use super::value::{
    broadcast, broadcast_index, cast, elem_of, from_proto, numel, Elem, Host, HostData,
};

type R<T> = Result<T, String>;

/// Evaluates `op` on known inputs (`None` for an omitted optional input).
/// `Ok(None)` when the op is not one the importer folds.
pub fn eval(op: &str, a: &Attrs<'_>, inp: &[Option<&Host>], limit: usize) -> R<Option<Vec<Host>>> {
    let x = |k: usize| -> R<&Host> {
        inp.get(k)
            .copied()
            .flatten()
            .ok_or_else(|| format!("input {k} is missing"))
    };
    let one = |h: Host| Ok(Some(vec![h]));
    match op {
        "Identity" | "Dropout" => one(x(0)?.clone()),
        "Constant" => one(constant(a, limit)?),
        "ConstantOfShape" => {
            let dims = dims_of(x(0)?)?;
            let n = numel(&dims, limit)?;
            let fill = match a.tensor("value") {
                Some(t) => from_proto(t, limit)?,
                None => Host::new(vec![1], HostData::F32(vec![0.0]))?,
            };
            if fill.len() != 1 {
                return Err("value must hold one element".into());
            }
            let data = match fill.data {
                HostData::F32(v) => HostData::F32(vec![v[0]; n]),
                HostData::I64(v) => HostData::I64(vec![v[0]; n]),
                HostData::Bool(v) => HostData::Bool(vec![v[0]; n]),
            };
            one(Host::new(dims, data)?)
        }
        "Cast" => {
            let to = elem_of(a.int("to").ok_or("attribute `to` is missing")? as i32)?;
            one(cast(x(0)?, to)?)
        }
        "Gather" => {
            let (d, i) = (x(0)?, x(1)?);
            let axis = norm_axis(a.int("axis").unwrap_or(0), d.dims.len())?;
            let idx = i.as_i64s()?;
            let n = d.dims[axis];
            let (outer, inner) = (
                d.dims[..axis].iter().product::<usize>(),
                d.dims[axis + 1..].iter().product::<usize>(),
            );
            let mut dims = d.dims[..axis].to_vec();
            dims.extend_from_slice(&i.dims);
            dims.extend_from_slice(&d.dims[axis + 1..]);
            numel(&dims, limit)?;
            let mut pick = Vec::new();
            for o in 0..outer {
                for &k in &idx {
                    let k = norm_index(k, n)?;
                    for j in 0..inner {
                        pick.push((o * n + k) * inner + j);
                    }
                }
            }
            one(d.pick(dims, &pick)?)
        }
        "GatherElements" => {
            let (d, i) = (x(0)?, x(1)?);
            let r = d.dims.len();
            let axis = norm_axis(a.int("axis").unwrap_or(0), r)?;
            if i.dims.len() != r {
                return Err("data and indices must have the same rank".into());
            }
            let idx = i.as_i64s()?;
            let dstr = strides(&d.dims);
            let mut pick = Vec::with_capacity(idx.len());
            for (lin, &k) in idx.iter().enumerate() {
                let mut rem = lin;
                let mut off = 0usize;
                for ax in (0..r).rev() {
                    let p = rem % i.dims[ax].max(1);
                    rem /= i.dims[ax].max(1);
                    let p = if ax == axis {
                        norm_index(k, d.dims[ax])?
                    } else {
                        p
                    };
                    if p >= d.dims[ax] {
                        return Err("indices exceed data".into());
                    }
                    off += p * dstr[ax];
                }
                pick.push(off);
            }
            one(d.pick(i.dims.clone(), &pick)?)
        }
        "Unsqueeze" => {
            let d = x(0)?;
            let axes = match inp.get(1).copied().flatten() {
                Some(h) => h.as_i64s()?,
                None => a.ints("axes").ok_or("axes are missing")?,
            };
            one(d.reshaped(unsqueeze(&d.dims, &axes)?)?)
        }
        "Squeeze" => {
            let d = x(0)?;
            let axes = match inp.get(1).copied().flatten() {
                Some(h) => Some(h.as_i64s()?),
                None => a.ints("axes"),
            };
            one(d.reshaped(squeeze(&d.dims, axes.as_deref())?)?)
        }
        "Flatten" => {
            let d = x(0)?;
            one(d.reshaped(flatten(&d.dims, a.int("axis").unwrap_or(1))?)?)
        }
        "Reshape" => {
            let d = x(0)?;
            let shape = x(1)?.as_i64s()?;
            one(d.reshaped(reshape(
                &d.dims,
                &shape,
                a.int("allowzero").unwrap_or(0) != 0,
            )?)?)
        }
        "Concat" => {
            let parts: Vec<&Host> = (0..inp.len()).map(x).collect::<R<_>>()?;
            one(concat(
                &parts,
                a.int("axis").ok_or("attribute `axis` is missing")?,
                limit,
            )?)
        }
        "Transpose" => {
            let d = x(0)?;
            let perm = perm_of(a, d.dims.len())?;
            let dims: Vec<usize> = perm.iter().map(|&p| d.dims[p]).collect();
            let st = strides(&d.dims);
            let pst: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
            let pick = walk(&dims, &pst);
            one(d.pick(dims, &pick)?)
        }
        "Slice" => {
            let d = x(0)?;
            let starts = x(1)?.as_i64s()?;
            let ends = x(2)?.as_i64s()?;
            let axes = inp
                .get(3)
                .copied()
                .flatten()
                .map(|h| h.as_i64s())
                .transpose()?;
            let steps = inp
                .get(4)
                .copied()
                .flatten()
                .map(|h| h.as_i64s())
                .transpose()?;
            let ranges = slice_ranges(&d.dims, &starts, &ends, axes.as_deref(), steps.as_deref())?;
            let dims: Vec<usize> = ranges.iter().map(|r| r.2).collect();
            let st = strides(&d.dims);
            let mut pick = Vec::new();
            let base: i64 = ranges.iter().zip(&st).map(|(r, &s)| r.0 * s as i64).sum();
            let total = numel(&dims, limit)?;
            let mut pos = vec![0usize; dims.len()];
            for _ in 0..total {
                let off: i64 = base
                    + pos
                        .iter()
                        .zip(&ranges)
                        .zip(&st)
                        .map(|((&p, r), &s)| p as i64 * r.1 * s as i64)
                        .sum::<i64>();
                pick.push(usize::try_from(off).map_err(|_| "slice out of range")?);
                for ax in (0..dims.len()).rev() {
                    pos[ax] += 1;
                    if pos[ax] < dims[ax] {
                        break;
                    }
                    pos[ax] = 0;
                }
            }
            one(d.pick(dims, &pick)?)
        }
        "Expand" => {
            let d = x(0)?;
            let shape = dims_of(x(1)?)?;
            let out = broadcast(&d.dims, &shape)?;
            numel(&out, limit)?;
            let pick = broadcast_index(&d.dims, &out);
            one(d.pick(out, &pick)?)
        }
        "Range" => {
            let (s, l, dl) = (x(0)?, x(1)?, x(2)?);
            match s.elem() {
                Elem::I64 => {
                    let (s, l, dl) = (s.scalar_i64()?, l.scalar_i64()?, dl.scalar_i64()?);
                    if dl == 0 {
                        return Err("delta is 0".into());
                    }
                    // In f64: no overflow; a huge count saturates and
                    // fails the limit.
                    let n = ((l as f64 - s as f64) / dl as f64).ceil().max(0.0) as usize;
                    numel(&[n], limit)?;
                    one(Host::i64s(
                        vec![n],
                        (0..n as i64)
                            .map(|k| s.wrapping_add(k.wrapping_mul(dl)))
                            .collect(),
                    )?)
                }
                _ => {
                    let (s, l, dl) = (s.scalar_f32()?, l.scalar_f32()?, dl.scalar_f32()?);
                    if dl == 0.0 || !dl.is_finite() {
                        return Err("delta must be finite and non-zero".into());
                    }
                    let n = ((l - s) / dl).ceil().max(0.0) as usize;
                    numel(&[n], limit)?;
                    one(Host::new(
                        vec![n],
                        HostData::F32((0..n).map(|k| s + k as f32 * dl).collect()),
                    )?)
                }
            }
        }
        "Add" | "Sub" | "Mul" | "Div" | "Pow" | "Min" | "Max" if inp.len() == 2 => {
            one(arith(op, x(0)?, x(1)?, limit)?)
        }
        "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" => {
            one(compare(op, x(0)?, x(1)?, limit)?)
        }
        "And" | "Or" | "Xor" => {
            let (p, q) = (bools(x(0)?)?, bools(x(1)?)?);
            let (dims, v) = zip(&x(0)?.dims, &p, &x(1)?.dims, &q, limit, |a, b| {
                Ok(match op {
                    "And" => a && b,
                    "Or" => a || b,
                    _ => a != b,
                })
            })?;
            one(Host::new(dims, HostData::Bool(v))?)
        }
        "Not" => {
            let d = x(0)?;
            let v = bools(d)?.iter().map(|b| !b).collect();
            one(Host::new(d.dims.clone(), HostData::Bool(v))?)
        }
        "Neg" => {
            let d = x(0)?;
            let data = match &d.data {
                HostData::F32(v) => HostData::F32(v.iter().map(|x| -x).collect()),
                HostData::I64(v) => HostData::I64(v.iter().map(|x| x.wrapping_neg()).collect()),
                HostData::Bool(_) => return Err("Neg of bool".into()),
            };
            one(Host::new(d.dims.clone(), data)?)
        }
        "Where" => {
            let (c, p, q) = (x(0)?, x(1)?, x(2)?);
            let cb = bools(c)?;
            let pq = broadcast(&p.dims, &q.dims)?;
            let out = broadcast(&c.dims, &pq)?;
            numel(&out, limit)?;
            let (ci, pi, qi) = (
                broadcast_index(&c.dims, &out),
                broadcast_index(&p.dims, &out),
                broadcast_index(&q.dims, &out),
            );
            let pp = p.pick(out.clone(), &pi)?;
            let qq = q.pick(out.clone(), &qi)?;
            let take = |k: usize| cb[ci[k]];
            let data = match (pp.data, qq.data) {
                (HostData::F32(a), HostData::F32(b)) => HostData::F32(
                    (0..a.len())
                        .map(|k| if take(k) { a[k] } else { b[k] })
                        .collect(),
                ),
                (HostData::I64(a), HostData::I64(b)) => HostData::I64(
                    (0..a.len())
                        .map(|k| if take(k) { a[k] } else { b[k] })
                        .collect(),
                ),
                (HostData::Bool(a), HostData::Bool(b)) => HostData::Bool(
                    (0..a.len())
                        .map(|k| if take(k) { a[k] } else { b[k] })
                        .collect(),
                ),
                _ => return Err("the two branches have different types".into()),
            };
            one(Host::new(out, data)?)
        }
        "Shape" => {
            let d = x(0)?;
            one(shape_of(&d.dims, a)?)
        }
        "Size" => one(Host::i64s(vec![], vec![x(0)?.len() as i64])?),
        _ => Ok(None),
    }
}

/// The `Shape` op's result for a value of `dims` (with opset 15's start/end).
pub fn shape_of(dims: &[usize], a: &Attrs<'_>) -> R<Host> {
    let r = dims.len() as i64;
    let clamp = |v: i64| (if v < 0 { v + r } else { v }).clamp(0, r) as usize;
    let s = clamp(a.int("start").unwrap_or(0));
    let e = clamp(a.int("end").unwrap_or(r));
    let v: Vec<i64> = dims[s..e.max(s)].iter().map(|&d| d as i64).collect();
    Host::i64s(vec![v.len()], v)
}

fn constant(a: &Attrs<'_>, limit: usize) -> R<Host> {
    if let Some(t) = a.tensor("value") {
        return from_proto(t, limit);
    }
    if let Some(v) = a.float("value_float") {
        return Host::new(vec![], HostData::F32(vec![v]));
    }
    if let Some(v) = a.int("value_int") {
        return Host::i64s(vec![], vec![v]);
    }
    if let Some(v) = a.floats("value_floats") {
        return Host::new(vec![v.len()], HostData::F32(v));
    }
    if let Some(v) = a.ints("value_ints") {
        return Host::i64s(vec![v.len()], v);
    }
    Err("no supported value attribute".into())
}

/// A shape tensor's values as dimensions.
pub fn dims_of(h: &Host) -> R<Vec<usize>> {
    h.as_i64s()?
        .into_iter()
        .map(|d| usize::try_from(d).map_err(|_| format!("negative dimension {d}")))
        .collect()
}

pub fn norm_axis(axis: i64, rank: usize) -> R<usize> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if (0..r).contains(&a) {
        Ok(a as usize)
    } else {
        Err(format!("axis {axis} out of range for rank {rank}"))
    }
}

fn norm_index(k: i64, n: usize) -> R<usize> {
    let v = if k < 0 { k + n as i64 } else { k };
    if (0..n as i64).contains(&v) {
        Ok(v as usize)
    } else {
        Err(format!("index {k} out of range for length {n}"))
    }
}

pub fn strides(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1].saturating_mul(dims[i + 1]);
    }
    s
}

/// Offsets (index · strides) of every index of `dims`, row-major.
fn walk(dims: &[usize], st: &[usize]) -> Vec<usize> {
    let total: usize = dims.iter().product();
    let mut out = Vec::with_capacity(total);
    let mut pos = vec![0usize; dims.len()];
    for _ in 0..total {
        out.push(pos.iter().zip(st).map(|(p, s)| p * s).sum());
        for ax in (0..dims.len()).rev() {
            pos[ax] += 1;
            if pos[ax] < dims[ax] {
                break;
            }
            pos[ax] = 0;
        }
    }
    out
}

pub fn unsqueeze(dims: &[usize], axes: &[i64]) -> R<Vec<usize>> {
    let r = dims.len() + axes.len();
    let mut ins = vec![false; r];
    for &ax in axes {
        let a = norm_axis(ax, r)?;
        if ins[a] {
            return Err(format!("axis {ax} listed twice"));
        }
        ins[a] = true;
    }
    let mut it = dims.iter();
    Ok(ins
        .iter()
        .map(|&i| {
            if i {
                1
            } else {
                it.next().copied().unwrap_or(1)
            }
        })
        .collect())
}

pub fn squeeze(dims: &[usize], axes: Option<&[i64]>) -> R<Vec<usize>> {
    match axes {
        None => Ok(dims.iter().copied().filter(|&d| d != 1).collect()),
        Some(axes) => {
            let mut drop = vec![false; dims.len()];
            for &ax in axes {
                let a = norm_axis(ax, dims.len())?;
                if dims[a] != 1 {
                    return Err(format!("cannot squeeze axis {ax} of length {}", dims[a]));
                }
                drop[a] = true;
            }
            Ok(dims
                .iter()
                .zip(&drop)
                .filter(|(_, &d)| !d)
                .map(|(&x, _)| x)
                .collect())
        }
    }
}

pub fn flatten(dims: &[usize], axis: i64) -> R<Vec<usize>> {
    let r = dims.len() as i64;
    let a = if axis < 0 { axis + r } else { axis };
    if !(0..=r).contains(&a) {
        return Err(format!("axis {axis} out of range for rank {r}"));
    }
    let a = a as usize;
    Ok(vec![dims[..a].iter().product(), dims[a..].iter().product()])
}

/// ONNX Reshape's target: 0 copies the input's dimension (unless
/// `allowzero`), -1 is inferred.
pub fn reshape(dims: &[usize], shape: &[i64], allowzero: bool) -> R<Vec<usize>> {
    let total: usize = dims.iter().product();
    let mut out = Vec::with_capacity(shape.len());
    let mut infer = None;
    for (i, &s) in shape.iter().enumerate() {
        match s {
            -1 if infer.is_none() => {
                infer = Some(i);
                out.push(1);
            }
            0 if !allowzero => out.push(*dims.get(i).ok_or("0 refers past the input's rank")?),
            s if s >= 0 => out.push(s as usize),
            s => return Err(format!("invalid target dimension {s}")),
        }
    }
    let known = out
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or("target shape overflows")?;
    if let Some(i) = infer {
        if known == 0 || total % known != 0 {
            return Err(format!("cannot reshape {dims:?} to {shape:?}"));
        }
        out[i] = total / known;
    } else if known != total {
        return Err(format!("cannot reshape {dims:?} to {shape:?}"));
    }
    Ok(out)
}

pub fn perm_of(a: &Attrs<'_>, rank: usize) -> R<Vec<usize>> {
    match a.ints("perm") {
        Some(p) => {
            let p: Vec<usize> = p.iter().map(|&x| norm_axis(x, rank)).collect::<R<_>>()?;
            let mut seen = vec![false; rank];
            if p.len() != rank || p.iter().any(|&x| std::mem::replace(&mut seen[x], true)) {
                return Err(format!("{p:?} is not a permutation of 0..{rank}"));
            }
            Ok(p)
        }
        None => Ok((0..rank).rev().collect()),
    }
}

/// Per axis of `dims`: (start, step, length) of an ONNX Slice.
pub fn slice_ranges(
    dims: &[usize],
    starts: &[i64],
    ends: &[i64],
    axes: Option<&[i64]>,
    steps: Option<&[i64]>,
) -> R<Vec<(i64, i64, usize)>> {
    let mut out: Vec<(i64, i64, usize)> = dims.iter().map(|&d| (0, 1, d)).collect();
    if starts.len() != ends.len() {
        return Err("starts and ends differ in length".into());
    }
    let axes: Vec<usize> = match axes {
        Some(a) => a
            .iter()
            .map(|&x| norm_axis(x, dims.len()))
            .collect::<R<_>>()?,
        None => (0..starts.len()).collect(),
    };
    if axes.len() != starts.len() || steps.is_some_and(|s| s.len() != starts.len()) {
        return Err("starts, ends, axes and steps differ in length".into());
    }
    for (k, &ax) in axes.iter().enumerate() {
        let d = *dims.get(ax).ok_or("axis out of range")? as i64;
        let step = steps.map(|s| s[k]).unwrap_or(1);
        if step == 0 {
            return Err("step 0".into());
        }
        if d == 0 {
            out[ax] = (0, step, 0);
            continue;
        }
        let fix = |v: i64| if v < 0 { v.saturating_add(d) } else { v };
        let (s, e) = (fix(starts[k]), fix(ends[k]));
        // In i128: a step of any i64 cannot overflow; len <= d.
        let st = i128::from(step);
        let (s, len) = if step > 0 {
            let (s, e) = (s.clamp(0, d), e.clamp(0, d));
            let (s1, e1) = (i128::from(s), i128::from(e));
            (s, if e > s { (e1 - s1 + st - 1) / st } else { 0 })
        } else {
            let (s, e) = (s.clamp(0, d - 1), e.clamp(-1, d - 1));
            let (s1, e1) = (i128::from(s), i128::from(e));
            (s, if s > e { (s1 - e1 - st - 1) / -st } else { 0 })
        };
        out[ax] = (s, step, len as usize);
    }
    Ok(out)
}

fn concat(parts: &[&Host], axis: i64, limit: usize) -> R<Host> {
    let first = parts.first().ok_or("no inputs")?;
    let r = first.dims.len();
    let axis = norm_axis(axis, r)?;
    let mut dims = first.dims.clone();
    dims[axis] = 0;
    for p in parts {
        if p.dims.len() != r || p.elem() != first.elem() {
            return Err("inputs differ in rank or type".into());
        }
        for i in 0..r {
            if i != axis && p.dims[i] != first.dims[i] {
                return Err(format!("cannot concat {:?} with {:?}", first.dims, p.dims));
            }
        }
        dims[axis] += p.dims[axis];
    }
    numel(&dims, limit)?;
    let outer: usize = dims[..axis].iter().product();
    let mut data = match first.data {
        HostData::F32(_) => HostData::F32(Vec::new()),
        HostData::I64(_) => HostData::I64(Vec::new()),
        HostData::Bool(_) => HostData::Bool(Vec::new()),
    };
    for o in 0..outer {
        for p in parts {
            let block: usize = p.dims[axis..].iter().product();
            let range = o * block..(o + 1) * block;
            match (&mut data, &p.data) {
                (HostData::F32(d), HostData::F32(s)) => d.extend_from_slice(&s[range]),
                (HostData::I64(d), HostData::I64(s)) => d.extend_from_slice(&s[range]),
                (HostData::Bool(d), HostData::Bool(s)) => d.extend_from_slice(&s[range]),
                _ => return Err("inputs differ in type".into()),
            }
        }
    }
    Host::new(dims, data)
}

fn bools(h: &Host) -> R<Vec<bool>> {
    match &h.data {
        HostData::Bool(v) => Ok(v.clone()),
        _ => Err(format!("expected bool, got {}", h.elem())),
    }
}

type Zipped<U> = (Vec<usize>, Vec<U>);

fn zip<T: Copy, U>(
    ad: &[usize],
    a: &[T],
    bd: &[usize],
    b: &[T],
    limit: usize,
    f: impl Fn(T, T) -> R<U>,
) -> R<Zipped<U>> {
    let out = broadcast(ad, bd)?;
    numel(&out, limit)?;
    let (ai, bi) = (broadcast_index(ad, &out), broadcast_index(bd, &out));
    let v = ai
        .iter()
        .zip(&bi)
        .map(|(&i, &j)| f(a[i], b[j]))
        .collect::<R<Vec<U>>>()?;
    Ok((out, v))
}

fn arith(op: &str, a: &Host, b: &Host, limit: usize) -> R<Host> {
    match (&a.data, &b.data) {
        (HostData::F32(p), HostData::F32(q)) => {
            let (dims, v) = zip(&a.dims, p, &b.dims, q, limit, |x: f32, y: f32| {
                Ok(match op {
                    "Add" => x + y,
                    "Sub" => x - y,
                    "Mul" => x * y,
                    "Div" => x / y,
                    "Pow" => x.powf(y),
                    "Min" => x.min(y),
                    _ => x.max(y),
                })
            })?;
            Host::new(dims, HostData::F32(v))
        }
        (HostData::I64(p), HostData::I64(q)) => {
            let (dims, v) = zip(&a.dims, p, &b.dims, q, limit, |x: i64, y: i64| match op {
                "Add" => Ok(x.wrapping_add(y)),
                "Sub" => Ok(x.wrapping_sub(y)),
                "Mul" => Ok(x.wrapping_mul(y)),
                "Div" => x
                    .checked_div(y)
                    .ok_or_else(|| "integer division by zero".to_string()),
                "Pow" => u32::try_from(y)
                    .map(|e| x.wrapping_pow(e))
                    .map_err(|_| "negative integer exponent".to_string()),
                "Min" => Ok(x.min(y)),
                _ => Ok(x.max(y)),
            })?;
            Host::new(dims, HostData::I64(v))
        }
        _ => Err(format!("{op} of {} and {}", a.elem(), b.elem())),
    }
}

fn compare(op: &str, a: &Host, b: &Host, limit: usize) -> R<Host> {
    fn cmp<T: PartialOrd>(op: &str, x: T, y: T) -> bool {
        match op {
            "Equal" => x == y,
            "Less" => x < y,
            "Greater" => x > y,
            "LessOrEqual" => x <= y,
            _ => x >= y,
        }
    }
    let (dims, v) = match (&a.data, &b.data) {
        (HostData::F32(p), HostData::F32(q)) => {
            zip(&a.dims, p, &b.dims, q, limit, |x, y| Ok(cmp(op, x, y)))?
        }
        (HostData::I64(p), HostData::I64(q)) => {
            zip(&a.dims, p, &b.dims, q, limit, |x, y| Ok(cmp(op, x, y)))?
        }
        (HostData::Bool(p), HostData::Bool(q)) => {
            zip(&a.dims, p, &b.dims, q, limit, |x, y| Ok(cmp(op, x, y)))?
        }
        _ => return Err(format!("{op} of {} and {}", a.elem(), b.elem())),
    };
    Host::new(dims, HostData::Bool(v))
}
