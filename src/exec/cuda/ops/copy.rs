//! Device fills and copies: plain byte copies and strided copies
//! (transpose, slice, concat, broadcast) planned by merging axes and
//! widening the unit each thread moves.

use lanes_adaptor::DType;

use super::geometry::{collapse, i, strided, Strided};
use crate::exec::cuda::device::grid;
use crate::exec::cuda::elem::Elem;
use crate::exec::cuda::program::{dev_err, CudaProgram};
use crate::exec::ExecError;

/// A strided copy after merging axes and widening its unit.
#[derive(Debug, Clone, Copy)]
struct CopyPlan {
    s: Strided,
    ob: usize,
    ib: usize,
    /// Bytes moved per index: 2, 4, 8 or 16.
    unit: usize,
}

impl CopyPlan {
    /// `None` when there is nothing to copy. `out` and `inp` are the base
    /// addresses (their alignment decides the widest unit).
    fn new(s: &Strided, ob: usize, ib: usize, esize: usize, out: u64, inp: u64) -> Option<Self> {
        let rank = s.rank as usize;
        if s.dims[..rank].contains(&0) {
            return None;
        }
        let as_usize = |v: &[i32]| v[..rank].iter().map(|&x| x as usize).collect::<Vec<_>>();
        // Axes of size 1 dropped, neighbours both sides step over as one merged.
        let (mut dims, mut sa, mut sb) =
            collapse(&as_usize(&s.dims), &as_usize(&s.sa), &as_usize(&s.sb));
        let (mut ob, mut ib, mut unit) = (ob, ib, esize);
        if let (Some(&1), Some(&1)) = (sa.last(), sb.last()) {
            let r = dims.len();
            for w in [16usize, 8, 4] {
                if w <= esize {
                    continue;
                }
                let f = w / esize;
                let fits = dims[r - 1] % f == 0
                    && sa[..r - 1].iter().chain(&sb[..r - 1]).all(|&x| x % f == 0)
                    && ob % f == 0
                    && ib % f == 0
                    && out % w as u64 == 0
                    && inp % w as u64 == 0;
                if fits {
                    dims[r - 1] /= f;
                    for x in sa[..r - 1].iter_mut().chain(sb[..r - 1].iter_mut()) {
                        *x /= f;
                    }
                    ob /= f;
                    ib /= f;
                    unit = w;
                    break;
                }
            }
        }
        let s = strided(&dims, &sa, &sb)?;
        Some(CopyPlan { s, ob, ib, unit })
    }
}

impl CudaProgram {
    /// Sets `n` f32 values at `ptr` to `v`.
    pub(super) fn fill(&self, ptr: u64, n: usize, v: f32) -> Result<(), ExecError> {
        self.fill_as(Elem::F32, ptr, n, v)
    }

    /// Sets `n` values of type `elem` at `ptr` to `v` (rounded to `elem`).
    pub(super) fn fill_as(&self, elem: Elem, ptr: u64, n: usize, v: f32) -> Result<(), ExecError> {
        let n32 = i(n);
        self.kt("fill", elem, grid(n), &[&ptr, &n32, &v])
    }

    pub(super) fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), ExecError> {
        if dst == src || bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges are arena ranges of `bytes` bytes (same type).
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())
        }
        .map_err(|e| dev_err("device copy", e))
    }

    /// Copies the index space of `s`: out[ob + idx·sa] = in[ib + idx·sb]
    /// (element offsets and strides of `dtype`). Axes that are contiguous on
    /// both sides are merged first, and where the inner axis is contiguous
    /// on both sides and every offset and stride allows it, the copy moves 8
    /// or 16 bytes at a time (a concat or a slice becomes row copies).
    pub(super) fn strided_copy(
        &self,
        dtype: DType,
        out: u64,
        inp: u64,
        s: Strided,
        ob: usize,
        ib: usize,
    ) -> Result<(), ExecError> {
        let esize = dtype.size();
        let Some(c) = CopyPlan::new(&s, ob, ib, esize, out, inp) else {
            return Ok(());
        };
        let n = (0..c.s.rank as usize)
            .map(|k| c.s.dims[k] as usize)
            .product::<usize>();
        let (n32, ob, ib) = (i(n), i(c.ob), i(c.ib));
        let name = match c.unit {
            16 => "strided_copy128",
            8 => "strided_copy64",
            4 => "strided_copy32",
            _ => "strided_copy16",
        };
        self.k(name, grid(n), &[&out, &inp, &n32, &c.s, &ob, &ib])
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::super::geometry::{contiguous_strides, prod};
    use super::*;

    /// What the strided copy kernels do, on bytes: `unit` bytes per index.
    fn run_copy(out: &mut [u8], inp: &[u8], s: &Strided, ob: usize, ib: usize, unit: usize) {
        let rank = s.rank as usize;
        let n: usize = (0..rank).map(|k| s.dims[k] as usize).product();
        for q in 0..n {
            let (mut rem, mut oo, mut oi) = (q, ob, ib);
            for d in (0..rank).rev() {
                let k = rem % s.dims[d] as usize;
                rem /= s.dims[d] as usize;
                oo += k * s.sa[d] as usize;
                oi += k * s.sb[d] as usize;
            }
            out[oo * unit..(oo + 1) * unit].copy_from_slice(&inp[oi * unit..(oi + 1) * unit]);
        }
    }

    /// The planned copy (merged, widened) writes the same bytes as the
    /// element-wise one, for base addresses `out_base` and `in_base`;
    /// returns the unit the plan chose.
    fn same_as_elementwise(
        s: Strided,
        ob: usize,
        ib: usize,
        esize: usize,
        out_len: usize,
        in_len: usize,
        (out_base, in_base): (u64, u64),
    ) -> usize {
        let inp: Vec<u8> = (0..in_len * esize).map(|k| (k * 7 + 3) as u8).collect();
        let mut want = vec![0u8; out_len * esize];
        run_copy(&mut want, &inp, &s, ob, ib, esize);
        let mut got = vec![0u8; out_len * esize];
        match CopyPlan::new(&s, ob, ib, esize, out_base, in_base) {
            Some(c) => {
                assert!(c.s.rank <= s.rank);
                run_copy(&mut got, &inp, &c.s, c.ob, c.ib, c.unit);
                assert_eq!(got, want, "plan {c:?} of {s:?}");
                c.unit
            }
            None => {
                assert_eq!(got, want);
                0
            }
        }
    }

    fn concat_units(
        dims: &[Vec<usize>],
        axis: usize,
        esize: usize,
        bases: (u64, u64),
    ) -> Vec<usize> {
        let mut o = dims[0].clone();
        o[axis] = dims.iter().map(|d| d[axis]).sum();
        let ost = contiguous_strides(&o);
        let mut at = 0;
        let mut units = Vec::new();
        for d in dims {
            let s = strided(d, &ost, &contiguous_strides(d)).unwrap();
            units.push(same_as_elementwise(
                s,
                at * ost[axis],
                0,
                esize,
                prod(&o),
                prod(d),
                bases,
            ));
            at += d[axis];
        }
        units
    }

    #[test]
    fn concat_rows_widen_only_where_aligned() {
        // Inception-like: channels concat of [8, c, 5, 5], c multiple of 4
        // but 25 per plane: rows of c·25 floats at offsets of at·25.
        let u = concat_units(
            &[vec![2, 64, 5, 5], vec![2, 64, 5, 5], vec![2, 96, 5, 5]],
            1,
            4,
            (0, 256),
        );
        assert_eq!(u, vec![16, 16, 16]);
        // Odd channel counts and odd planes: 4-byte units.
        let u = concat_units(&[vec![3, 3, 3, 3], vec![3, 5, 3, 3]], 1, 4, (0, 0));
        assert_eq!(u, vec![4, 4]);
        // Last axis, odd widths; i64 elements.
        for axis in 0..3 {
            let with = |d: [usize; 3], k: usize| {
                let mut d = d.to_vec();
                d[axis] = k;
                d
            };
            let odd = [with([3, 2, 5], 3), with([3, 2, 5], 1), with([3, 2, 5], 7)];
            concat_units(&odd, axis, 8, (0, 0));
            concat_units(&odd, axis, 4, (0, 0));
            let even = [with([4, 2, 6], 6), with([4, 2, 6], 2)];
            concat_units(&even, axis, 4, (0, 64));
        }
        // Even widths but a base address only 8-byte aligned: 8-byte units.
        let u = concat_units(&[vec![2, 4], vec![2, 8]], 1, 4, (8, 0));
        assert_eq!(u, vec![8, 8]);
        // Axis 0: the whole input is one contiguous run.
        let u = concat_units(&[vec![1, 3], vec![2, 3]], 0, 4, (0, 0));
        assert_eq!(u, vec![4, 4]);
    }

    #[test]
    fn slices_and_transposes_keep_their_bytes() {
        // Slice of [2, 6, 8] along axis 1 from 2, length 3.
        let d = [2usize, 6, 8];
        let o = [2usize, 3, 8];
        let st = contiguous_strides(&d);
        let s = strided(&o, &contiguous_strides(&o), &st).unwrap();
        assert_eq!(
            same_as_elementwise(s, 0, 2 * st[1], 4, prod(&o), prod(&d), (0, 0)),
            16
        );
        // An odd offset: not a multiple of 4 floats.
        let s = strided(&o, &contiguous_strides(&o), &st).unwrap();
        assert_eq!(
            same_as_elementwise(s, 0, 2 * 8 + 1, 4, prod(&o), prod(&d), (0, 0)),
            4
        );
        // BERT's head split: [B, S, H, dh] -> [B, H, S, dh], dh contiguous.
        let d = [2usize, 3, 4, 8];
        let perm = [0usize, 2, 1, 3];
        let st = contiguous_strides(&d);
        let o: Vec<usize> = perm.iter().map(|&p| d[p]).collect();
        let sb: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
        let s = strided(&o, &contiguous_strides(&o), &sb).unwrap();
        assert_eq!(
            same_as_elementwise(s, 0, 0, 4, prod(&o), prod(&d), (0, 0)),
            16
        );
        // A full transpose has no contiguous inner axis.
        let d = [3usize, 5];
        let o = [5usize, 3];
        let st = contiguous_strides(&d);
        let s = strided(&o, &contiguous_strides(&o), &[st[1], st[0]]).unwrap();
        assert_eq!(same_as_elementwise(s, 0, 0, 4, 15, 15, (0, 0)), 4);
        // Scalars and size-1 axes.
        let s = strided(&[1, 1], &[1, 1], &[1, 1]).unwrap();
        assert_eq!(same_as_elementwise(s, 0, 0, 8, 1, 1, (0, 0)), 8);
        // Nothing to copy.
        let s = strided(&[2, 0], &[0, 1], &[0, 1]).unwrap();
        assert_eq!(same_as_elementwise(s, 0, 0, 4, 0, 0, (0, 0)), 0);
    }

    /// 16-bit tensors: a contiguous copy widens to 16-byte units, rows of
    /// an even number of halves to 4 bytes where 8 do not fit, odd rows or
    /// an odd offset stay at 2 bytes; every plan writes the element-wise
    /// copy's bytes.
    #[test]
    fn half_copies_widen_by_bytes() {
        let flat = |n: usize, ob: usize| {
            let s = strided(&[n], &[1], &[1]).unwrap();
            same_as_elementwise(s, ob, 0, 2, n + ob, n, (0, 0))
        };
        assert_eq!(flat(48, 0), 16);
        assert_eq!(flat(6, 0), 4);
        assert_eq!(flat(15, 0), 2);
        assert_eq!(flat(48, 1), 2);
        assert_eq!(
            concat_units(&[vec![4, 3, 2], vec![4, 5, 2]], 1, 2, (0, 0)),
            [4, 4]
        );
        assert_eq!(
            concat_units(&[vec![4, 3], vec![4, 5]], 1, 2, (0, 0)),
            [2, 2]
        );
        let (d, o) = ([4usize, 6, 10], [10usize, 4, 6]);
        let st = contiguous_strides(&d);
        let sb = [st[2], st[0], st[1]];
        let s = strided(&o, &contiguous_strides(&o), &sb).unwrap();
        assert_eq!(
            same_as_elementwise(s, 0, 0, 2, prod(&o), prod(&d), (0, 0)),
            2
        );
    }
}
