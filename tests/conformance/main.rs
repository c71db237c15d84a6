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

/// Fused epilogues against the CPU and the unfused kernels (`fused.rs`).
mod fused;

/// Backward ops and in-place updates (`backward.rs`).
mod backward;

/// Whole models and a CUDA program's own behaviour (`whole.rs`).
mod whole;

use fused::matched_on_plan;
use whole::small_training;

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

/// Random feeds for a zoo model's inputs (f32 in [-1, 1), token ids below
/// its vocabulary), from `seed`, in input order.
fn model_feeds(built: &models::Built, seed: u64) -> BTreeMap<String, Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    built
        .inputs
        .iter()
        .map(|(n, ty)| {
            let t = match ty.dtype {
                lanes_adaptor::DType::F32 => rnd(&mut rng, ty.shape.dims(), -1.0, 1.0),
                lanes_adaptor::DType::I64 => ints(&mut rng, ty.shape.dims(), built.vocab as i64),
                lanes_adaptor::DType::F16 | lanes_adaptor::DType::BF16 => {
                    unreachable!("the models take f32 and i64 inputs")
                }
            };
            (n.clone(), t)
        })
        .collect()
}

/// The small BERT of the model tests (2 layers, hidden 64, 4 heads).
fn small_bert() -> models::BertConfig {
    models::BertConfig {
        vocab: 100,
        hidden: 64,
        layers: 2,
        heads: 4,
        intermediate: 128,
        max_positions: 32,
    }
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
