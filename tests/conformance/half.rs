//! fp16 and bf16 on CUDA against the CPU (docs/precision.md).
//!
//! The reference of a half op is the CPU's f32 op on the widened inputs
//! (exact), its result rounded to the dtype (`half`'s round to nearest
//! even): what a CUDA kernel does per element, and what the CPU backend's
//! half ops do. Casts are compared with the CPU backend's own Cast and with
//! `half`'s conversions, bit for bit.
//!
//! Tolerances: copies and casts bit-exact (NaN: any NaN); elementwise maps
//! within 1 unit in the last place (f32 transcendentals may differ in their
//! last f32 bit between the GPU and the CPU, and FMA contraction too,
//! which moves a rounded half value by at most one step); matrix products
//! and convolutions within 2 units of the dtype's relative precision u
//! (fp16 2^-10, bf16 2^-7) plus 2u·sqrt(K) absolute for a sum of K products
//! of values in [-1, 1] (cuBLAS and cuDNN may sum partial products in the
//! output type). A failure names the op, dtype, fetch, index, both values
//! and their bits.

use super::*;
use lanes_adaptor::{bf16, f16, DType, TensorData, TensorType};

/// A graph from its inputs, returning the output to fetch.
type Build = dyn Fn(&mut GraphBuilder, &[Outlet]) -> Outlet;

const HALVES: [DType; 2] = [DType::F16, DType::BF16];

/// The dtype's relative precision: one unit in the last place at 1.
fn unit(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => 1.0 / 1024.0,
        DType::BF16 => 1.0 / 128.0,
        _ => f32::EPSILON,
    }
}

/// `v` rounded to `dtype` (to nearest, ties to even), as a tensor.
fn narrow(dtype: DType, dims: &[usize], v: &[f32]) -> Tensor {
    let data = TensorData::from_f32_rounded(dtype, v).expect("a float dtype");
    Tensor::new(dims.to_vec(), data).unwrap()
}

/// A float tensor's values in f32 (exact for the 16-bit types).
fn widen(t: &Tensor) -> Vec<f32> {
    t.data().to_f32_vec().expect("a float tensor")
}

/// A 16-bit tensor's bit patterns.
fn bits(t: &Tensor) -> Vec<u16> {
    match t.data() {
        TensorData::F16(v) => v.iter().map(|x| x.to_bits()).collect(),
        TensorData::BF16(v) => v.iter().map(|x| x.to_bits()).collect(),
        other => panic!("not a 16-bit tensor: {:?}", other.dtype()),
    }
}

fn is_nan(dtype: DType, b: u16) -> bool {
    match dtype {
        DType::F16 => b & 0x7c00 == 0x7c00 && b & 0x03ff != 0,
        _ => b & 0x7f80 == 0x7f80 && b & 0x007f != 0,
    }
}

fn value(dtype: DType, b: u16) -> f32 {
    match dtype {
        DType::F16 => f16::from_bits(b).to_f32(),
        _ => bf16::from_bits(b).to_f32(),
    }
}

/// Steps between two values of one 16-bit type along the number line
/// (+0 and -0 are one value).
fn ulps(a: u16, b: u16) -> u32 {
    let key = |x: u16| {
        if x & 0x8000 != 0 {
            -i32::from(x & 0x7fff)
        } else {
            i32::from(x)
        }
    };
    (key(a) - key(b)).unsigned_abs()
}

/// `got` within `max` steps of `want` everywhere (both NaN passes); returns
/// the largest distance seen.
fn within_ulps(
    what: &str,
    dtype: DType,
    want: &Tensor,
    got: &Tensor,
    max: u32,
) -> Result<u32, String> {
    if want.ty() != got.ty() {
        return Err(format!("{what}: type {} vs {}", want.ty(), got.ty()));
    }
    let mut worst = 0;
    for (k, (&w, &g)) in bits(want).iter().zip(&bits(got)).enumerate() {
        if is_nan(dtype, w) && is_nan(dtype, g) {
            continue;
        }
        let d = if is_nan(dtype, w) || is_nan(dtype, g) {
            u32::MAX
        } else {
            ulps(w, g)
        };
        if d > max {
            return Err(format!(
                "{what}[{k}]: want {w:#06x} ({}) got {g:#06x} ({}), {} ulps > {max}",
                value(dtype, w),
                value(dtype, g),
                if d == u32::MAX {
                    "NaN vs number".to_string()
                } else {
                    d.to_string()
                }
            ));
        }
        worst = worst.max(d);
    }
    Ok(worst)
}

/// `got` within `tol` of `want` (values compared in f32).
fn within_tol(what: &str, want: &Tensor, got: &Tensor, tol: Tol) -> Result<f32, String> {
    if want.ty() != got.ty() {
        return Err(format!("{what}: type {} vs {}", want.ty(), got.ty()));
    }
    let mut worst = 0f32;
    for (k, (x, y)) in widen(want).into_iter().zip(widen(got)).enumerate() {
        let bound = tol.atol + tol.rtol * x.abs();
        if !((x - y).abs() <= bound || (x.is_nan() && y.is_nan())) {
            return Err(format!(
                "{what}[{k}]: want {x} got {y} (|d| {} > {bound})",
                (x - y).abs()
            ));
        }
        worst = worst.max((x - y).abs() / bound);
    }
    Ok(worst)
}

fn cuda_opts() -> CudaOptions {
    Case::new("").opts
}

/// Builds `build`'s graph with its inputs of `dtype` and runs it on CUDA.
/// `inputs` are the f32 values of each input (rounded to `dtype` for the
/// feed; an i64 input stays i64).
fn run_cuda(dtype: DType, inputs: &[Tensor], build: &Build) -> Result<Tensor, String> {
    let (g, feeds) = graph_of(dtype, inputs, build)?;
    let vg = validate(g, &large_limits()).map_err(|e| format!("validate ({dtype:?}): {e}"))?;
    let mut p = CudaProgram::with_options(vg, VarValues::new(), cuda_opts())
        .map_err(|e| format!("cuda ({dtype:?}): {e}"))?;
    let mut out = p
        .run(&feeds, &["y".to_string()])
        .map_err(|e| format!("cuda run ({dtype:?}): {e}"))?;
    Ok(out.remove(0))
}

/// Runs `build`'s graph on the CPU backend with its inputs of `dtype`.
fn run_cpu(dtype: DType, inputs: &[Tensor], build: &Build) -> Result<Tensor, String> {
    let (g, feeds) = graph_of(dtype, inputs, build)?;
    let vg = validate(g, &large_limits()).map_err(|e| format!("validate ({dtype:?}): {e}"))?;
    let mut p =
        CpuProgram::new(vg, VarValues::new()).map_err(|e| format!("cpu ({dtype:?}): {e}"))?;
    let mut out = p
        .run(&feeds, &["y".to_string()])
        .map_err(|e| format!("cpu run ({dtype:?}): {e}"))?;
    Ok(out.remove(0))
}

fn graph_of(
    dtype: DType,
    inputs: &[Tensor],
    build: &Build,
) -> Result<(Graph, BTreeMap<String, Tensor>), String> {
    let mut g = GraphBuilder::new();
    let mut feeds = BTreeMap::new();
    let mut ins = Vec::new();
    for (k, t) in inputs.iter().enumerate() {
        let name = format!("in{k}");
        let t = match t.data() {
            TensorData::I64(_) => t.clone(),
            _ => narrow(dtype, t.ty().shape.dims(), &widen(t)),
        };
        ins.push(g.placeholder(&name, t.ty()));
        feeds.insert(name, t);
    }
    let y = build(&mut g, &ins);
    g.set_name(y, "y");
    let (graph, _) = g.finish().map_err(|e| format!("build ({dtype:?}): {e}"))?;
    Ok((graph, feeds))
}

/// The reference of a half graph: the CPU's f32 graph over the half
/// inputs widened, its result rounded to `dtype`.
fn reference(dtype: DType, inputs: &[Tensor], build: &Build) -> Result<Tensor, String> {
    let widened: Vec<Tensor> = inputs
        .iter()
        .map(|t| match t.data() {
            TensorData::I64(_) => t.clone(),
            _ => narrow(dtype, t.ty().shape.dims(), &widen(t)),
        })
        .map(|t| match t.data() {
            TensorData::I64(_) => t,
            _ => Tensor::from_f32(t.ty().shape.dims().to_vec(), widen(&t)).unwrap(),
        })
        .collect();
    let y = run_cpu(DType::F32, &widened, build)?;
    Ok(narrow(dtype, y.ty().shape.dims(), &widen(&y)))
}

/// How a case's result is judged.
#[derive(Clone, Copy)]
enum Check {
    Ulps(u32),
    Tol(f32),
}

struct HalfCase {
    name: String,
    inputs: Vec<Tensor>,
    build: Box<Build>,
    check: Check,
}

fn case(
    name: &str,
    inputs: Vec<Tensor>,
    check: Check,
    build: impl Fn(&mut GraphBuilder, &[Outlet]) -> Outlet + 'static,
) -> HalfCase {
    HalfCase {
        name: name.into(),
        inputs,
        build: Box::new(build),
        check,
    }
}

fn op_case(name: &str, op: Op, inputs: Vec<Tensor>, check: Check) -> HalfCase {
    case(name, inputs, check, move |g, ins| g.op1(op.clone(), ins))
}

/// Runs every case in fp16 and bf16; prints one line each, fails at the end
/// with the names of the failed ones.
fn run_half(cases: Vec<HalfCase>) {
    let mut failed = Vec::new();
    for c in &cases {
        for dtype in HALVES {
            let label = format!("{} {dtype:?}", c.name);
            let r = reference(dtype, &c.inputs, &*c.build).and_then(|want| {
                let got = run_cuda(dtype, &c.inputs, &*c.build)?;
                match c.check {
                    Check::Ulps(n) => within_ulps(&label, dtype, &want, &got, n)
                        .map(|w| format!("worst {w} ulps (max {n})")),
                    Check::Tol(k) => {
                        let u = unit(dtype);
                        let tol = Tol {
                            rtol: 2.0 * u,
                            atol: 2.0 * u * k.sqrt(),
                        };
                        within_tol(&label, &want, &got, tol)
                            .map(|w| format!("worst {w:.3} of tolerance (K {k})"))
                    }
                }
            });
            match r {
                Ok(s) => println!("ok   {label:<32} {s}"),
                Err(e) => {
                    println!("FAIL {label:<32} {e}");
                    failed.push(label);
                }
            }
        }
    }
    assert!(failed.is_empty(), "failed: {failed:?}");
}

/// Values every conversion must get right: zeros, the extremes of both
/// 16-bit types, their subnormals, ties at both widths, overflow, infinity,
/// NaN; then seeded random values over many binades.
fn cast_values() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        65504.0,
        65519.0,
        65520.0,
        -65520.0,
        6.0e-8,
        5.9604645e-8,
        2.9802322e-8,
        2.9802326e-8,
        6.1035156e-5,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        3.3895314e38,
        f32::MAX,
        f32::MIN_POSITIVE,
        1.0e-40,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    let mut rng = StdRng::seed_from_u64(30);
    for _ in 0..1000 {
        let m: f32 = rng.gen_range(-1.0..1.0);
        let e: i32 = rng.gen_range(-30..20);
        v.push(m * 2f32.powi(e));
    }
    v
}

/// Cast between every pair of float dtypes and from i64: the CUDA result
/// equals the CPU backend's bit for bit, and a cast from f32 equals
/// `half`'s `from_f32` (round to nearest even).
#[test]
#[ignore = "needs a GPU"]
fn half_casts_bit_exact() {
    let vals = cast_values();
    let n = vals.len();
    let f32s = Tensor::from_f32(vec![n], vals.clone()).unwrap();
    let ints = Tensor::from_i64(
        vec![8],
        vec![0, 1, -3, 2049, 16_777_217, -16_777_219, 1 << 40, i64::MAX],
    )
    .unwrap();
    let mut failed = Vec::new();
    let floats = [DType::F32, DType::F16, DType::BF16];
    for from in [DType::F32, DType::F16, DType::BF16, DType::I64] {
        for to in floats {
            if from == to {
                continue;
            }
            let label = format!("cast {from:?} -> {to:?}");
            let input = match from {
                DType::I64 => ints.clone(),
                DType::F32 => f32s.clone(),
                _ => narrow(from, &[n], &vals),
            };
            let build = move |g: &mut GraphBuilder, ins: &[Outlet]| g.op1(Op::Cast { to }, ins);
            let feed_dtype = if from == DType::I64 { DType::F32 } else { from };
            let feeds = vec![input.clone()];
            let r = (|| -> Result<String, String> {
                let got = run_cuda(feed_dtype, &feeds, &build)?;
                let want = run_cpu(feed_dtype, &feeds, &build)?;
                if to == DType::F32 {
                    let (w, g) = (widen(&want), widen(&got));
                    for (k, (x, y)) in w.iter().zip(&g).enumerate() {
                        if x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()) {
                            return Err(format!("[{k}]: cpu {x:e} cuda {y:e}"));
                        }
                    }
                    return Ok(format!("{} values equal", w.len()));
                }
                within_ulps(&label, to, &want, &got, 0)?;
                if from == DType::F32 {
                    let direct = narrow(to, &[n], &vals);
                    within_ulps(&format!("{label} vs half::from_f32"), to, &direct, &got, 0)?;
                }
                Ok(format!("{} values bit-exact", bits(&got).len()))
            })();
            match r {
                Ok(s) => println!("ok   {label:<24} {s}"),
                Err(e) => {
                    println!("FAIL {label:<24} {e}");
                    failed.push(label);
                }
            }
        }
    }
    assert!(failed.is_empty(), "failed: {failed:?}");
}

/// Elementwise maps, activation gradients and copies in fp16 and bf16
/// (each through the typed kernels' scalar path; odd sizes, so no vector
/// path is taken).
#[test]
#[ignore = "needs a GPU"]
fn half_elementwise_and_copies() {
    run_half(elementwise_cases());
}

fn elementwise_cases() -> Vec<HalfCase> {
    let mut rng = StdRng::seed_from_u64(31);
    let mut r = |dims: &[usize], lo: f32, hi: f32| rnd(&mut rng, dims, lo, hi);
    let d = [3, 5, 7];
    let mut cases = Vec::new();
    for (name, op, lo, hi) in [
        ("relu", Op::Relu, -2.0, 2.0),
        ("gelu", Op::Gelu, -4.0, 4.0),
        ("sigmoid", Op::Sigmoid, -6.0, 6.0),
        ("tanh", Op::Tanh, -3.0, 3.0),
        ("exp", Op::Exp, -5.0, 5.0),
        ("log", Op::Log, 0.01, 10.0),
        ("sqrt", Op::Sqrt, 0.0, 100.0),
        ("scale", Op::Scale(0.3), -10.0, 10.0),
        ("erf", Op::Erf, -3.0, 3.0),
        ("hard_sigmoid", Op::HardSigmoid, -5.0, 5.0),
        ("hard_swish", Op::HardSwish, -5.0, 5.0),
        (
            "clip",
            Op::Clip {
                min: -0.5,
                max: 0.25,
            },
            -1.0,
            1.0,
        ),
    ] {
        cases.push(op_case(name, op, vec![r(&d, lo, hi)], Check::Ulps(1)));
    }
    for (name, op) in [
        ("add", Op::Add),
        ("sub", Op::Sub),
        ("mul", Op::Mul),
        ("div", Op::Div),
    ] {
        cases.push(op_case(
            &format!("{name} same"),
            op.clone(),
            vec![r(&d, -1.0, 1.0), r(&d, 0.5, 2.0)],
            Check::Ulps(1),
        ));
        cases.push(op_case(
            &format!("{name} row"),
            op.clone(),
            vec![r(&d, -1.0, 1.0), r(&[7], 0.5, 2.0)],
            Check::Ulps(1),
        ));
        cases.push(op_case(
            &format!("{name} row first"),
            op.clone(),
            vec![r(&[7], 0.5, 2.0), r(&d, 0.5, 2.0)],
            Check::Ulps(1),
        ));
        cases.push(op_case(
            &format!("{name} bcast"),
            op.clone(),
            vec![r(&[3, 1, 7], -1.0, 1.0), r(&[5, 1], 0.5, 2.0)],
            Check::Ulps(1),
        ));
        cases.push(op_case(
            &format!("{name} bcast rows"),
            op,
            vec![r(&[3, 1, 40], -1.0, 1.0), r(&[5, 1], 0.5, 2.0)],
            Check::Ulps(1),
        ));
    }
    for (name, op) in [
        ("relu_grad", Op::ReluGrad),
        ("gelu_grad", Op::GeluGrad),
        ("sigmoid_grad", Op::SigmoidGrad),
        ("tanh_grad", Op::TanhGrad),
        ("hard_sigmoid_grad", Op::HardSigmoidGrad),
        ("hard_swish_grad", Op::HardSwishGrad),
    ] {
        cases.push(op_case(
            name,
            op,
            vec![r(&d, -4.0, 4.0), r(&d, -1.0, 1.0)],
            Check::Ulps(1),
        ));
    }
    let x = r(&[4, 6, 10], -1.0, 1.0);
    cases.push(op_case(
        "transpose",
        Op::Transpose {
            perm: vec![2, 0, 1],
        },
        vec![x.clone()],
        Check::Ulps(0),
    ));
    cases.push(op_case(
        "slice",
        Op::Slice {
            axis: 2,
            start: 3,
            end: 9,
        },
        vec![x.clone()],
        Check::Ulps(0),
    ));
    cases.push(op_case(
        "slice_grad",
        Op::SliceGrad {
            axis: 1,
            start: 2,
            input_dim: 9,
        },
        vec![x.clone()],
        Check::Ulps(0),
    ));
    cases.push(op_case(
        "concat odd",
        Op::Concat { axis: 1 },
        vec![x.clone(), r(&[4, 3, 10], -1.0, 1.0)],
        Check::Ulps(0),
    ));
    cases.push(op_case(
        "concat wide rows",
        Op::Concat { axis: 0 },
        vec![r(&[2, 16], -1.0, 1.0), r(&[3, 16], -1.0, 1.0)],
        Check::Ulps(0),
    ));
    cases.push(op_case(
        "reshape",
        Op::Reshape {
            shape: vec![24, 10],
        },
        vec![x.clone()],
        Check::Ulps(0),
    ));
    cases.push(op_case(
        "broadcast_to",
        Op::BroadcastTo {
            shape: vec![3, 4, 6, 10],
        },
        vec![x],
        Check::Ulps(0),
    ));
    cases
}

/// Matrix products in fp16 and bf16 through cuBLAS (f32 accumulation),
/// every layout `ops/gemm.rs` takes, against the f32 product rounded.
/// Sums, means and maxima in fp16 and bf16 (f32 accumulation, rounded at
/// the store), one case per reduction kernel: leading axes into columns
/// (`reduce_cols`, SumTo as a bias gradient), a long row per block
/// (`reduce_block`), a warp per output (`reduce_warp`).
#[test]
#[ignore = "needs a GPU"]
fn half_reductions() {
    run_half(reduction_cases());
}

fn reduction_cases() -> Vec<HalfCase> {
    let mut rng = StdRng::seed_from_u64(36);
    let mut r = |dims: &[usize]| rnd(&mut rng, dims, -1.0, 1.0);
    let red = |axes: Vec<usize>, kind: usize| match kind {
        0 => Op::ReduceSum {
            axes,
            keep_dims: false,
        },
        1 => Op::ReduceMean {
            axes,
            keep_dims: false,
        },
        _ => Op::ReduceMax {
            axes,
            keep_dims: false,
        },
    };
    let mut cases = vec![op_case(
        "sum_to bias grad",
        Op::SumTo { shape: vec![40] },
        vec![r(&[8, 6, 40])],
        Check::Tol(48.0),
    )];
    for (kind, name) in [(0, "sum"), (1, "mean"), (2, "max")] {
        // A maximum is one of the values; a mean is about 1/sqrt(K) of a
        // sum, so its absolute tolerance is that of one value.
        let check = |k: f32| match kind {
            0 => Check::Tol(k),
            1 => Check::Tol(1.0),
            _ => Check::Ulps(0),
        };
        cases.push(op_case(
            &format!("{name} cols"),
            red(vec![0], kind),
            vec![r(&[50, 70])],
            check(50.0),
        ));
        cases.push(op_case(
            &format!("{name} block"),
            red(vec![1], kind),
            vec![r(&[3, 5000])],
            check(5000.0),
        ));
        cases.push(op_case(
            &format!("{name} warp"),
            red(vec![0, 2], kind),
            vec![r(&[4, 9, 11])],
            check(44.0),
        ));
    }
    cases
}

#[test]
#[ignore = "needs a GPU"]
fn half_matmul() {
    run_half(matmul_cases());
}

fn matmul_cases() -> Vec<HalfCase> {
    let mut rng = StdRng::seed_from_u64(32);
    type Shapes<'a> = &'a [(&'a str, &'a [usize], &'a [usize], bool, bool)];
    let shapes: Shapes = &[
        ("2d", &[5, 7], &[7, 3], false, false),
        ("2d ta tb", &[7, 5], &[3, 7], true, true),
        ("batched", &[4, 5, 8], &[4, 8, 3], false, false),
        ("shared b", &[4, 5, 8], &[8, 6], false, false),
        ("shared a", &[5, 8], &[4, 8, 3], false, false),
        ("bcast batch", &[2, 1, 5, 7], &[1, 3, 7, 4], false, false),
        ("large", &[64, 300], &[300, 129], false, false),
    ];
    let mut cases = Vec::new();
    for &(name, a, b, ta, tb) in shapes {
        let k = if ta { a[a.len() - 2] } else { a[a.len() - 1] };
        cases.push(op_case(
            &format!("matmul {name}"),
            Op::MatMul {
                transpose_a: ta,
                transpose_b: tb,
            },
            vec![rnd(&mut rng, a, -1.0, 1.0), rnd(&mut rng, b, -1.0, 1.0)],
            Check::Tol(k as f32),
        ));
    }
    cases
}

/// Convolutions in fp16 and bf16 through cuDNN (FLOAT compute), forward
/// (with a bias: the typed `channel_bias` kernel), backward data and
/// backward filter, against the f32 convolution rounded.
#[test]
#[ignore = "needs a GPU"]
fn half_conv2d() {
    run_half(conv_cases());
}

fn conv_cases() -> Vec<HalfCase> {
    let mut rng = StdRng::seed_from_u64(33);
    let a = conv_attrs(2, 1, 1, 1);
    let x = rnd(&mut rng, &[2, 4, 9, 9], -1.0, 1.0);
    let w = rnd(&mut rng, &[6, 4, 3, 3], -1.0, 1.0);
    let b = rnd(&mut rng, &[6], -1.0, 1.0);
    let dy = rnd(&mut rng, &[2, 6, 5, 5], -1.0, 1.0);
    let grouped = conv_attrs(1, 1, 1, 2);
    let wg = rnd(&mut rng, &[6, 2, 3, 3], -1.0, 1.0);
    vec![
        op_case(
            "conv2d",
            Op::Conv2d(a),
            vec![x.clone(), w.clone()],
            Check::Tol(36.0),
        ),
        op_case(
            "conv2d bias",
            Op::Conv2d(a),
            vec![x.clone(), w.clone(), b],
            Check::Tol(37.0),
        ),
        op_case(
            "conv2d groups",
            Op::Conv2d(grouped),
            vec![x.clone(), wg],
            Check::Tol(18.0),
        ),
        op_case(
            "conv2d_grad_input",
            Op::Conv2dGradInput {
                attrs: a,
                input_shape: [2, 4, 9, 9],
            },
            vec![dy.clone(), w],
            Check::Tol(54.0),
        ),
        op_case(
            "conv2d_grad_filter",
            Op::Conv2dGradFilter {
                attrs: a,
                filter_shape: [6, 4, 3, 3],
            },
            vec![x, dy],
            Check::Tol(50.0),
        ),
    ]
}

/// A small MLP in bf16 (and fp16) as autocast makes it: f32 input cast
/// down, Linear (MatMul + bias Add) → Relu → Linear, the logits cast back
/// to f32 for a softmax. The reference is the same graph in f32 with a
/// round trip through the dtype (Cast down and up) after every half op,
/// on the CPU: per op the rounding the GPU does.
#[test]
#[ignore = "needs a GPU"]
fn half_mlp_forward() {
    let mut rng = StdRng::seed_from_u64(34);
    let x = rnd(&mut rng, &[8, 32], -1.0, 1.0);
    let w1 = rnd(&mut rng, &[32, 64], -0.3, 0.3);
    let b1 = rnd(&mut rng, &[64], -0.1, 0.1);
    let w2 = rnd(&mut rng, &[64, 10], -0.3, 0.3);
    let b2 = rnd(&mut rng, &[10], -0.1, 0.1);
    let mut failed = Vec::new();
    for dtype in HALVES {
        // emulate: f32 tensors rounded through `dtype` after each op.
        let build = |emulate: bool| {
            let mut g = GraphBuilder::new();
            let compute = if emulate { DType::F32 } else { dtype };
            let round = |g: &mut GraphBuilder, o: Outlet| {
                if emulate {
                    let h = g.op1(Op::Cast { to: dtype }, &[o]);
                    g.op1(Op::Cast { to: DType::F32 }, &[h])
                } else {
                    o
                }
            };
            let param = |g: &mut GraphBuilder, name: &str, t: &Tensor| {
                let h = narrow(dtype, t.ty().shape.dims(), &widen(t));
                let v = if emulate {
                    Tensor::from_f32(t.ty().shape.dims().to_vec(), widen(&h)).unwrap()
                } else {
                    h
                };
                g.variable(name, v)
            };
            let xi = g.placeholder("x", TensorType::f32(x.ty().shape.dims().to_vec()));
            let xh = g.op1(Op::Cast { to: compute }, &[xi]);
            let xh = round(&mut g, xh);
            let (w1v, b1v) = (param(&mut g, "w1", &w1), param(&mut g, "b1", &b1));
            let (w2v, b2v) = (param(&mut g, "w2", &w2), param(&mut g, "b2", &b2));
            let h = g.matmul(xh, w1v);
            let h = round(&mut g, h);
            let h = g.op1(Op::Add, &[h, b1v]);
            let h = round(&mut g, h);
            let h = g.op1(Op::Relu, &[h]);
            let h = g.matmul(h, w2v);
            let h = round(&mut g, h);
            let h = g.op1(Op::Add, &[h, b2v]);
            let h = round(&mut g, h);
            let logits = g.op1(Op::Cast { to: DType::F32 }, &[h]);
            let p = g.op1(Op::Softmax { axis: 1 }, &[logits]);
            g.set_name(logits, "logits");
            g.set_name(p, "p");
            g.finish().unwrap()
        };
        let label = format!("mlp {dtype:?}");
        let feeds: BTreeMap<String, Tensor> = [("x".to_string(), x.clone())].into();
        let fetches = ["logits".to_string(), "p".to_string()];
        let r = (|| -> Result<String, String> {
            let (gh, vh) = build(false);
            let vg = validate(gh, &large_limits()).map_err(|e| format!("validate: {e}"))?;
            let mut gpu =
                CudaProgram::with_options(vg, vh, cuda_opts()).map_err(|e| format!("cuda: {e}"))?;
            let got = gpu
                .run(&feeds, &fetches)
                .map_err(|e| format!("cuda run: {e}"))?;
            let (gr, vr) = build(true);
            let vg = validate(gr, &large_limits()).map_err(|e| format!("validate ref: {e}"))?;
            let mut cpu = CpuProgram::new(vg, vr).map_err(|e| format!("cpu: {e}"))?;
            let want = cpu
                .run(&feeds, &fetches)
                .map_err(|e| format!("cpu run: {e}"))?;
            // Two products of K 32 and 64, each within the product
            // tolerance, the first one's error carried through the second.
            let u = unit(dtype);
            let tol = Tol {
                rtol: 8.0 * u,
                atol: 8.0 * u,
            };
            let mut s = String::new();
            for (k, name) in fetches.iter().enumerate() {
                let w = compare(&format!("{label} {name}"), &want[k], &got[k], tol)?;
                s += &format!("{name} worst {w:.3} ");
            }
            Ok(s + "of tolerance")
        })();
        match r {
            Ok(s) => println!("ok   {label:<24} {s}"),
            Err(e) => {
                println!("FAIL {label:<24} {e}");
                failed.push(label);
            }
        }
    }
    assert!(failed.is_empty(), "failed: {failed:?}");
}

/// The harness without a GPU: step distances across zero and signs, a
/// failure message that names the index, both values and their bits, and
/// the CPU's Cast (the reference of `half_casts_bit_exact`) equal to
/// `half`'s conversion.
#[test]
fn half_harness_on_the_cpu() {
    assert_eq!(ulps(0x3c00, 0x3c01), 1);
    assert_eq!(ulps(0x8000, 0x0000), 0);
    assert_eq!(ulps(0x8001, 0x0001), 2);
    let a = narrow(DType::F16, &[3], &[1.0, 2.0, 3.0]);
    let b = narrow(DType::F16, &[3], &[1.0, 2.0, 3.0 + 3.0 / 512.0]);
    assert_eq!(
        within_ulps("t", DType::F16, &a, &b, 1),
        Err("t[2]: want 0x4200 (3) got 0x4203 (3.0058594), 3 ulps > 1".to_string())
    );
    assert_eq!(within_ulps("t", DType::F16, &a, &a, 0), Ok(0));
    let vals = cast_values();
    let n = vals.len();
    let input = vec![Tensor::from_f32(vec![n], vals.clone()).unwrap()];
    for to in HALVES {
        let got = run_cpu(DType::F32, &input, &move |g, ins| {
            g.op1(Op::Cast { to }, ins)
        })
        .unwrap();
        let want = narrow(to, &[n], &vals);
        assert_eq!(within_ulps("cpu cast", to, &want, &got, 0), Ok(0), "{to:?}");
    }
}

/// A training step of a graph cast by hand as autocast does: f32 master
/// weights and inputs cast to the dtype for the two matrix products, their
/// results cast back to f32 for the bias, Relu and cross-entropy; SGD with
/// momentum on the f32 variables. Autodiff gives half MatMuls and Casts in
/// the backward pass. CUDA against the CPU backend running the same graph:
/// the loss, the weights and the momentum buffers (the gradients) within
/// 8u (one or two ulps of a rounded product moved by a different order of
/// summation, carried through a second product).
#[test]
#[ignore = "needs a GPU"]
fn half_cast_training_step() {
    use lanes_adaptor::{training_graph, Optimizer};
    let mut cases = Vec::new();
    for dtype in HALVES {
        let mut rng = StdRng::seed_from_u64(35);
        let mut c = Case::new(&format!("cast'ed mlp step {dtype:?}"));
        let x = c.input("x", rnd(&mut rng, &[8, 16], -1.0, 1.0));
        let labels = c.input("labels", ints(&mut rng, &[8], 10));
        let w1 = c.var("w1", rnd(&mut rng, &[16, 32], -0.3, 0.3));
        let b1 = c.var("b1", rnd(&mut rng, &[32], -0.1, 0.1));
        let w2 = c.var("w2", rnd(&mut rng, &[32, 10], -0.3, 0.3));
        let b2 = c.var("b2", rnd(&mut rng, &[10], -0.1, 0.1));
        let mut g = std::mem::take(&mut c.g);
        let down = |g: &mut GraphBuilder, o: Outlet| g.op1(Op::Cast { to: dtype }, &[o]);
        let up = |g: &mut GraphBuilder, o: Outlet| g.op1(Op::Cast { to: DType::F32 }, &[o]);
        let (xh, w1h) = (down(&mut g, x), down(&mut g, w1));
        let h = g.matmul(xh, w1h);
        let h = up(&mut g, h);
        let h = g.op1(Op::Add, &[h, b1]);
        let h = g.op1(Op::Relu, &[h]);
        let (hh, w2h) = (down(&mut g, h), down(&mut g, w2));
        let logits = g.matmul(hh, w2h);
        let logits = up(&mut g, logits);
        let logits = g.op1(Op::Add, &[logits, b2]);
        let loss = g.op1(Op::CrossEntropy, &[logits, labels]);
        let t = match training_graph(g, loss, &Optimizer::sgd_momentum(0.05, 0.9, 0.0)) {
            Ok(t) => t,
            Err(e) => panic!("{dtype:?}: the training graph does not build: {e}"),
        };
        c.fetches.push(t.loss.clone());
        c.prebuilt = Some((t.graph, t.vars));
        let u = unit(dtype);
        c.tol = Tol {
            rtol: 8.0 * u,
            atol: 8.0 * u,
        };
        c.runs = 2;
        cases.push(c);
    }
    run_all(cases);
}

/// Every op case's half graph validates (shape inference takes it in fp16
/// and bf16) and the CUDA backend's dtype check lets it through, and its
/// reference runs on the CPU and equals, bit for bit, the CPU backend's
/// own half op: what the GPU tests need besides the GPU.
#[test]
fn half_cases_build_and_have_references() {
    let mut cases = elementwise_cases();
    cases.extend(reduction_cases());
    cases.extend(matmul_cases());
    cases.extend(conv_cases());
    let mut failed = Vec::new();
    for c in &cases {
        for dtype in HALVES {
            let r = graph_of(dtype, &c.inputs, &*c.build)
                .and_then(|(g, _)| {
                    validate(g, &large_limits()).map_err(|e| format!("validate: {e}"))
                })
                .and_then(|vg| match CudaProgram::new(vg, VarValues::new()) {
                    Err(e @ lanes::exec::ExecError::UnsupportedDType { .. }) => {
                        Err(format!("cuda refuses it: {e}"))
                    }
                    _ => Ok(()),
                })
                .and_then(|()| reference(dtype, &c.inputs, &*c.build))
                .and_then(|want| {
                    let got = run_cpu(dtype, &c.inputs, &*c.build)?;
                    within_ulps("the CPU backend's half op", dtype, &want, &got, 0)
                });
            if let Err(e) = r {
                failed.push(format!("{} {dtype:?}: {e}", c.name));
            }
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}
