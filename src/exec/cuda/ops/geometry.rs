//! Shapes to kernel geometry: the `#[repr(C)]` index structs the CUDA
//! kernels take (strided index spaces, reductions, pooling) and the launch
//! shapes of the per-plane batch-norm kernels.

use cudarc::driver::DeviceRepr;
use lanes_adaptor::Pool2dAttrs;

pub(super) const MAXR: usize = 8;

/// Index space plus two stride sets (see `elementwise.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Strided {
    pub(super) rank: i32,
    pub(super) dims: [i32; MAXR],
    pub(super) sa: [i32; MAXR],
    pub(super) sb: [i32; MAXR],
    /// Division by `dims[k]` as multiply and shift ([`divider`]).
    pub(super) mul: [u32; MAXR],
    pub(super) shr: [i32; MAXR],
}

/// (multiplier, shift) with n / d == (umulhi(n, m) + n) >> s for every
/// 0 <= n < 2³¹ (the kernels' `div_axis`): s = ⌈log₂ d⌉ and
/// m = ⌊2³² (2ˢ − d) / d⌋ + 1, which is below 2³² because 2ˢ⁻¹ < d ≤ 2ˢ.
/// `None` for d = 0.
pub(super) fn divider(d: u32) -> Option<(u32, i32)> {
    if d == 0 {
        return None;
    }
    let s = 32 - (d - 1).leading_zeros();
    let m = ((1u64 << 32) * ((1u64 << s) - d as u64)) / d as u64 + 1;
    Some((u32::try_from(m).ok()?, s as i32))
}
// SAFETY: plain `#[repr(C)]` integers, laid out as the CUDA struct `Strided`.
unsafe impl DeviceRepr for Strided {}

/// Reduction geometry (see `reduce.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Red {
    orank: i32,
    odims: [i32; MAXR],
    ostr: [i32; MAXR],
    rrank: i32,
    rdims: [i32; MAXR],
    rstr: [i32; MAXR],
}
// SAFETY: plain `#[repr(C)]` integers, laid out as the CUDA struct `Red`.
unsafe impl DeviceRepr for Red {}

/// Pooling geometry (see `nn.cu`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Pool {
    n: i32,
    c: i32,
    h: i32,
    w: i32,
    oh: i32,
    ow: i32,
    kh: i32,
    kw: i32,
    sh: i32,
    sw: i32,
    ph: i32,
    pw: i32,
}
// SAFETY: plain `#[repr(C)]` integers, laid out as the CUDA struct `Pool`.
unsafe impl DeviceRepr for Pool {}

pub(super) fn contiguous_strides(d: &[usize]) -> Vec<usize> {
    let mut s = vec![1; d.len()];
    for i in (0..d.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * d[i + 1];
    }
    s
}

pub(super) fn prod(d: &[usize]) -> usize {
    d.iter().product()
}

pub(super) fn i(v: usize) -> i32 {
    // Every tensor was checked to hold at most i32::MAX elements.
    v as i32
}

/// Strides of `src` (right-aligned) read at the indices of `out`, 0 on
/// broadcast axes.
pub(super) fn bcast_strides(src: &[usize], out: &[usize]) -> Vec<usize> {
    let s = contiguous_strides(src);
    let off = out.len() - src.len();
    (0..out.len())
        .map(|k| {
            if k < off || src[k - off] == 1 {
                0
            } else {
                s[k - off]
            }
        })
        .collect()
}

/// The index space `dims` read through strides `sa` and `sb`, with axes of
/// size 1 dropped and neighbours merged where both operands step through
/// them as through one axis (`s[k] == s[k + 1] * dims[k + 1]`, broadcast
/// axes included: 0 == 0 · d). The same elements in the same order, at the
/// smallest rank: [8, 12, 512, 512] + [8, 1, 512, 512] becomes
/// [8, 12, 262144] with b's strides [262144, 0, 1]. Never empty (a scalar
/// space is `[1]`).
pub(super) fn collapse(
    dims: &[usize],
    sa: &[usize],
    sb: &[usize],
) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let (mut d, mut a, mut b): (Vec<usize>, Vec<usize>, Vec<usize>) = (vec![], vec![], vec![]);
    for k in 0..dims.len() {
        if dims[k] == 1 {
            continue;
        }
        if let (Some(&ld), Some(la), Some(lb)) = (d.last(), a.last_mut(), b.last_mut()) {
            if *la == sa[k] * dims[k] && *lb == sb[k] * dims[k] {
                *la = sa[k];
                *lb = sb[k];
                if let Some(x) = d.last_mut() {
                    *x = ld * dims[k];
                }
                continue;
            }
        }
        d.push(dims[k]);
        a.push(sa[k]);
        b.push(sb[k]);
    }
    if d.is_empty() {
        return (vec![1], vec![0], vec![0]);
    }
    (d, a, b)
}

pub(super) fn strided(dims: &[usize], sa: &[usize], sb: &[usize]) -> Option<Strided> {
    if dims.len() > MAXR {
        return None;
    }
    let mut s = Strided {
        rank: dims.len() as i32,
        ..Default::default()
    };
    for k in 0..dims.len() {
        s.dims[k] = i(dims[k]);
        s.sa[k] = i(sa[k]);
        s.sb[k] = i(sb[k]);
        // A zero-length axis has no index to divide (n = 0 elements).
        let (m, sh) = divider(dims[k].max(1) as u32)?;
        s.mul[k] = m;
        s.shr[k] = sh;
    }
    Some(s)
}

/// Reduction of `dims` over `axes` (each a flag per axis).
pub(super) fn red(dims: &[usize], reduced: &[bool]) -> Option<(Red, usize, usize)> {
    if dims.len() > MAXR {
        return None;
    }
    let st = contiguous_strides(dims);
    let mut r = Red::default();
    let (mut n_out, mut n_red) = (1usize, 1usize);
    for k in 0..dims.len() {
        if reduced[k] {
            let j = r.rrank as usize;
            r.rdims[j] = i(dims[k]);
            r.rstr[j] = i(st[k]);
            r.rrank += 1;
            n_red *= dims[k];
        } else {
            let j = r.orank as usize;
            r.odims[j] = i(dims[k]);
            r.ostr[j] = i(st[k]);
            r.orank += 1;
            n_out *= dims[k];
        }
    }
    Some((r, n_out, n_red))
}

pub(super) fn pool(x: &[usize], y: &[usize], p: &Pool2dAttrs) -> Pool {
    Pool {
        n: i(x[0]),
        c: i(x[1]),
        h: i(x[2]),
        w: i(x[3]),
        oh: i(y[2]),
        ow: i(y[3]),
        kh: i(p.kernel[0]),
        kw: i(p.kernel[1]),
        sh: i(p.stride[0]),
        sw: i(p.stride[1]),
        ph: i(p.padding[0]),
        pw: i(p.padding[1]),
    }
}

/// [outer, axis, inner] view of `dims` around `axis`.
pub(super) fn around(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (prod(&dims[..axis]), dims[axis], prod(&dims[axis + 1..]))
}

/// Whether `a` (leading 1s dropped) is a non-empty suffix of `o`: it
/// repeats along o's leading axes.
pub(super) fn repeats(a: &[usize], o: &[usize]) -> bool {
    let lead = a.iter().take_while(|&&d| d == 1).count();
    let core = &a[lead..];
    !core.is_empty() && o.ends_with(core)
}

/// Whether training batch norm over `dims` ([N, C, …]) spreads its sums over
/// one block per (n, c) plane: when the C per-channel blocks alone would
/// leave most of the GPU idle and the grid fits (y ≤ 65535 channels).
pub(super) fn plane_parallel(dims: &[usize]) -> bool {
    dims.len() >= 2 && dims[0] > 1 && dims[1] <= 65_535 && dims[0] <= i32::MAX as usize
}

/// Blocks over `planes` rows (grid y, at most 65535) of `units` items each:
/// up to 256 threads a block (a multiple of 32, no more than the row needs)
/// and up to 8 blocks a row.
pub(in crate::exec::cuda) fn plane_rows(
    units: usize,
    planes: usize,
) -> cudarc::driver::LaunchConfig {
    let threads = units.div_ceil(32).clamp(1, 8) * 32;
    let per_row = units.div_ceil(threads).clamp(1, 8);
    cudarc::driver::LaunchConfig {
        grid_dim: (per_row as u32, planes as u32, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per (n, c) plane (grid x: n, y: c), as many threads as
/// [`plane_rows`] gives a plane of its floats (float4s with `vec4`).
pub(super) fn plane_grid(dims: &[usize], vec4: bool) -> cudarc::driver::LaunchConfig {
    let inner = prod(&dims[2..]);
    let units = if vec4 { inner / 4 } else { inner };
    cudarc::driver::LaunchConfig {
        grid_dim: (dims[0] as u32, dims[1] as u32, 1),
        block_dim: plane_rows(units, 1).block_dim,
        shared_mem_bytes: 0,
    }
}

/// Whether a per-plane kernel over `dims` ([N, C, …]) may move four floats
/// at a time: planes of a multiple of 4 floats, every address 16-byte
/// aligned.
pub(super) fn plane_vec4(dims: &[usize], addrs: &[u64]) -> bool {
    prod(dims.get(2..).unwrap_or(&[])) % 4 == 0 && addrs.iter().all(|a| a % 16 == 0)
}

/// Launch geometry of the elementwise per-plane kernels (`bn_apply_planes`,
/// `bn_grad_dx_planes`): the N·C planes along grid x (no 65,535 limit there)
/// and up to 8 blocks per plane along y, as [`plane_rows`]; `None` where
/// planes are too small for a block each (under 32 floats: the flat kernels
/// run) or too many for grid x.
pub(super) fn plane_cols(dims: &[usize], vec4: bool) -> Option<cudarc::driver::LaunchConfig> {
    let inner = prod(dims.get(2..)?);
    let planes = dims.first()?.checked_mul(*dims.get(1)?)?;
    if inner < 32 || planes == 0 || planes > i32::MAX as usize {
        return None;
    }
    let units = if vec4 { inner / 4 } else { inner };
    let r = plane_rows(units, 1);
    Some(cudarc::driver::LaunchConfig {
        grid_dim: (planes as u32, r.grid_dim.0, 1),
        block_dim: r.block_dim,
        shared_mem_bytes: 0,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The kernels' division, in Rust.
    fn div(n: u32, (m, s): (u32, i32)) -> u32 {
        let t = ((n as u64 * m as u64) >> 32) as u32;
        (t + n) >> s
    }

    #[test]
    fn divider_divides_every_index_exactly() {
        let mut ds: Vec<u32> = (1..=1100).collect();
        ds.extend([
            3072,
            262144,
            50257,
            6304,
            65535,
            65536,
            65537,
            (1 << 30) + 1,
            i32::MAX as u32,
        ]);
        for d in ds {
            let dv = divider(d).unwrap();
            let mut ns: Vec<u32> = (0..2000).collect();
            ns.extend([
                d - 1,
                d,
                d + 1,
                2 * d - 1,
                2 * d,
                (1 << 31) - 1,
                (1 << 31) - 2,
                1 << 30,
            ]);
            let mut x: u64 = d as u64 * 2654435761;
            for _ in 0..2000 {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ns.push(((x >> 33) as u32) & 0x7fff_ffff);
            }
            for n in ns.into_iter().filter(|&n| n < 1 << 31) {
                assert_eq!(div(n, dv), n / d, "{n} / {d}");
            }
        }
        assert_eq!(divider(0), None);
    }

    #[test]
    fn collapse_merges_what_both_operands_step_through_alike() {
        // The causal-mask add: [8, 12, 512, 512] + [8, 1, 512, 512].
        let o = [8, 12, 512, 512];
        let (d, a, b) = collapse(
            &o,
            &bcast_strides(&o, &o),
            &bcast_strides(&[8, 1, 512, 512], &o),
        );
        assert_eq!(d, vec![8, 12, 262144]);
        assert_eq!(a, vec![12 * 262144, 262144, 1]);
        assert_eq!(b, vec![262144, 0, 1]);
        // A scalar against a tensor: one axis, b broadcast along it.
        let o = [8, 512, 3072];
        let (d, a, b) = collapse(&o, &bcast_strides(&o, &o), &bcast_strides(&[1], &o));
        assert_eq!((d, a, b), (vec![8 * 512 * 3072], vec![1], vec![0]));
        // Per-channel scale [N, C, 1, 1] of [N, C, H, W]: b steps per row.
        let o = [2, 3, 4, 5];
        let (d, a, b) = collapse(
            &o,
            &bcast_strides(&o, &o),
            &bcast_strides(&[2, 3, 1, 1], &o),
        );
        assert_eq!((d, a, b), (vec![6, 20], vec![20, 1], vec![1, 0]));
        // A row vector over a column vector keeps both axes.
        let o = [4, 5];
        let (d, a, b) = collapse(&o, &bcast_strides(&[4, 1], &o), &bcast_strides(&[5], &o));
        assert_eq!((d, a, b), (vec![4, 5], vec![1, 0], vec![0, 1]));
        // All ones: a scalar space.
        let (d, _, _) = collapse(&[1, 1], &[0, 0], &[0, 0]);
        assert_eq!(d, vec![1]);
    }

    #[test]
    fn collapse_visits_the_same_offsets_in_the_same_order() {
        // Enumerate both index spaces and compare the (a, b) offset pairs.
        fn offsets(d: &[usize], a: &[usize], b: &[usize]) -> Vec<(usize, usize)> {
            let n: usize = d.iter().product();
            (0..n)
                .map(|mut r| {
                    let (mut oa, mut ob) = (0, 0);
                    for k in (0..d.len()).rev() {
                        let x = r % d[k];
                        r /= d[k];
                        oa += x * a[k];
                        ob += x * b[k];
                    }
                    (oa, ob)
                })
                .collect()
        }
        let cases: [(&[usize], &[usize], &[usize]); 5] = [
            (&[2, 3, 4, 5], &[2, 3, 4, 5], &[3, 1, 5]),
            (&[2, 1, 4, 5], &[2, 1, 4, 5], &[2, 1, 1, 5]),
            (&[3, 4], &[3, 1], &[1, 4]),
            (&[6, 1, 7], &[1], &[6, 1, 7]),
            (&[2, 3, 4], &[2, 3, 4], &[2, 3, 4]),
        ];
        for (o, x, y) in cases {
            let (sa, sb) = (bcast_strides(x, o), bcast_strides(y, o));
            let (d, a, b) = collapse(o, &sa, &sb);
            assert_eq!(
                offsets(o, &sa, &sb),
                offsets(&d, &a, &b),
                "{o:?} {x:?} {y:?}"
            );
        }
    }

    #[test]
    fn repeating_operand_detection() {
        assert!(repeats(&[768], &[8, 128, 768]));
        assert!(repeats(&[1, 128, 768], &[8, 128, 768]));
        assert!(!repeats(&[8, 1, 768], &[8, 128, 768]));
        assert!(!repeats(&[1, 1], &[8, 128]));
        assert!(!repeats(&[128, 1], &[8, 128, 768]));
    }
}
