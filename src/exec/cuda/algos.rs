//! cuDNN's algorithm choices, kept for the process by convolution shape:
//! the choice (and its workspace size) depends on the pass, the element
//! type, the convolution's attributes, the tensors' shapes and the math
//! mode, never
//! on the weights, so a program of an architecture the service has seen
//! takes its choices from here instead of asking cuDNN's heuristics again
//! (part of the load cache, docs/memory.md). One service drives one
//! device, so the device is not in the key. Bounded: past
//! [`MAX_SHAPES`] the map is emptied and filled again.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};

use cudarc::cudnn::CudnnError;
use lanes_adaptor::Conv2dAttrs;

use super::conv::Algo;
use super::elem::Elem;

/// Most convolution shapes kept.
pub const MAX_SHAPES: usize = 1 << 16;

/// Which pass of a convolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Pass {
    Forward,
    BackwardData,
    BackwardFilter,
}

/// What a choice depends on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct Key {
    pass: Pass,
    elem: Elem,
    attrs: [usize; 7],
    dims: Vec<usize>,
    tf32: bool,
}

impl Key {
    pub fn new(
        pass: Pass,
        elem: Elem,
        a: &Conv2dAttrs,
        x: &[usize],
        w: &[usize],
        y: &[usize],
        tf32: bool,
    ) -> Self {
        let attrs = [
            a.stride[0],
            a.stride[1],
            a.padding[0],
            a.padding[1],
            a.dilation[0],
            a.dilation[1],
            a.groups,
        ];
        // Each shape's length first, so that no two lists of shapes read alike.
        let mut dims = Vec::with_capacity(x.len() + w.len() + y.len() + 3);
        for d in [x, w, y] {
            dims.push(d.len());
            dims.extend_from_slice(d);
        }
        Key {
            pass,
            elem,
            attrs,
            dims,
            tf32,
        }
    }
}

struct Chosen {
    map: Mutex<HashMap<Key, (Algo, usize)>>,
    hits: AtomicU64,
    misses: AtomicU64,
}

fn chosen() -> &'static Chosen {
    static CHOSEN: OnceLock<Chosen> = OnceLock::new();
    CHOSEN.get_or_init(|| Chosen {
        map: Mutex::new(HashMap::new()),
        hits: AtomicU64::new(0),
        misses: AtomicU64::new(0),
    })
}

/// The algorithm and workspace bytes for `key`: kept ones, or `pick`'s
/// (then kept).
pub(super) fn choose(
    key: Key,
    pick: impl FnOnce() -> Result<(Algo, usize), CudnnError>,
) -> Result<(Algo, usize), CudnnError> {
    let c = chosen();
    if let Some(found) = c
        .map
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(&key)
        .copied()
    {
        c.hits.fetch_add(1, Ordering::Relaxed);
        return Ok(found);
    }
    c.misses.fetch_add(1, Ordering::Relaxed);
    let picked = pick()?;
    let mut map = c.map.lock().unwrap_or_else(PoisonError::into_inner);
    if map.len() >= MAX_SHAPES {
        map.clear();
    }
    map.insert(key, picked);
    Ok(picked)
}

/// (hits, misses) of the choices so far.
pub fn stats() -> (u64, u64) {
    let c = chosen();
    (
        c.hits.load(Ordering::Relaxed),
        c.misses.load(Ordering::Relaxed),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_tell_passes_attributes_and_shapes_apart() {
        let a = Conv2dAttrs::default();
        let k = |pass, x: &[usize], tf32| {
            Key::new(pass, Elem::F32, &a, x, &[8, 3, 3, 3], &[1, 8, 30, 30], tf32)
        };
        let x = [1, 3, 32, 32];
        assert_eq!(k(Pass::Forward, &x, false), k(Pass::Forward, &x, false));
        assert_ne!(
            k(Pass::Forward, &x, false),
            k(Pass::BackwardData, &x, false)
        );
        assert_ne!(k(Pass::Forward, &x, false), k(Pass::Forward, &x, true));
        assert_ne!(
            k(Pass::Forward, &x, false),
            k(Pass::Forward, &[2, 3, 32, 32], false)
        );
        let strided = Conv2dAttrs {
            stride: [2, 2],
            ..Conv2dAttrs::default()
        };
        assert_ne!(
            k(Pass::Forward, &x, false),
            Key::new(
                Pass::Forward,
                Elem::F32,
                &strided,
                &x,
                &[8, 3, 3, 3],
                &[1, 8, 30, 30],
                false
            )
        );
        // The element type: fp16 and bf16 convolutions of one shape have
        // their own algorithms.
        let half = |e| {
            Key::new(
                Pass::Forward,
                e,
                &a,
                &x,
                &[8, 3, 3, 3],
                &[1, 8, 30, 30],
                false,
            )
        };
        assert_ne!(k(Pass::Forward, &x, false), half(Elem::F16));
        assert_ne!(half(Elem::F16), half(Elem::Bf16));
    }
}
