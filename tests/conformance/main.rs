//! Conformance: the CUDA backend against the CPU reference, op by op
//! (forward, backward, in-place updates) and on whole models, on seeded
//! random inputs.
//!
//! fp16 and bf16 cases are in `half.rs`, with their own reference and
//! tolerances; loss scaling (fp16-mixed training) in `amp.rs`.
//!
//! Every test here needs a GPU and is `#[ignore]`d (CI has none). On the GPU
//! machine: `test-conformance --ignored --test-threads=1 --nocapture`.
//!
//! Tolerance: |cuda - cpu| <= atol + rtol * |cpu| elementwise. FP32 ops use
//! rtol 1e-4 / atol 1e-5 (1e-3 where long accumulations reorder sums:
//! matmul, conv, reductions over thousands of values). Convolutions are
//! checked with TF32 off (`CudaOptions::conv_tf32 = false`); the model
//! tests run at the default precision (TF32 convolutions) with 2e-2.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;

use lanes::exec::cpu::CpuProgram;
use lanes::exec::cuda::{CudaOptions, CudaProgram};
use lanes::exec::{Backend, GpuShare, Program};
use lanes_adaptor::{
    validate, Conv2dAttrs, Graph, GraphBuilder, GraphLimits, Op, Outlet, Pool2dAttrs, Tensor,
    VarValues,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[allow(dead_code)]
#[path = "../../src/cli/bench/models.rs"]
mod models;

/// fp16 and bf16 on CUDA (`half.rs`).
mod half;

/// Training in segments through the device gate (`gate.rs`).
mod gate;

/// Loss scaling's ops and fp16-mixed training steps (`amp.rs`).
mod amp;

/// Reshapes planned as views: no copy, no launch (`views.rs`).
mod views;

/// Softmax chains as one kernel.
mod softmax;

/// What a program costs beyond its arena.
mod overhead;

/// Half epilogue chains (casts around a batch norm) as one kernel.
mod epilogue_half;

/// Partial eviction: the first units kept on the device.
mod keep;

/// The suite's CUDA options: TF32 off for convolutions and matrix
/// products, CUDA graphs and cuDNN's batch norm on, fusion as `fuse` says
/// (a fused run is compared with the unfused one built from these).
fn exact(fuse: bool) -> CudaOptions {
    CudaOptions {
        conv_tf32: false,
        matmul_tf32: false,
        cuda_graph: true,
        urgency: 0,
        fuse,
        cudnn_batch_norm: true,
    }
}

#[derive(Debug, Clone, Copy)]
struct Tol {
    rtol: f32,
    atol: f32,
}

const FP32: Tol = Tol {
    rtol: 1e-4,
    atol: 1e-5,
};
const ACCUM: Tol = Tol {
    rtol: 1e-3,
    atol: 1e-4,
};
/// Gradients of a deep ReLU network (a training step's momentum buffers):
/// ReLU's derivative jumps, so results 1e-7 apart before a kink can flip
/// which side activations fall on. On the CPU alone, parameters changed by
/// 1e-6 (relative) moved the first convolution's gradient of the small
/// ResNet below by up to 0.33 of this tolerance in one step (and by more
/// than it after a second step, the parameters having moved apart).
const TRAIN_VARS: Tol = Tol {
    rtol: 1e-2,
    atol: 2e-3,
};
const TF32: Tol = Tol {
    rtol: 2e-2,
    atol: 2e-2,
};

fn rnd(rng: &mut StdRng, dims: &[usize], lo: f32, hi: f32) -> Tensor {
    let n: usize = dims.iter().product();
    Tensor::from_f32(
        dims.to_vec(),
        (0..n).map(|_| rng.gen_range(lo..hi)).collect(),
    )
    .unwrap()
}

fn ints(rng: &mut StdRng, dims: &[usize], hi: i64) -> Tensor {
    let n: usize = dims.iter().product();
    Tensor::from_i64(
        dims.to_vec(),
        (0..n).map(|_| rng.gen_range(0..hi)).collect(),
    )
    .unwrap()
}

/// A case: a graph, its feeds, what to fetch, how often to run.
struct Case {
    name: String,
    g: GraphBuilder,
    feeds: BTreeMap<String, Tensor>,
    fetches: Vec<String>,
    tol: Tol,
    runs: usize,
    opts: CudaOptions,
    /// A graph built elsewhere (models); `g` is ignored then.
    prebuilt: Option<(Graph, VarValues)>,
    /// Fused chains the CUDA program must have after the runs.
    chains: Option<usize>,
    /// Tolerance for the optimizer's state variables (named `opt/…`: the
    /// momentum buffers hold whole gradients) where it differs from `tol`.
    opt_state_tol: Option<Tol>,
}

impl Case {
    fn new(name: &str) -> Self {
        Case {
            name: name.into(),
            g: GraphBuilder::new(),
            feeds: BTreeMap::new(),
            fetches: Vec::new(),
            tol: FP32,
            runs: 1,
            opts: exact(true),
            prebuilt: None,
            chains: None,
            opt_state_tol: None,
        }
    }
    fn input(&mut self, name: &str, t: Tensor) -> Outlet {
        let o = self.g.placeholder(name, t.ty());
        self.feeds.insert(name.into(), t);
        o
    }
    fn var(&mut self, name: &str, t: Tensor) -> Outlet {
        self.g.variable(name, t)
    }
    fn fetch(&mut self, o: Outlet, name: &str) {
        self.g.set_name(o, name);
        self.fetches.push(name.into());
    }
    fn fetch_all(&mut self, outs: &[Outlet], name: &str) {
        self.g.set_name(outs[0], name);
        for k in 0..outs.len() {
            self.fetches.push(format!("{name}:{k}"));
        }
    }
    fn tol(mut self, t: Tol) -> Self {
        self.tol = t;
        self
    }
}

fn compare(what: &str, cpu: &Tensor, gpu: &Tensor, tol: Tol) -> Result<f32, String> {
    if cpu.ty() != gpu.ty() {
        return Err(format!("{what}: type {} vs {}", cpu.ty(), gpu.ty()));
    }
    let (a, b) = match (cpu.f32s(), gpu.f32s()) {
        (Ok(a), Ok(b)) => (a, b),
        _ => {
            return if cpu == gpu {
                Ok(0.0)
            } else {
                Err(format!("{what}: integer tensors differ"))
            }
        }
    };
    let mut worst = 0f32;
    for (k, (&x, &y)) in a.iter().zip(b).enumerate() {
        let d = (x - y).abs();
        let within = d <= tol.atol + tol.rtol * x.abs();
        let both_nan = x.is_nan() && y.is_nan();
        if !within && !both_nan {
            return Err(format!("{what}[{k}]: cpu {x} vs cuda {y}"));
        }
        worst = worst.max(d / (tol.atol + tol.rtol * x.abs()));
    }
    Ok(worst)
}

/// Graph limits that admit the zoo's models.
fn large_limits() -> GraphLimits {
    GraphLimits {
        max_nodes: 1 << 20,
        ..GraphLimits::default()
    }
}

/// The tolerance for variable `name`: `state` for the optimizer's state
/// (named `opt/…`) where given, else `tol`.
fn var_tol(name: &str, tol: Tol, state: Option<Tol>) -> Tol {
    match state {
        Some(t) if name.starts_with("opt/") => t,
        _ => tol,
    }
}

/// Runs the case on both backends; returns the worst error as a fraction of
/// the tolerance (<= 1 passes).
fn run_case(c: Case) -> Result<f32, String> {
    let (graph, vars) = match c.prebuilt {
        Some(p) => p,
        None => c.g.finish().map_err(|e| format!("build: {e}"))?,
    };
    let limits = large_limits();
    let vg = validate(graph, &limits).map_err(|e| format!("validate: {e}"))?;
    let mut cpu = CpuProgram::new(vg.clone(), vars.clone()).map_err(|e| format!("cpu: {e}"))?;
    let mut gpu = CudaProgram::with_options(vg, vars, c.opts).map_err(|e| format!("cuda: {e}"))?;
    let mut worst = 0f32;
    for r in 0..c.runs {
        let a = cpu
            .run(&c.feeds, &c.fetches)
            .map_err(|e| format!("cpu run: {e}"))?;
        let b = gpu
            .run(&c.feeds, &c.fetches)
            .map_err(|e| format!("cuda run: {e}"))?;
        for (k, (x, y)) in a.iter().zip(&b).enumerate() {
            worst = worst.max(compare(
                &format!("run {r} fetch {}", c.fetches[k]),
                x,
                y,
                c.tol,
            )?);
        }
        let va = cpu.read_variables(&[]).map_err(|e| e.to_string())?;
        let vb = gpu.read_variables(&[]).map_err(|e| e.to_string())?;
        for (name, x) in &va {
            let y = vb.get(name).ok_or(format!("variable {name} missing"))?;
            let tol = var_tol(name, c.tol, c.opt_state_tol);
            worst = worst.max(compare(&format!("run {r} var {name}"), x, y, tol)?);
        }
    }
    if let Some(want) = c.chains {
        let (got, _) = gpu.fused_chains();
        if got != want {
            return Err(format!("{got} fused chains, expected {want}"));
        }
    }
    Ok(worst)
}

fn run_all(cases: Vec<Case>) {
    let mut failed = Vec::new();
    for c in cases {
        let name = c.name.clone();
        let tol = c.tol;
        match run_case(c) {
            Ok(w) => println!(
                "ok   {name:<28} worst {w:.3} of tolerance (rtol {:e}, atol {:e})",
                tol.rtol, tol.atol
            ),
            Err(e) => {
                println!("FAIL {name:<28} {e}");
                failed.push(name);
            }
        }
    }
    assert!(failed.is_empty(), "failed: {failed:?}");
}

fn unary(name: &str, op: Op, lo: f32, hi: f32) -> Case {
    let mut rng = StdRng::seed_from_u64(1);
    let mut c = Case::new(name);
    let x = c.input("x", rnd(&mut rng, &[3, 5, 7], lo, hi));
    let y = c.g.op1(op, &[x]);
    c.fetch(y, "y");
    c
}

fn binary(name: &str, op: Op, a: &[usize], b: &[usize]) -> Case {
    let mut rng = StdRng::seed_from_u64(2);
    let mut c = Case::new(name);
    let x = c.input("a", rnd(&mut rng, a, -1.0, 1.0));
    let y = c.input("b", rnd(&mut rng, b, 0.5, 2.0));
    let z = c.g.op1(op, &[x, y]);
    c.fetch(z, "z");
    c
}

fn single(name: &str, op: Op, inputs: Vec<Tensor>, tol: Tol) -> Case {
    let mut c = Case::new(name);
    let ins: Vec<Outlet> = inputs
        .into_iter()
        .enumerate()
        .map(|(k, t)| c.input(&format!("in{k}"), t))
        .collect();
    let outs = c.g.op(op, &ins);
    if !outs.is_empty() {
        c.fetch_all(&outs, "out");
    }
    c.tol(tol)
}

#[test]
#[ignore = "needs a GPU"]
fn elementwise_and_shape_ops() {
    let mut rng = StdRng::seed_from_u64(3);
    let mut cases = vec![
        unary("relu", Op::Relu, -1.0, 1.0),
        unary("gelu", Op::Gelu, -3.0, 3.0),
        unary("sigmoid", Op::Sigmoid, -4.0, 4.0),
        unary("tanh", Op::Tanh, -3.0, 3.0),
        unary("exp", Op::Exp, -3.0, 3.0),
        unary("log", Op::Log, 0.1, 5.0),
        unary("sqrt", Op::Sqrt, 0.0, 5.0),
        unary("scale", Op::Scale(-0.37), -2.0, 2.0),
        binary("add same", Op::Add, &[4, 5, 6], &[4, 5, 6]),
        binary("sub bcast", Op::Sub, &[4, 5, 6], &[5, 1]),
        binary("mul bcast both", Op::Mul, &[4, 1, 6], &[1, 5, 1]),
        binary("div bcast rank", Op::Div, &[6], &[3, 4, 6]),
        binary("add scalar", Op::Add, &[3, 4], &[]),
        binary("add bias row", Op::Add, &[4, 5, 6], &[6]),
        binary("mul bias 1xN", Op::Mul, &[4, 5, 6], &[1, 5, 6]),
        // Rows of 32 or more: `binary_rows` (the causal-mask add, a
        // per-channel scale, a scalar on either side, both broadcast).
        binary("add mask rows", Op::Add, &[2, 3, 8, 40], &[2, 1, 8, 40]),
        binary("mul channel rows", Op::Mul, &[2, 3, 5, 8], &[2, 3, 1, 1]),
        binary("sub scalar rows", Op::Sub, &[4, 50], &[1]),
        binary("div scalar first rows", Op::Div, &[1], &[4, 50]),
        binary("add both bcast rows", Op::Add, &[3, 1, 40], &[1, 5, 40]),
    ];
    let x = || rnd(&mut StdRng::seed_from_u64(4), &[3, 5, 4, 2], -3.0, 3.0);
    for axis in [1, 3] {
        cases.push(single(
            &format!("softmax axis {axis}"),
            Op::Softmax { axis },
            vec![x()],
            FP32,
        ));
        cases.push(single(
            &format!("log_softmax axis {axis}"),
            Op::LogSoftmax { axis },
            vec![x()],
            FP32,
        ));
    }
    cases.push(single(
        "reshape",
        Op::Reshape { shape: vec![15, 8] },
        vec![x()],
        FP32,
    ));
    cases.push(single(
        "transpose",
        Op::Transpose {
            perm: vec![2, 0, 3, 1],
        },
        vec![x()],
        FP32,
    ));
    cases.push(single(
        "slice",
        Op::Slice {
            axis: 1,
            start: 1,
            end: 4,
        },
        vec![x()],
        FP32,
    ));
    cases.push(single(
        "concat",
        Op::Concat { axis: 2 },
        vec![
            rnd(&mut rng, &[2, 3, 1, 2], -1.0, 1.0),
            rnd(&mut rng, &[2, 3, 4, 2], -1.0, 1.0),
        ],
        FP32,
    ));
    cases.push(single(
        "concat i64",
        Op::Concat { axis: 0 },
        vec![ints(&mut rng, &[2, 3], 9), ints(&mut rng, &[1, 3], 9)],
        FP32,
    ));
    cases.push(single(
        "broadcast_to",
        Op::BroadcastTo {
            shape: vec![2, 3, 4],
        },
        vec![rnd(&mut rng, &[3, 1], -1.0, 1.0)],
        FP32,
    ));
    cases.push(single(
        "sum_to",
        Op::SumTo { shape: vec![5, 1] },
        vec![rnd(&mut rng, &[3, 5, 4], -1.0, 1.0)],
        FP32,
    ));
    for (keep, axes) in [
        (false, vec![0, 2]),
        (true, vec![1]),
        (false, vec![0, 1, 2, 3]),
    ] {
        cases.push(single(
            &format!("reduce_sum {axes:?}"),
            Op::ReduceSum {
                axes: axes.clone(),
                keep_dims: keep,
            },
            vec![x()],
            FP32,
        ));
        cases.push(single(
            &format!("reduce_mean {axes:?}"),
            Op::ReduceMean {
                axes: axes.clone(),
                keep_dims: keep,
            },
            vec![x()],
            FP32,
        ));
        cases.push(single(
            &format!("reduce_max {axes:?}"),
            Op::ReduceMax {
                axes,
                keep_dims: keep,
            },
            vec![x()],
            FP32,
        ));
    }
    // Leading axes reduced, trailing kept: the column kernel (a bias
    // gradient), with a partial last block of columns.
    cases.push(single(
        "sum_to columns",
        Op::SumTo { shape: vec![100] },
        vec![rnd(&mut rng, &[16, 129, 100], -1.0, 1.0)],
        ACCUM,
    ));
    cases.push(single(
        "reduce_max columns",
        Op::ReduceMax {
            axes: vec![0],
            keep_dims: false,
        },
        vec![rnd(&mut rng, &[3, 45], -1.0, 1.0)],
        FP32,
    ));
    cases.push(single(
        "reduce_mean columns",
        Op::ReduceMean {
            axes: vec![0, 1],
            keep_dims: true,
        },
        vec![rnd(&mut rng, &[7, 50, 3, 33], -1.0, 1.0)],
        ACCUM,
    ));
    cases.push(single(
        "reduce_max columns",
        Op::ReduceMax {
            axes: vec![0],
            keep_dims: false,
        },
        vec![rnd(&mut rng, &[300, 65], -1.0, 1.0)],
        FP32,
    ));
    cases.push(single(
        "reduce_sum long",
        Op::ReduceSum {
            axes: vec![1],
            keep_dims: false,
        },
        vec![rnd(&mut rng, &[3, 20000], -1.0, 1.0)],
        ACCUM,
    ));
    run_all(cases);
}

/// The fast paths of the copy and elementwise kernels: unary and same-shape
/// binary ops four floats at a time, concats, slices and
/// transposes moved 8 or 16 bytes at a time where offsets allow it (and 4
/// where they do not), add/sub/mul/div with the repeating operand first, and
/// `where` over whole or single-value operands (four floats at a time when
/// the size is a multiple of four), inference batch norm by planes.
#[test]
#[ignore = "needs a GPU"]
fn fast_copy_and_elementwise_paths() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut f = |d: &[usize]| rnd(&mut rng, d, -1.0, 1.0);
    let mut cases = Vec::new();
    let concats: Vec<(&str, usize, Vec<Vec<usize>>)> = vec![
        (
            "concat ch aligned",
            1,
            vec![vec![2, 64, 5, 5], vec![2, 32, 5, 5], vec![2, 96, 5, 5]],
        ),
        ("concat ch odd", 1, vec![vec![3, 3, 3, 3], vec![3, 5, 3, 3]]),
        (
            "concat ch even",
            1,
            vec![vec![2, 3, 2, 1], vec![2, 1, 2, 1]],
        ),
        (
            "concat axis 0",
            0,
            vec![vec![1, 3, 4], vec![2, 3, 4], vec![3, 3, 4]],
        ),
        (
            "concat last odd",
            2,
            vec![vec![2, 3, 5], vec![2, 3, 1], vec![2, 3, 7]],
        ),
        ("concat last aligned", 2, vec![vec![2, 3, 4], vec![2, 3, 8]]),
        (
            "concat axis 2 of 4",
            2,
            vec![vec![2, 3, 2, 6], vec![2, 3, 3, 6]],
        ),
    ];
    for (name, axis, shapes) in concats {
        let ins = shapes.iter().map(|d| f(d)).collect();
        cases.push(single(name, Op::Concat { axis }, ins, FP32));
    }
    let mut irng = StdRng::seed_from_u64(12);
    for (name, axis, a, b) in [
        ("concat i64 rows", 1, [3usize, 4], [3usize, 2]),
        ("concat i64 odd", 1, [3, 3], [3, 1]),
    ] {
        let ins = vec![ints(&mut irng, &a, 9), ints(&mut irng, &b, 9)];
        cases.push(single(name, Op::Concat { axis }, ins, FP32));
    }
    for (name, start, end) in [("slice aligned", 2, 5), ("slice odd", 1, 2)] {
        cases.push(single(
            name,
            Op::Slice {
                axis: 1,
                start,
                end,
            },
            vec![f(&[2, 6, 8])],
            FP32,
        ));
    }
    cases.push(single(
        "slice odd width",
        Op::Slice {
            axis: 2,
            start: 1,
            end: 4,
        },
        vec![f(&[2, 3, 5])],
        FP32,
    ));
    for (name, d) in [
        ("transpose heads x4", [2usize, 5, 3, 8]),
        ("transpose heads x2", [2, 5, 3, 6]),
        ("transpose heads x1", [2, 5, 3, 3]),
    ] {
        cases.push(single(
            name,
            Op::Transpose {
                perm: vec![0, 2, 1, 3],
            },
            vec![f(&d)],
            FP32,
        ));
    }
    // Unary and same-shape binary ops four at a time (sizes multiple of 4)
    // and one at a time (odd sizes).
    for (name, op, d) in [
        ("relu x4", Op::Relu, vec![4usize, 5, 6]),
        ("gelu x4", Op::Gelu, vec![2, 8]),
        ("scale x4", Op::Scale(0.3), vec![4]),
        ("relu odd", Op::Relu, vec![3, 5, 7]),
    ] {
        let x = f(&d);
        cases.push(single(name, op, vec![x], FP32));
    }
    cases.extend([
        binary("sub same x4", Op::Sub, &[4, 2, 6], &[4, 2, 6]),
        binary("div same odd", Op::Div, &[3, 5, 7], &[3, 5, 7]),
        binary("add bias first", Op::Add, &[6], &[4, 5, 6]),
        binary("sub bias first", Op::Sub, &[6], &[4, 5, 6]),
        binary("mul 1xN first", Op::Mul, &[1, 5, 6], &[4, 5, 6]),
        binary("div bias first", Op::Div, &[5, 6], &[4, 5, 6]),
        binary("add scalar first", Op::Add, &[], &[3, 7]),
    ]);
    let mut mrng = StdRng::seed_from_u64(13);
    let mut mask = |d: &[usize]| {
        let n: usize = d.iter().product();
        Tensor::from_f32(
            d.to_vec(),
            (0..n).map(|_| f32::from(mrng.gen_bool(0.5))).collect(),
        )
        .unwrap()
    };
    let wheres = [
        (
            "where flat x4",
            [4usize, 5, 6],
            vec![4usize, 5, 6],
            vec![4usize, 5, 6],
        ),
        ("where flat odd", [3, 5, 7], vec![3, 5, 7], vec![3, 5, 7]),
        ("where flat single a", [4, 5, 6], vec![1, 1], vec![4, 5, 6]),
        ("where flat single b", [3, 5, 7], vec![3, 5, 7], vec![]),
    ];
    for (name, c, a, b) in wheres {
        let ins = vec![mask(&c), f(&a), f(&b)];
        cases.push(single(name, Op::Where, ins, FP32));
    }
    let ins = vec![mask(&[1]), f(&[4, 5, 6]), f(&[4, 5, 6])];
    cases.push(single("where flat single cond", Op::Where, ins, FP32));
    // Inference batch norm: per plane four at a time (8x8), per plane one at
    // a time (7x7), and the flat kernel (planes under 32 values, [N, C]).
    let mut brng = StdRng::seed_from_u64(14);
    for (name, d) in [
        ("batch_norm planes x4", vec![3usize, 6, 8, 8]),
        ("batch_norm planes x1", vec![3, 6, 7, 7]),
        ("batch_norm small planes", vec![3, 6, 5]),
        ("batch_norm rows", vec![5, 6]),
    ] {
        let ins = vec![
            rnd(&mut brng, &d, -2.0, 2.0),
            rnd(&mut brng, &[6], 0.5, 1.5),
            rnd(&mut brng, &[6], -0.5, 0.5),
            rnd(&mut brng, &[6], -0.5, 0.5),
            rnd(&mut brng, &[6], 0.5, 2.0),
        ];
        cases.push(single(name, Op::BatchNorm { eps: 1e-5 }, ins, FP32));
    }
    run_all(cases);
}

#[test]
#[ignore = "needs a GPU"]
fn matmul_variants() {
    let mut rng = StdRng::seed_from_u64(5);
    let mut cases = Vec::new();
    type Shapes<'a> = &'a [(&'a str, &'a [usize], &'a [usize], bool, bool)];
    let shapes: Shapes = &[
        ("2d", &[5, 7], &[7, 3], false, false),
        ("2d ta", &[7, 5], &[7, 3], true, false),
        ("2d tb", &[5, 7], &[3, 7], false, true),
        ("2d ta tb", &[7, 5], &[3, 7], true, true),
        ("batched", &[4, 5, 7], &[4, 7, 3], false, false),
        ("batched tb", &[2, 3, 5, 7], &[2, 3, 6, 7], false, true),
        ("shared b", &[4, 5, 7], &[7, 3], false, false),
        ("shared b ta", &[4, 7, 5], &[7, 3], true, false),
        ("shared a", &[5, 7], &[4, 7, 3], false, false),
        ("bcast batch", &[2, 1, 5, 7], &[1, 3, 7, 4], false, false),
        ("large", &[64, 300], &[300, 129], false, false),
    ];
    for &(name, a, b, ta, tb) in shapes {
        cases.push(single(
            &format!("matmul {name}"),
            Op::MatMul {
                transpose_a: ta,
                transpose_b: tb,
            },
            vec![rnd(&mut rng, a, -1.0, 1.0), rnd(&mut rng, b, -1.0, 1.0)],
            ACCUM,
        ));
    }
    run_all(cases);
}

/// `CudaOptions::matmul_tf32` (`lanes serve --tf32-matmul`): the products
/// of a plain and a batched MatMul within TF32's tolerance of the CPU's
/// FP32, and different from the GPU's own FP32 products (so the switch
/// reached cuBLAS: TF32 rounds the inputs to 10 mantissa bits).
#[test]
#[ignore = "needs a GPU"]
fn matmul_tf32_switch() {
    let mut rng = StdRng::seed_from_u64(15);
    for (name, a, b) in [
        ("2d", vec![256, 512], vec![512, 384]),
        ("batched", vec![8, 128, 256], vec![8, 256, 64]),
    ] {
        let mut c = single(
            &format!("matmul tf32 {name}"),
            Op::MatMul {
                transpose_a: false,
                transpose_b: false,
            },
            vec![rnd(&mut rng, &a, -1.0, 1.0), rnd(&mut rng, &b, -1.0, 1.0)],
            TF32,
        );
        let (graph, vars) = c.g.finish().unwrap();
        let vg = validate(graph, &large_limits()).unwrap();
        let mut outs = Vec::new();
        for tf32 in [false, true] {
            c.opts.matmul_tf32 = tf32;
            let mut p = CudaProgram::with_options(vg.clone(), vars.clone(), c.opts).unwrap();
            outs.push(p.run(&c.feeds, &c.fetches).unwrap().remove(0));
        }
        let mut cpu = CpuProgram::new(vg, vars).unwrap();
        let want = cpu.run(&c.feeds, &c.fetches).unwrap().remove(0);
        let plain = compare(name, &want, &outs[0], FP32).unwrap();
        let tf32 = compare(name, &want, &outs[1], TF32).unwrap();
        let apart = outs[0]
            .f32s()
            .unwrap()
            .iter()
            .zip(outs[1].f32s().unwrap())
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        println!(
            "matmul {name}: FP32 worst {plain:.3} of FP32 tol, TF32 worst {tf32:.3} of TF32 tol, \
             TF32 vs FP32 on the GPU up to {apart:e}"
        );
        assert!(plain <= 1.0 && tf32 <= 1.0);
        assert!(
            apart > 1e-4,
            "TF32 products equal FP32's: the switch did not reach cuBLAS"
        );
    }
}

fn conv_attrs(stride: usize, pad: usize, dil: usize, groups: usize) -> Conv2dAttrs {
    Conv2dAttrs {
        stride: [stride, stride],
        padding: [pad, pad],
        dilation: [dil, dil],
        groups,
    }
}

#[test]
#[ignore = "needs a GPU"]
fn nn_ops() {
    let mut rng = StdRng::seed_from_u64(6);
    let mut cases = Vec::new();
    let x = rnd(&mut rng, &[2, 4, 9, 9], -1.0, 1.0);
    for (name, a, bias) in [
        ("conv 3x3 pad 1", conv_attrs(1, 1, 1, 1), true),
        ("conv stride 2", conv_attrs(2, 1, 1, 1), false),
        ("conv dilation 2", conv_attrs(1, 2, 2, 1), true),
        ("conv groups 2", conv_attrs(1, 0, 1, 2), false),
    ] {
        let w = rnd(&mut rng, &[6, 4 / a.groups, 3, 3], -0.5, 0.5);
        let mut ins = vec![x.clone(), w];
        if bias {
            ins.push(rnd(&mut rng, &[6], -0.5, 0.5));
        }
        cases.push(single(name, Op::Conv2d(a), ins, ACCUM));
    }
    let p = |k: usize, s: usize, pd: usize| Pool2dAttrs {
        kernel: [k, k],
        stride: [s, s],
        padding: [pd, pd],
    };
    cases.push(single(
        "max_pool 3/2/1",
        Op::MaxPool2d(p(3, 2, 1)),
        vec![x.clone()],
        FP32,
    ));
    for inc in [true, false] {
        cases.push(single(
            &format!("avg_pool include_pad {inc}"),
            Op::AvgPool2d {
                pool: p(3, 2, 1),
                count_include_pad: inc,
            },
            vec![x.clone()],
            FP32,
        ));
    }
    cases.push(single(
        "global_avg_pool",
        Op::GlobalAvgPool,
        vec![x.clone()],
        FP32,
    ));
    let c4 = |rng: &mut StdRng, lo: f32, hi: f32| rnd(rng, &[4], lo, hi);
    let bn_in = vec![
        x.clone(),
        c4(&mut rng, 0.5, 1.5),
        c4(&mut rng, -0.5, 0.5),
        c4(&mut rng, -0.5, 0.5),
        c4(&mut rng, 0.5, 2.0),
    ];
    cases.push(single(
        "batch_norm",
        Op::BatchNorm { eps: 1e-5 },
        bn_in,
        FP32,
    ));
    let ln = vec![
        rnd(&mut rng, &[3, 5, 48], -2.0, 2.0),
        rnd(&mut rng, &[48], 0.5, 1.5),
        rnd(&mut rng, &[48], -0.5, 0.5),
    ];
    cases.push(single("layer_norm", Op::LayerNorm { eps: 1e-5 }, ln, FP32));
    cases.push(single(
        "embedding",
        Op::Embedding,
        vec![
            rnd(&mut rng, &[11, 6], -1.0, 1.0),
            ints(&mut rng, &[3, 4], 11),
        ],
        FP32,
    ));
    cases.push(single(
        "cross_entropy",
        Op::CrossEntropy,
        vec![rnd(&mut rng, &[7, 10], -3.0, 3.0), ints(&mut rng, &[7], 10)],
        FP32,
    ));
    cases.push(single(
        "mse_loss",
        Op::MseLoss,
        vec![
            rnd(&mut rng, &[7, 10], -3.0, 3.0),
            rnd(&mut rng, &[7, 10], -3.0, 3.0),
        ],
        FP32,
    ));
    run_all(cases);
}

/// Batch-norm parameters for `c` channels: gamma, beta, mean, var.
fn bn_params(c: &mut Case, rng: &mut StdRng, name: &str, ch: usize) -> [Outlet; 4] {
    let ranges = [(0.5, 1.5), (-0.5, 0.5), (-0.5, 0.5), (0.5, 2.0)];
    let mut out = Vec::new();
    for (k, (lo, hi)) in ranges.into_iter().enumerate() {
        out.push(c.var(&format!("{name}.{k}"), rnd(rng, &[ch], lo, hi)));
    }
    [out[0], out[1], out[2], out[3]]
}

/// Cases of the fused epilogues (see `exec/cuda/fuse.rs`): the planes
/// kernel (vector and scalar) and the flat one, and the chains that must
/// not fuse. Three runs each: op by op, profiled, recorded graph.
fn fused_cases() -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(17);
    let mut cases = Vec::new();
    // conv (bias or not) → [bn] → [add residual] → [relu].
    #[derive(Clone, Copy)]
    struct Shape {
        bias: bool,
        bn: bool,
        add: bool,
        relu: bool,
    }
    let convs = [
        (
            "conv+bn+relu",
            Shape {
                bias: false,
                bn: true,
                add: false,
                relu: true,
            },
            1,
        ),
        (
            "conv+bn+add+relu",
            Shape {
                bias: false,
                bn: true,
                add: true,
                relu: true,
            },
            1,
        ),
        (
            "conv-bias+relu",
            Shape {
                bias: true,
                bn: false,
                add: false,
                relu: true,
            },
            1,
        ),
        (
            "conv-bias+bn+relu",
            Shape {
                bias: true,
                bn: true,
                add: false,
                relu: true,
            },
            1,
        ),
        (
            "conv+bn+add",
            Shape {
                bias: false,
                bn: true,
                add: true,
                relu: false,
            },
            1,
        ),
    ];
    // Spatial sizes: 8x8 (planes, float4), 7x7 (planes, scalar), 5x5
    // (flat, scalar), 2x2 (flat, float4).
    for hw in [8usize, 7, 5, 2] {
        for (name, s, chains) in convs {
            let mut c = Case::new(&format!("{name} {hw}x{hw}")).tol(ACCUM);
            let x = c.input("x", rnd(&mut rng, &[2, 4, hw, hw], -1.0, 1.0));
            let w = c.var("w", rnd(&mut rng, &[4, 4, 3, 3], -0.5, 0.5));
            let b = s.bias.then(|| c.var("b", rnd(&mut rng, &[4], -0.5, 0.5)));
            let mut y = c.g.conv2d(x, w, b, conv_attrs(1, 1, 1, 1));
            if s.bn {
                let [ga, be, me, va] = bn_params(&mut c, &mut rng, "bn", 4);
                y = c.g.batch_norm(y, ga, be, me, va, 1e-5);
            }
            if s.add {
                // The residual on the left for odd sizes.
                y = if hw % 2 == 1 {
                    c.g.add(x, y)
                } else {
                    c.g.add(y, x)
                };
            }
            if s.relu {
                y = c.g.relu(y);
            }
            c.fetch(y, "y");
            c.runs = 3;
            c.chains = Some(chains);
            cases.push(c);
        }
        // bn → relu without a conv, and add → relu.
        let mut c = Case::new(&format!("bn+relu {hw}x{hw}"));
        let x = c.input("x", rnd(&mut rng, &[3, 6, hw, hw], -2.0, 2.0));
        let [ga, be, me, va] = bn_params(&mut c, &mut rng, "bn", 6);
        let y = c.g.batch_norm(x, ga, be, me, va, 1e-3);
        let y = c.g.relu(y);
        c.fetch(y, "y");
        c.runs = 3;
        c.chains = Some(1);
        cases.push(c);
        let mut c = Case::new(&format!("add+relu {hw}x{hw}"));
        let a = c.input("a", rnd(&mut rng, &[3, 6, hw, hw], -2.0, 2.0));
        let b = c.input("b", rnd(&mut rng, &[3, 6, hw, hw], -2.0, 2.0));
        let y = c.g.add(a, b);
        let y = c.g.relu(y);
        c.fetch(y, "y");
        c.runs = 3;
        c.chains = Some(1);
        cases.push(c);
    }
    // matmul → Add(bias along the last axis) → Gelu / Relu (BERT's
    // feed-forward); 16: float4 rows, 10: scalar.
    for (len, act) in [(16usize, "gelu"), (10, "gelu"), (16, "relu")] {
        let mut c = Case::new(&format!("matmul+bias+{act} {len}")).tol(ACCUM);
        let x = c.input("x", rnd(&mut rng, &[2, 5, 12], -1.0, 1.0));
        let w = c.var("w", rnd(&mut rng, &[12, len], -0.5, 0.5));
        let b = c.var("b", rnd(&mut rng, &[len], -0.5, 0.5));
        let m = c.g.matmul(x, w);
        let a = if len == 10 {
            c.g.add(b, m)
        } else {
            c.g.add(m, b)
        };
        let y = if act == "gelu" {
            c.g.gelu(a)
        } else {
            c.g.relu(a)
        };
        c.fetch(y, "y");
        c.runs = 3;
        c.chains = Some(1);
        cases.push(c);
    }
    // Must not fuse: the batch norm's output fetched (the Run re-plans with
    // it live to the end), or read twice.
    let mut c = Case::new("bn fetched: no fusion").tol(ACCUM);
    let x = c.input("x", rnd(&mut rng, &[2, 4, 8, 8], -1.0, 1.0));
    let w = c.var("w", rnd(&mut rng, &[4, 4, 3, 3], -0.5, 0.5));
    let y = c.g.conv2d(x, w, None, conv_attrs(1, 1, 1, 1));
    let [ga, be, me, va] = bn_params(&mut c, &mut rng, "bn", 4);
    let b = c.g.batch_norm(y, ga, be, me, va, 1e-5);
    let r = c.g.relu(b);
    c.fetch(b, "bn_out");
    c.fetch(r, "y");
    c.runs = 3;
    c.chains = Some(0);
    cases.push(c);
    let mut c = Case::new("bn read twice: no fusion");
    let x = c.input("x", rnd(&mut rng, &[2, 4, 8, 8], -1.0, 1.0));
    let [ga, be, me, va] = bn_params(&mut c, &mut rng, "bn", 4);
    let b = c.g.batch_norm(x, ga, be, me, va, 1e-5);
    let r = c.g.relu(b);
    let y = c.g.add(r, b);
    c.fetch(y, "y");
    c.runs = 3;
    c.chains = Some(0);
    cases.push(c);
    // The conv's output fetched: its bias stays in the conv.
    let mut c = Case::new("conv-bias fetched: no fusion").tol(ACCUM);
    let x = c.input("x", rnd(&mut rng, &[2, 4, 8, 8], -1.0, 1.0));
    let w = c.var("w", rnd(&mut rng, &[4, 4, 3, 3], -0.5, 0.5));
    let bias = c.var("b", rnd(&mut rng, &[4], -0.5, 0.5));
    let y = c.g.conv2d(x, w, Some(bias), conv_attrs(1, 1, 1, 1));
    let r = c.g.relu(y);
    c.fetch(y, "conv_out");
    c.fetch(r, "y");
    c.runs = 3;
    c.chains = Some(0);
    cases.push(c);
    cases
}

/// The fused epilogues against the CPU.
#[test]
#[ignore = "needs a GPU"]
fn fused_epilogues() {
    run_all(fused_cases());
}

/// Without a GPU: the matcher, on the memory planner's layout for each
/// case's fetches, finds the chains `fused_epilogues` expects the CUDA
/// program to fuse.
#[test]
fn fused_cases_match_on_the_planner_layout() {
    for c in fused_cases() {
        let (graph, _) = c.g.finish().unwrap();
        let vg = validate(graph, &GraphLimits::default()).unwrap();
        let f = matched_on_plan(&vg, &c.fetches);
        assert_eq!(Some(f.chains.len()), c.chains, "{}: {f:?}", c.name);
    }
}

/// The fusion the CUDA matcher finds on the memory planner's layout of
/// `vg` for its sinks and `fetches`, without a GPU.
fn matched_on_plan(
    vg: &lanes_adaptor::ValidGraph,
    fetches: &[String],
) -> lanes::exec::cuda::fuse::Fusion {
    use lanes::compile;
    let mut fetchable = compile::sinks(vg);
    for k in fetches {
        fetchable.insert(vg.graph().resolve(k).unwrap());
    }
    let plan = compile::plan_outlets(vg, fetchable, Default::default()).unwrap();
    let fetched = plan.fetched.iter().copied().collect();
    let range = |o: Outlet| {
        plan.slot(o)
            .map(|s| (s.offset as usize, (s.offset + s.bytes) as usize))
    };
    lanes::exec::cuda::fuse::find_chains(vg.graph(), vg.order(), &fetched, &range)
}

/// Fusion changes no result: two CNNs and a small BERT on the GPU with and
/// without it agree within 1e-6 (the fused kernel does the unfused
/// kernels' arithmetic in their order).
#[test]
#[ignore = "needs a GPU"]
fn fusion_matches_unfused() {
    let built = [
        (
            "resnet50 b2 64x64",
            models::resnet(&[3, 4, 6, 3], 2, 64).unwrap(),
        ),
        (
            "inception_v3 b1 96x96",
            models::inception_v3(1, 96).unwrap(),
        ),
        (
            "bert small b2 s16",
            models::bert(
                2,
                16,
                &models::BertConfig {
                    vocab: 100,
                    hidden: 64,
                    layers: 2,
                    heads: 4,
                    intermediate: 128,
                    max_positions: 32,
                },
            )
            .unwrap(),
        ),
    ];
    let limits = large_limits();
    for (name, b) in built {
        let mut rng = StdRng::seed_from_u64(5);
        let feeds: BTreeMap<String, Tensor> = b
            .inputs
            .iter()
            .map(|(n, ty)| {
                let t = match ty.dtype {
                    lanes_adaptor::DType::F32 => rnd(&mut rng, ty.shape.dims(), -1.0, 1.0),
                    lanes_adaptor::DType::I64 => ints(&mut rng, ty.shape.dims(), b.vocab as i64),
                    lanes_adaptor::DType::F16 | lanes_adaptor::DType::BF16 => {
                        unreachable!("the models take f32 and i64 inputs")
                    }
                };
                (n.clone(), t)
            })
            .collect();
        let fetches = vec![b.output.clone()];
        let vg = validate(b.graph.clone(), &limits).unwrap();
        let mut out = Vec::new();
        for fuse in [true, false] {
            let opts = CudaOptions {
                fuse,
                ..CudaOptions::default()
            };
            let mut p = CudaProgram::with_options(vg.clone(), b.vars.clone(), opts).unwrap();
            let mut r = Vec::new();
            for _ in 0..3 {
                r = p.run(&feeds, &fetches).unwrap();
            }
            let (chains, skipped) = p.fused_chains();
            println!("{name}: fuse {fuse}: {chains} chains, {skipped} nodes skipped");
            assert_eq!(chains > 0, fuse, "{name}");
            out.push(r.remove(0));
        }
        let tol = Tol {
            rtol: 1e-6,
            atol: 1e-6,
        };
        let w = compare(name, &out[1], &out[0], tol).unwrap();
        println!("ok   {name:<28} fused vs unfused: worst {w:.3} of 1e-6");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn backward_ops() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut cases = Vec::new();
    let s = [3, 5, 6];
    let xt = |rng: &mut StdRng| rnd(rng, &s, -2.0, 2.0);
    cases.push(single(
        "relu_grad",
        Op::ReluGrad,
        vec![xt(&mut rng), xt(&mut rng)],
        FP32,
    ));
    cases.push(single(
        "gelu_grad",
        Op::GeluGrad,
        vec![xt(&mut rng), xt(&mut rng)],
        FP32,
    ));
    for (name, op) in [
        ("hard_sigmoid_grad", Op::HardSigmoidGrad),
        ("hard_swish_grad", Op::HardSwishGrad),
    ] {
        let x = rnd(&mut rng, &s, -5.0, 5.0);
        cases.push(single(name, op, vec![x, xt(&mut rng)], FP32));
    }
    cases.push(single(
        "sigmoid_grad",
        Op::SigmoidGrad,
        vec![rnd(&mut rng, &s, 0.0, 1.0), xt(&mut rng)],
        FP32,
    ));
    cases.push(single(
        "tanh_grad",
        Op::TanhGrad,
        vec![rnd(&mut rng, &s, -1.0, 1.0), xt(&mut rng)],
        FP32,
    ));
    // y must be a real softmax output for the identities to hold; any y
    // still checks the formula.
    cases.push(single(
        "softmax_grad",
        Op::SoftmaxGrad { axis: 1 },
        vec![rnd(&mut rng, &s, 0.0, 1.0), xt(&mut rng)],
        FP32,
    ));
    cases.push(single(
        "log_softmax_grad",
        Op::LogSoftmaxGrad { axis: 2 },
        vec![rnd(&mut rng, &s, -3.0, 0.0), xt(&mut rng)],
        FP32,
    ));
    {
        // ReduceMaxGrad needs y = max(x): build it from ReduceMax.
        let mut c = Case::new("reduce_max_grad");
        let x = c.input("x", xt(&mut rng));
        let dy = c.input("dy", rnd(&mut rng, &[3, 6], -1.0, 1.0));
        let y = c.g.max(x, &[1], false);
        let dx = c.g.op1(
            Op::ReduceMaxGrad {
                axes: vec![1],
                keep_dims: false,
            },
            &[x, y, dy],
        );
        c.fetch(dx, "dx");
        cases.push(c);
    }
    cases.push(single(
        "slice_grad",
        Op::SliceGrad {
            axis: 1,
            start: 2,
            input_dim: 9,
        },
        vec![xt(&mut rng)],
        FP32,
    ));
    let a = conv_attrs(2, 1, 1, 1);
    let x = rnd(&mut rng, &[2, 4, 9, 9], -1.0, 1.0);
    let w = rnd(&mut rng, &[6, 4, 3, 3], -0.5, 0.5);
    let dy = rnd(&mut rng, &[2, 6, 5, 5], -1.0, 1.0);
    cases.push(single(
        "conv2d_grad_input",
        Op::Conv2dGradInput {
            attrs: a,
            input_shape: [2, 4, 9, 9],
        },
        vec![dy.clone(), w],
        ACCUM,
    ));
    cases.push(single(
        "conv2d_grad_filter",
        Op::Conv2dGradFilter {
            attrs: a,
            filter_shape: [6, 4, 3, 3],
        },
        vec![x.clone(), dy],
        ACCUM,
    ));
    let p = Pool2dAttrs {
        kernel: [3, 3],
        stride: [2, 2],
        padding: [1, 1],
    };
    let dyp = rnd(&mut rng, &[2, 4, 5, 5], -1.0, 1.0);
    cases.push(single(
        "max_pool2d_grad",
        Op::MaxPool2dGrad(p),
        vec![x.clone(), dyp.clone()],
        FP32,
    ));
    for inc in [true, false] {
        cases.push(single(
            &format!("avg_pool2d_grad pad {inc}"),
            Op::AvgPool2dGrad {
                pool: p,
                count_include_pad: inc,
            },
            vec![x.clone(), dyp.clone()],
            FP32,
        ));
    }
    // Batch norm with batch statistics: cuDNN's kernels (eps >= 1e-5) and
    // ours (cuDNN off, or eps below cuDNN's minimum) over planes of a
    // multiple of 4 floats (float4 paths), odd planes (9x9, 7x7), planes
    // under 32 floats and one value per plane (rank 2 and 3: flat kernels).
    let shapes: [(&[usize], f32); 7] = [
        (&[2, 4, 9, 9], 1e-5),
        (&[2, 4, 9, 9], 1e-6),
        (&[4, 8, 7, 7], 1e-3),
        (&[3, 2, 64, 64], 1e-5),
        (&[6, 4], 1e-5),
        (&[2, 4, 3], 1e-5),
        // 66,000 planes: more than a grid's y dimension holds.
        (&[2, 33_000, 2, 16], 1e-5),
    ];
    for ((dims, eps), cudnn) in shapes.iter().flat_map(|&s| [(s, true), (s, false)]) {
        let dims = dims.to_vec();
        let what = if cudnn && eps >= 1e-5 {
            "cudnn"
        } else {
            "ours"
        };
        let ch = dims[1];
        let mut c = Case::new(&format!(
            "batch_norm_train (+grad) {what} {dims:?} eps {eps:e}"
        ))
        .tol(ACCUM);
        c.opts.cudnn_batch_norm = cudnn;
        let xi = c.input("x", rnd(&mut rng, &dims, -2.0, 3.0));
        let g = c.var("gamma", rnd(&mut rng, &[ch], 0.5, 1.5));
        let b = c.var("beta", rnd(&mut rng, &[ch], -0.5, 0.5));
        let rm = c.var("rm", Tensor::full([ch], 0.0));
        let rv = c.var("rv", Tensor::full([ch], 1.0));
        let outs = c.g.op(
            Op::BatchNormTrain { eps, momentum: 0.1 },
            &[xi, g, b, rm, rv],
        );
        let dyi = c.input("dy", rnd(&mut rng, &dims, -1.0, 1.0));
        let grads =
            c.g.op(Op::BatchNormTrainGrad, &[xi, g, outs[1], outs[2], dyi]);
        c.fetch_all(&outs, "bn");
        c.fetch_all(&grads, "bn_grad");
        c.runs = 2;
        cases.push(c);
    }
    cases.push(single(
        "layer_norm_grad",
        Op::LayerNormGrad { eps: 1e-5 },
        vec![
            rnd(&mut rng, &[3, 5, 48], -2.0, 2.0),
            rnd(&mut rng, &[48], 0.5, 1.5),
            rnd(&mut rng, &[3, 5, 48], -1.0, 1.0),
        ],
        ACCUM,
    ));
    // Many rows: blocks of 8 warps stride over 2,800 rows (more than 256
    // blocks' worth) and sum dgamma/dbeta in shared memory; and rows too
    // wide for it (2·6,200 floats > 48 KiB).
    for (name, dims) in [
        ("layer_norm_grad many rows", [40usize, 70, 24]),
        ("layer_norm_grad wide rows", [1, 3, 6200]),
    ] {
        let d = dims[2];
        cases.push(single(
            name,
            Op::LayerNormGrad { eps: 1e-5 },
            vec![
                rnd(&mut rng, &dims, -2.0, 2.0),
                rnd(&mut rng, &[d], 0.5, 1.5),
                rnd(&mut rng, &dims, -1.0, 1.0),
            ],
            ACCUM,
        ));
    }
    cases.push(single(
        "embedding_grad",
        Op::EmbeddingGrad { num_embeddings: 11 },
        vec![
            ints(&mut rng, &[3, 4], 11),
            rnd(&mut rng, &[3, 4, 6], -1.0, 1.0),
        ],
        FP32,
    ));
    cases.push(single(
        "cross_entropy_grad",
        Op::CrossEntropyGrad,
        vec![
            rnd(&mut rng, &[7, 10], -3.0, 3.0),
            ints(&mut rng, &[7], 10),
            Tensor::scalar(1.5),
        ],
        FP32,
    ));
    run_all(cases);
}

#[test]
#[ignore = "needs a GPU"]
fn in_place_updates() {
    let mut rng = StdRng::seed_from_u64(8);
    let mut cases = Vec::new();
    for (name, momentum, wd, nesterov) in [
        ("sgd plain", 0.0, 0.0, false),
        ("sgd momentum wd", 0.9, 1e-2, false),
        ("sgd nesterov", 0.9, 0.0, true),
    ] {
        let mut c = Case::new(name);
        let p = c.var("p", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let buf = c.var("buf", Tensor::full([5, 7], 0.0));
        let gi = c.input("g", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        c.g.op(
            Op::SgdUpdate {
                lr: 0.1,
                momentum,
                weight_decay: wd,
                nesterov,
            },
            &[p, gi, buf],
        );
        c.runs = 3;
        cases.push(c);
    }
    for decoupled in [false, true] {
        let mut c = Case::new(&format!("adam decoupled {decoupled}"));
        let p = c.var("p", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let m = c.var("m", Tensor::full([5, 7], 0.0));
        let v = c.var("v", Tensor::full([5, 7], 0.0));
        let step = c.var("step", Tensor::full([1], 0.0));
        let gi = c.input("g", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        c.g.op(
            Op::AdamUpdate {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 1e-2,
                decoupled,
            },
            &[p, gi, m, v, step],
        );
        c.runs = 3;
        cases.push(c);
    }
    // The learning rate from a variable (a job's scheduler writes it).
    {
        let mut c = Case::new("sgd lr from a variable");
        let p = c.var("p", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let buf = c.var("buf", Tensor::full([5, 7], 0.0));
        let lr = c.var("lr", Tensor::full([1], 0.05));
        let gi = c.input("g", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let sgd = Op::SgdUpdate {
            lr: 1.0,
            momentum: 0.9,
            weight_decay: 1e-2,
            nesterov: true,
        };
        c.g.op(sgd, &[p, gi, buf, lr]);
        c.runs = 3;
        cases.push(c);
        let mut c = Case::new("adamw lr from a variable");
        let p = c.var("p", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let m = c.var("m", Tensor::full([5, 7], 0.0));
        let v = c.var("v", Tensor::full([5, 7], 0.0));
        let step = c.var("step", Tensor::full([1], 0.0));
        let lr = c.var("lr", Tensor::full([1], 3e-3));
        let gi = c.input("g", rnd(&mut rng, &[5, 7], -1.0, 1.0));
        let adam = Op::AdamUpdate {
            lr: 1.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            decoupled: true,
        };
        c.g.op(adam, &[p, gi, m, v, step, lr]);
        c.runs = 3;
        cases.push(c);
    }
    // Dropout masks: the same elements dropped on both backends (exact).
    for (p, salt) in [(0.1f32, 0u32), (0.5, 7)] {
        let mut c = Case::new(&format!("dropout mask p {p}"));
        let seed = c.input("seed", Tensor::from_i64([1], vec![12345]).unwrap());
        let y = c.g.op1(
            Op::DropoutMask {
                p,
                salt,
                shape: vec![3, 33, 65],
            },
            &[seed],
        );
        c.fetch(y, "mask");
        c.tol = Tol {
            rtol: 0.0,
            atol: 0.0,
        };
        cases.push(c);
    }
    {
        let mut c = Case::new("assign");
        let t = c.var("t", Tensor::full([4], 0.0));
        let v = c.input("v", rnd(&mut rng, &[4], -1.0, 1.0));
        c.g.op(Op::Assign, &[t, v]);
        cases.push(c);
    }
    run_all(cases);
}

fn model_case(name: &str, built: models::Built, seed: u64) -> Case {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut c = Case::new(name);
    for (n, ty) in &built.inputs {
        let t = match ty.dtype {
            lanes_adaptor::DType::F32 => rnd(&mut rng, ty.shape.dims(), -1.0, 1.0),
            lanes_adaptor::DType::I64 => ints(&mut rng, ty.shape.dims(), built.vocab as i64),
            lanes_adaptor::DType::F16 | lanes_adaptor::DType::BF16 => {
                unreachable!("the models take f32 and i64 inputs")
            }
        };
        c.feeds.insert(n.clone(), t);
    }
    c.fetches.push(built.output.clone());
    c.prebuilt = Some((built.graph, built.vars));
    c.opts = CudaOptions::default();
    c.tol = TF32;
    c.runs = 2;
    c
}

#[test]
#[ignore = "needs a GPU"]
fn models_inference() {
    let small_bert = models::BertConfig {
        vocab: 100,
        hidden: 64,
        layers: 2,
        heads: 4,
        intermediate: 128,
        max_positions: 32,
    };
    let cases = vec![
        model_case(
            "resnet50 b2 64x64",
            models::resnet(&[3, 4, 6, 3], 2, 64).unwrap(),
            1,
        ),
        model_case(
            "inception_v3 b1 96x96",
            models::inception_v3(1, 96).unwrap(),
            2,
        ),
        model_case(
            "bert small b2 s16",
            models::bert(2, 16, &small_bert).unwrap(),
            3,
        ),
    ];
    run_all(cases);
}

/// A small ResNet's training graph (batch-norm batch statistics, SGD with
/// momentum and weight decay) and feeds for it.
fn small_training() -> (lanes_adaptor::TrainingGraph, BTreeMap<String, Tensor>) {
    use lanes_adaptor::{Arch, DType, Optimizer};
    let (t, inputs) = Arch::ResNet18Cifar { classes: 10 }
        .training(4, 5, &Optimizer::sgd_momentum(0.01, 0.9, 1e-4))
        .unwrap();
    let mut rng = StdRng::seed_from_u64(11);
    let feeds = inputs
        .iter()
        .map(|(n, ty)| {
            let v = match ty.dtype {
                DType::F32 => rnd(&mut rng, ty.shape.dims(), -1.0, 1.0),
                DType::I64 => ints(&mut rng, ty.shape.dims(), 10),
                DType::F16 | DType::BF16 => unreachable!("the models take f32 and i64 inputs"),
            };
            (n.clone(), v)
        })
        .collect();
    (t, feeds)
}

/// A training step of a small ResNet on both backends, FP32 convolutions:
/// the loss, the parameters and running statistics after it within
/// `ACCUM`, the momentum buffers (the gradients) within `TRAIN_VARS`, with
/// cuDNN's batch norm and with ours. One step: after a second the
/// parameters have moved apart by the gradients' differences, and those
/// grow (see `TRAIN_VARS`).
#[test]
#[ignore = "needs a GPU"]
fn models_training() {
    let mut cases = Vec::new();
    for cudnn in [true, false] {
        let (t, feeds) = small_training();
        let mut c = Case::new(&format!("resnet18-cifar b4 step, cuDNN BN {cudnn}"));
        c.feeds = feeds;
        c.fetches.push(t.loss.clone());
        c.prebuilt = Some((t.graph, t.vars));
        c.opts.cudnn_batch_norm = cudnn;
        c.tol = ACCUM;
        c.opt_state_tol = Some(TRAIN_VARS);
        cases.push(c);
    }
    run_all(cases);
}

/// Which batch norms cuDNN takes, and cuDNN's against ours in the same
/// training step on the GPU (FP32 convolutions): the loss within `FP32`, the
/// other variables as in [`models_training`].
#[test]
#[ignore = "needs a GPU"]
fn cudnn_batch_norm_matches_ours_in_training() {
    let (t, feeds) = small_training();
    let limits = large_limits();
    let vg = validate(t.graph, &limits).unwrap();
    let fetch = vec![t.loss.clone()];
    let mut results = Vec::new();
    for cudnn in [true, false] {
        let opts = CudaOptions {
            cudnn_batch_norm: cudnn,
            conv_tf32: false,
            ..CudaOptions::default()
        };
        let mut p = CudaProgram::with_options(vg.clone(), t.vars.clone(), opts).unwrap();
        // ResNet-18: 20 batch norms (their gradients run on our kernels).
        let expected = if cudnn { 20 } else { 0 };
        assert_eq!(p.cudnn_batch_norms(), expected, "cuDNN {cudnn}");
        let loss = p.run(&feeds, &fetch).unwrap().remove(0);
        results.push((loss, p.read_variables(&[]).unwrap()));
    }
    let (a, b) = (&results[0], &results[1]);
    let mut worst = compare("loss", &a.0, &b.0, FP32).unwrap();
    assert_eq!(a.1.len(), b.1.len());
    for (name, x) in &a.1 {
        let tol = var_tol(name, ACCUM, Some(TRAIN_VARS));
        worst = worst.max(compare(name, x, &b.1[name], tol).unwrap());
    }
    println!("cuDNN batch norm vs ours, one step: worst {worst:.3} of tolerance");

    // A job that urgent lanes may outrank keeps to our kernels.
    for (yields, expected) in [(true, 0), (false, 20)] {
        let share = GpuShare {
            urgency: 0,
            yields,
            gate: None,
        };
        match Program::sharing(Backend::Cuda, vg.clone(), t.vars.clone(), share).unwrap() {
            Program::Cuda(p) => assert_eq!(p.cudnn_batch_norms(), expected, "yields {yields}"),
            Program::Cpu(_) => panic!("a CPU program for the CUDA backend"),
        }
    }

    // Below cuDNN's smallest eps our kernels run.
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", lanes_adaptor::TensorType::f32([2, 3, 4, 4]));
    for eps in [1e-5, 1e-6] {
        let mut v = |n: &str| g.variable(&format!("{n}{eps}"), Tensor::full([3], 1.0));
        let ins = [x, v("g"), v("b"), v("rm"), v("rv")];
        let outs = g.op(Op::BatchNormTrain { eps, momentum: 0.1 }, &ins);
        g.set_name(outs[0], &format!("y{eps}"));
    }
    let (graph, vars) = g.finish().unwrap();
    let p = CudaProgram::new(validate(graph, &limits).unwrap(), vars).unwrap();
    assert_eq!(p.cudnn_batch_norms(), 1);
}

/// Replaying the recorded CUDA graph gives the same results as launching op
/// by op (no CPU needed). Within 1e-6: only atomics may reorder sums.
#[test]
#[ignore = "needs a GPU"]
fn graph_replay_matches_op_by_op() {
    let small_bert = models::BertConfig {
        vocab: 100,
        hidden: 64,
        layers: 2,
        heads: 4,
        intermediate: 128,
        max_positions: 32,
    };
    for built in [
        models::resnet(&[3, 4, 6, 3], 2, 64).unwrap(),
        models::bert(2, 16, &small_bert).unwrap(),
    ] {
        let mut rng = StdRng::seed_from_u64(9);
        let feeds: BTreeMap<String, Tensor> = built
            .inputs
            .iter()
            .map(|(n, ty)| {
                let t = match ty.dtype {
                    lanes_adaptor::DType::F32 => rnd(&mut rng, ty.shape.dims(), -1.0, 1.0),
                    lanes_adaptor::DType::I64 => {
                        ints(&mut rng, ty.shape.dims(), built.vocab as i64)
                    }
                    lanes_adaptor::DType::F16 | lanes_adaptor::DType::BF16 => {
                        unreachable!("the models take f32 and i64 inputs")
                    }
                };
                (n.clone(), t)
            })
            .collect();
        let limits = large_limits();
        let vg = validate(built.graph, &limits).unwrap();
        let fetch = vec![built.output.clone()];
        let mut outs = Vec::new();
        for cuda_graph in [true, false] {
            let opts = CudaOptions {
                cuda_graph,
                ..CudaOptions::default()
            };
            let mut p = CudaProgram::with_options(vg.clone(), built.vars.clone(), opts).unwrap();
            // The first iteration warms up, the second is profiled op by
            // op (for switching), the third is recorded and replayed.
            let first = p.run(&feeds, &fetch).unwrap();
            let second = p.run(&feeds, &fetch).unwrap();
            let third = p.run(&feeds, &fetch).unwrap();
            assert_eq!(p.uses_cuda_graph(), cuda_graph);
            assert_eq!(first, second, "repeated runs differ (graph {cuda_graph})");
            assert_eq!(first, third, "repeated runs differ (graph {cuda_graph})");
            outs.push(first);
        }
        let w = compare(
            "graph vs op by op",
            &outs[1][0],
            &outs[0][0],
            Tol {
                rtol: 1e-6,
                atol: 1e-6,
            },
        )
        .unwrap();
        println!("graph replay vs op by op: worst {w:.3} of tolerance");
        assert!(outs[0][0].f32s().unwrap().iter().all(|v| v.is_finite()));
    }
}

/// On the GPU machine the probe finds the device and never panics.
#[test]
#[ignore = "needs a GPU"]
fn probe_finds_the_gpu() {
    let info = lanes::exec::cuda::probe().unwrap();
    println!("probe: {} with {} bytes", info.name, info.total_memory);
    assert!(info.total_memory > 0);
    assert!(!info.name.is_empty());
}

/// Errors are typed, never panics: bad feeds and fetches on a CUDA program.
#[test]
#[ignore = "needs a GPU"]
fn cuda_program_rejects_bad_requests() {
    use lanes::exec::ExecError;
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", lanes_adaptor::TensorType::f32([2, 3]));
    let w = g.variable("w", Tensor::full([3, 4], 0.5));
    let y = g.matmul(x, w);
    g.set_name(y, "y");
    let (graph, vars) = g.finish().unwrap();
    let vg = validate(graph, &GraphLimits::default()).unwrap();
    assert!(matches!(
        CudaProgram::new(vg.clone(), VarValues::new()),
        Err(ExecError::MissingVariable { .. })
    ));
    let mut p = CudaProgram::new(vg, vars).unwrap();
    let good: BTreeMap<String, Tensor> = [("x".to_string(), Tensor::full([2, 3], 1.0))].into();
    let out = p.run(&good, &["y".into()]).unwrap();
    assert_eq!(out[0].f32s().unwrap(), &[1.5f32; 8][..]);
    assert!(matches!(
        p.run(&BTreeMap::<String, Tensor>::new(), &["y".into()]),
        Err(ExecError::MissingFeed { .. })
    ));
    let wrong: BTreeMap<String, Tensor> = [("x".to_string(), Tensor::full([3, 3], 1.0))].into();
    assert!(matches!(
        p.run(&wrong, &["y".into()]),
        Err(ExecError::FeedType { .. })
    ));
    assert!(matches!(
        p.run(&good, &["nope".into()]),
        Err(ExecError::UnknownFetch { .. })
    ));
    let vars = p.read_variables(&[]).unwrap();
    assert_eq!(vars["w"], Tensor::full([3, 4], 0.5));
    p.write_variables([("w".to_string(), Tensor::full([3, 4], 1.0))].into())
        .unwrap();
    let out = p.run(&good, &["y".into()]).unwrap();
    assert_eq!(out[0].f32s().unwrap(), &[3.0f32; 8][..]);
    assert!(matches!(
        p.write_variables([("w".to_string(), Tensor::full([4], 1.0))].into()),
        Err(ExecError::VariableType { .. })
    ));
}

/// A Run that fetches an output the memory plan lets die early (not a
/// sink) re-plans the arena: results still match the CPU, before and after
/// the iteration was recorded as a CUDA graph, and across an eviction.
#[test]
#[ignore = "needs a GPU"]
fn fetching_an_intermediate_replans() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", lanes_adaptor::TensorType::f32([64, 256]));
    let w1 = g.variable("w1", rnd(&mut rng, &[256, 512], -0.1, 0.1));
    let w2 = g.variable("w2", rnd(&mut rng, &[512, 2048], -0.1, 0.1));
    let h = g.matmul(x, w1);
    let h = g.relu(h);
    g.set_name(h, "h");
    // After h dies (sinks only), z0 and z1 (512 KiB each) are the peak;
    // keeping h to the end adds its 128 KiB to it.
    let z = g.matmul(h, w2);
    let z = g.tanh(z);
    let z = g.sum(z, &[1], false);
    g.set_name(z, "z");
    let (graph, vars) = g.finish().unwrap();
    let vg = validate(graph, &GraphLimits::default()).unwrap();
    let mut cpu = CpuProgram::new(vg.clone(), vars.clone()).unwrap();
    let mut gpu = CudaProgram::new(vg, vars).unwrap();
    let before = gpu.arena_parts();
    let feeds: BTreeMap<String, Tensor> =
        [("x".to_string(), rnd(&mut rng, &[64, 256], -1.0, 1.0))].into();
    let sets: [&[&str]; 9] = [
        &["z"],
        &["z"],
        &["z"],
        &["z"],
        &["h", "z"],
        &["h", "z"],
        &["h", "z"],
        &["h"],
        &["z", "h"],
    ];
    for (k, set) in sets.iter().enumerate() {
        let fetches: Vec<String> = set.iter().map(|s| s.to_string()).collect();
        if k == 6 {
            gpu.evict().unwrap();
        }
        let a = cpu.run(&feeds, &fetches).unwrap();
        let b = gpu.run(&feeds, &fetches).unwrap();
        for (j, (x, y)) in a.iter().zip(&b).enumerate() {
            compare(&format!("run {k} fetch {}", fetches[j]), x, y, ACCUM).unwrap();
        }
    }
    let after = gpu.arena_parts();
    // Keeping h to the end costs its bytes: T grows by at least 64·512·4.
    assert!(
        after.ephemeral >= before.ephemeral + 64 * 512 * 4,
        "{before:?} -> {after:?}"
    );
}

/// The ops added for imported models, and the ONNX fixtures (PyTorch
/// exports in `tests/data/onnx`) imported at batch 2.
#[test]
#[ignore = "needs a GPU"]
fn imported_model_ops_and_onnx_fixtures() {
    let mut rng = StdRng::seed_from_u64(11);
    let mask = |rng: &mut StdRng, dims: &[usize]| {
        let n: usize = dims.iter().product();
        Tensor::from_f32(
            dims.to_vec(),
            (0..n)
                .map(|_| f32::from(u8::from(rng.gen_bool(0.5))))
                .collect(),
        )
        .unwrap()
    };
    let mut cases = vec![
        unary("erf", Op::Erf, -3.0, 3.0),
        unary("is_nan", Op::IsNan, -3.0, 3.0),
        unary("hard_sigmoid", Op::HardSigmoid, -5.0, 5.0),
        unary("hard_swish", Op::HardSwish, -5.0, 5.0),
        unary(
            "clip",
            Op::Clip {
                min: -0.5,
                max: 0.7,
            },
            -2.0,
            2.0,
        ),
        single(
            "where bcast",
            Op::Where,
            vec![
                mask(&mut rng, &[4, 1, 6]),
                rnd(&mut rng, &[4, 5, 6], -1.0, 1.0),
                rnd(&mut rng, &[6], -1.0, 1.0),
            ],
            FP32,
        ),
        single(
            "cast f32 to i64",
            Op::Cast {
                to: lanes_adaptor::DType::I64,
            },
            vec![rnd(&mut rng, &[3, 7], -50.0, 50.0)],
            FP32,
        ),
        single(
            "cast i64 to f32",
            Op::Cast {
                to: lanes_adaptor::DType::F32,
            },
            vec![ints(&mut rng, &[3, 7], 1000)],
            FP32,
        ),
    ];
    // Cargo's path, or the repository-relative one where the test binary
    // was copied to another machine (the GPU machine runs it from the repo
    // root), as tests/digits.rs.
    let built = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/onnx");
    let dir = if built.exists() {
        built
    } else {
        std::path::PathBuf::from("tests/data/onnx")
    };
    for (model, ins) in [
        ("resnet18", &["input"][..]),
        ("resnet50", &["input"]),
        ("inception_v3", &["input"]),
        ("mobilenet_v2", &["input"]),
        ("vgg16", &["input"]),
        ("densenet121", &["input"]),
        ("bert", &["input_ids", "attention_mask"]),
    ] {
        let opts = lanes_adaptor::onnx::ImportOptions {
            batch: 2,
            ..Default::default()
        };
        let m = lanes_adaptor::onnx::import_file(dir.join(format!("{model}.onnx")), &opts).unwrap();
        let mut c = Case::new(&format!("onnx {model}"));
        for name in ins {
            let t = lanes::npy::read(dir.join(format!("{model}.{name}.npy"))).unwrap();
            c.feeds.insert(name.to_string(), t);
        }
        c.fetches = m.outputs.iter().map(|(n, _)| n.clone()).collect();
        c.prebuilt = Some((m.graph, m.vars));
        cases.push(c.tol(ACCUM));
    }
    run_all(cases);
}
