//! Dynamic batching: requests of several callers gathered into one Run
//! (along the first dimension), its outputs split back per caller.
//!
//! A model's thread takes the first request waiting, then, while the rows
//! gathered are under `max_batch_size`, every request already queued and
//! those that arrive until `max_queue_delay_microseconds` after the first
//! one arrived; it stops early at a `preferred_batch_size`. A request that
//! would overflow the batch waits for the next one.

use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TryRecvError};
use lanes_adaptor::{DType, FeedBuffers, Tensor, TensorData, TensorType};

use super::error::ApiError;
use super::model::{Job, ModelInfo};
use super::repository::DynamicBatching;
use super::tensors::Feed;

/// Gathers a batch starting with `first`; the request that did not fit,
/// if one was taken.
pub fn gather(
    first: Job,
    rx: &Receiver<Job>,
    cfg: &DynamicBatching,
    max_rows: usize,
) -> (Vec<Job>, Option<Job>) {
    let deadline = first.arrived + Duration::from_micros(cfg.max_queue_delay_us);
    let mut rows = first.rows;
    let mut group = vec![first];
    while rows < max_rows && !cfg.preferred_batch_sizes.contains(&rows) {
        let next = match rx.try_recv() {
            Ok(j) => Some(j),
            Err(TryRecvError::Disconnected) => None,
            Err(TryRecvError::Empty) => {
                let now = Instant::now();
                if now >= deadline {
                    None
                } else {
                    rx.recv_timeout(deadline - now).ok()
                }
            }
        };
        match next {
            None => break,
            Some(j) if rows + j.rows <= max_rows => {
                rows += j.rows;
                group.push(j);
            }
            Some(j) => return (group, Some(j)),
        }
    }
    (group, None)
}

/// A request of a gathered batch: its rows and where its answer goes.
#[derive(Debug)]
pub struct Part {
    pub rows: usize,
    pub arrived: Instant,
    pub reply: tokio::sync::oneshot::Sender<Result<Vec<Tensor>, ApiError>>,
}

/// Each request's feeds (one per model input, in the model's order).
pub type FeedsOf = Vec<Vec<(String, Feed)>>;

/// A batch's requests: their feeds, and where each answer goes.
pub fn parts_of(group: Vec<Job>) -> (FeedsOf, Vec<Part>) {
    let mut parts = Vec::with_capacity(group.len());
    let mut feeds_of = Vec::with_capacity(group.len());
    for j in group {
        parts.push(Part {
            rows: j.rows,
            arrived: j.arrived,
            reply: j.reply,
        });
        feeds_of.push(j.feeds);
    }
    (feeds_of, parts)
}

/// The batch's feed types: each input's of `rows` rows (a model that
/// batches), or as the model gives it.
pub fn feed_types(model: &ModelInfo, rows: usize) -> Vec<(String, TensorType)> {
    model
        .inputs
        .iter()
        .map(|s| {
            let dims = if model.max_batch_size > 0 {
                std::iter::once(rows)
                    .chain(s.dims.iter().copied())
                    .collect()
            } else {
                s.dims.clone()
            };
            (s.name.clone(), TensorType::new(s.dtype, dims))
        })
        .collect()
}

/// Writes each input's rows of every request, in order, into `buffers`
/// (made for [`feed_types`] of the batch's rows): the one copy of the
/// requests' values on their way to the service.
pub fn fill(buffers: &mut FeedBuffers, feeds_of: &FeedsOf) -> Result<(), String> {
    let inputs = feeds_of.first().map_or(0, Vec::len);
    for k in 0..inputs {
        let name = feeds_of[0][k].0.as_str();
        let (dst, ty) = buffers.ne_bytes_mut(name).map_err(|e| e.to_string())?;
        fill_input(dst, ty.dtype, k, feeds_of)?;
    }
    Ok(())
}

/// Writes input `k`'s rows of every request, in order, into `dst`, the
/// batch's buffer for it (of element type `dtype`), which they must fill.
fn fill_input(dst: &mut [u8], dtype: DType, k: usize, feeds_of: &FeedsOf) -> Result<(), String> {
    let mut at = 0usize;
    let mut name = "";
    for feeds in feeds_of {
        let Some((n, feed)) = feeds.get(k) else {
            return Err("requests of one batch differ in inputs".into());
        };
        name = n;
        let t = feed.ty();
        if t.dtype != dtype {
            return Err(format!("input `{n}`: types of one batch differ"));
        }
        let end = at
            .checked_add(t.bytes())
            .filter(|&e| e <= dst.len())
            .ok_or_else(|| format!("input `{n}`: the batch's rows overflow its buffer"))?;
        if !feed.write_to(&mut dst[at..end]) {
            return Err(format!("input `{n}`: its bytes do not match its shape"));
        }
        at = end;
    }
    if at != dst.len() {
        return Err(format!("input `{name}`: the batch's rows do not fill it"));
    }
    Ok(())
}

/// The batch's feeds as tensors of their own (each input's rows of every
/// request, in order): where the feeds cannot go through feed buffers.
pub fn join(feeds_of: &FeedsOf) -> Result<Vec<(String, Tensor)>, String> {
    if let [one] = feeds_of.as_slice() {
        return one
            .iter()
            .map(|(n, f)| {
                let t = f
                    .clone()
                    .into_tensor()
                    .map_err(|e| format!("input `{n}`: {e}"))?;
                Ok((n.clone(), t))
            })
            .collect();
    }
    let inputs = feeds_of.first().map_or(0, Vec::len);
    let mut joined = Vec::with_capacity(inputs);
    for k in 0..inputs {
        let mut name = String::new();
        let mut dims: Vec<usize> = Vec::new();
        let mut data: Option<TensorData> = None;
        for feeds in feeds_of {
            let Some((n, f)) = feeds.get(k) else {
                return Err("requests of one batch differ in inputs".into());
            };
            let t = f
                .clone()
                .into_tensor()
                .map_err(|e| format!("input `{n}`: {e}"))?;
            name.clone_from(n);
            let d = t.shape().dims();
            let same = d.get(1..) == dims.get(1..);
            match dims.first_mut() {
                None => dims = d.to_vec(),
                Some(rows) if same => *rows += d.first().copied().unwrap_or(0),
                Some(_) => return Err(format!("input `{n}`: shapes of one batch differ")),
            }
            match (&mut data, t.into_data()) {
                (None, x) => data = Some(x),
                (Some(TensorData::F32(a)), TensorData::F32(b)) => a.extend_from_slice(&b),
                (Some(TensorData::I64(a)), TensorData::I64(b)) => a.extend_from_slice(&b),
                _ => return Err(format!("input `{n}`: types of one batch differ")),
            }
        }
        let data = data.ok_or("an empty batch")?;
        let t = Tensor::new(dims, data).map_err(|e| e.to_string())?;
        joined.push((name, t));
    }
    Ok(joined)
}

/// Each request's rows of every output.
pub fn split(out: Vec<Tensor>, parts: &[Part], model: &str) -> Result<Vec<Vec<Tensor>>, ApiError> {
    if parts.len() == 1 {
        return Ok(vec![out]);
    }
    let total: usize = parts.iter().map(|p| p.rows).sum();
    let mut per: Vec<Vec<Tensor>> = parts
        .iter()
        .map(|_| Vec::with_capacity(out.len()))
        .collect();
    for t in &out {
        let dims = t.shape().dims();
        if dims.first() != Some(&total) {
            return Err(ApiError::Internal(format!(
                "model `{model}`: an output of shape {dims:?} has no batch of {total} rows to split"
            )));
        }
        let row: usize = dims.iter().skip(1).product();
        let mut at = 0;
        for (p, dst) in parts.iter().zip(per.iter_mut()) {
            let range = at * row..(at + p.rows) * row;
            at += p.rows;
            let data = match t.data() {
                TensorData::F32(v) => v.get(range).map(|s| TensorData::F32(s.to_vec())),
                TensorData::I64(v) => v.get(range).map(|s| TensorData::I64(s.to_vec())),
                TensorData::F16(v) => v.get(range).map(|s| TensorData::F16(s.to_vec())),
                TensorData::BF16(v) => v.get(range).map(|s| TensorData::BF16(s.to_vec())),
            };
            let mut shape = dims.to_vec();
            shape[0] = p.rows;
            let t = data
                .ok_or_else(|| ApiError::Internal(format!("model `{model}`: an output is short")))
                .and_then(|d| {
                    Tensor::new(shape, d).map_err(|e| ApiError::Internal(e.to_string()))
                })?;
            dst.push(t);
        }
    }
    Ok(per)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::oip::body::Chunks;

    /// A request of `rows` rows of two `v`s: binary data for odd rows,
    /// JSON values for even ones.
    fn job(
        rows: usize,
        v: f32,
    ) -> (
        Job,
        tokio::sync::oneshot::Receiver<Result<Vec<Tensor>, ApiError>>,
    ) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let t = Tensor::from_f32(vec![rows, 2], vec![v; rows * 2]).unwrap();
        let feed = if rows % 2 == 1 {
            let bytes = axum::body::Bytes::from(t.to_le_bytes());
            Feed::Raw {
                ty: t.ty(),
                bytes: Chunks::one(bytes),
            }
        } else {
            Feed::Tensor(t)
        };
        (
            Job {
                rows,
                feeds: vec![("x".into(), feed)],
                arrived: Instant::now(),
                reply: tx,
            },
            rx,
        )
    }

    fn model() -> ModelInfo {
        ModelInfo {
            name: "m".into(),
            version: "1".into(),
            max_batch_size: 4,
            inputs: vec![crate::oip::model::TensorSpec {
                name: "x".into(),
                dtype: DType::F32,
                dims: vec![2],
            }],
            outputs: Vec::new(),
            batching: None,
        }
    }

    #[test]
    fn queued_requests_are_gathered_up_to_the_limit() {
        let (tx, rx) = crossbeam_channel::unbounded();
        let (a, _ra) = job(1, 1.0);
        for (r, v) in [(2, 2.0), (1, 3.0), (1, 4.0)] {
            tx.send(job(r, v).0).unwrap();
        }
        let cfg = DynamicBatching::default();
        let (group, held) = gather(a, &rx, &cfg, 4);
        assert_eq!(
            group.iter().map(|j| j.rows).collect::<Vec<_>>(),
            vec![1, 2, 1]
        );
        assert_eq!(held.map(|j| j.rows), None);
        assert_eq!(rx.len(), 1);
        let (feeds_of, parts) = parts_of(group);
        let feeds = join(&feeds_of).unwrap();
        assert_eq!(feeds[0].1.shape().dims(), &[4, 2]);
        let want = [1., 1., 2., 2., 2., 2., 3., 3.];
        assert_eq!(feeds[0].1.f32s().unwrap(), &want);
        // Into a batch's buffer, the same bytes.
        let mut buf = vec![0u8; 32];
        fill_input(&mut buf, DType::F32, 0, &feeds_of).unwrap();
        assert_eq!(buf, feeds[0].1.to_le_bytes());
        assert!(fill_input(&mut [0u8; 28], DType::F32, 0, &feeds_of)
            .unwrap_err()
            .contains("overflow"));
        assert!(fill_input(&mut [0u8; 36], DType::F32, 0, &feeds_of)
            .unwrap_err()
            .contains("do not fill"));
        assert!(fill_input(&mut buf, DType::I64, 0, &feeds_of)
            .unwrap_err()
            .contains("types"));
        let types = feed_types(&model(), 4);
        assert_eq!(types[0].1, TensorType::new(DType::F32, vec![4, 2]));
        let per = split(vec![feeds[0].1.clone()], &parts, "m").unwrap();
        assert_eq!(per[1][0].shape().dims(), &[2, 2]);
        assert_eq!(per[2][0].f32s().unwrap(), &[3., 3.]);
    }

    #[test]
    fn a_request_that_does_not_fit_is_held_and_a_preferred_size_stops() {
        let (tx, rx) = crossbeam_channel::unbounded();
        tx.send(job(3, 2.0).0).unwrap();
        let (group, held) = gather(job(2, 1.0).0, &rx, &DynamicBatching::default(), 4);
        assert_eq!(group.len(), 1);
        assert_eq!(held.map(|j| j.rows), Some(3));
        tx.send(job(1, 2.0).0).unwrap();
        let cfg = DynamicBatching {
            max_queue_delay_us: 0,
            preferred_batch_sizes: vec![2],
        };
        let (group, held) = gather(job(2, 1.0).0, &rx, &cfg, 4);
        assert_eq!(group.len(), 1);
        assert!(held.is_none());
    }

    #[test]
    fn outputs_without_the_batch_are_an_error() {
        let (a, _ra) = job(1, 1.0);
        let (b, _rb) = job(1, 1.0);
        let (_, parts) = parts_of(vec![a, b]);
        let t = Tensor::from_f32(vec![3], vec![0.0; 3]).unwrap();
        assert!(split(vec![t], &parts, "m").is_err());
    }
}
