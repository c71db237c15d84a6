//! Softmax chains (`exec/cuda/fuse/softmax.rs`) on the GPU: attention's
//! scale, mask, casts and softmax as one kernel, and the gradient's casts
//! and scale around `SoftmaxGrad` as another, give bit for bit what the
//! unfused kernels give, and what the CPU reference computes within the
//! dtype's tolerance.

use super::*;
use lanes_adaptor::{DType, Op, TensorType};

/// Attention-shaped: q·kᵀ in `dt` (cast from f32 feeds), [× scale] [+ a
/// causal-like mask broadcast over heads], cast to f32, softmax over the
/// last axis, cast back, · v; and a gradient `dp` (fed, in `dt`) cast to
/// f32, `SoftmaxGrad` with the softmax's output, cast back and scaled.
/// Fetches the product, the softmax's output and the scaled gradient.
fn attention(dt: DType, mask: bool, scale: bool) -> (lanes_adaptor::Graph, VarValues, Vec<String>) {
    let (b, h, s, d) = (2, 3, 40, 16);
    let mut g = GraphBuilder::new();
    let half = |g: &mut GraphBuilder, x: Outlet| if dt == DType::F32 { x } else { g.cast(x, dt) };
    let q = g.placeholder("q", TensorType::f32([b, h, s, d]));
    let k = g.placeholder("k", TensorType::f32([b, h, s, d]));
    let v = g.placeholder("v", TensorType::f32([b, h, s, d]));
    let dp = g.placeholder("dp", TensorType::f32([b, h, s, s]));
    let (q, k, v, dp) = (
        half(&mut g, q),
        half(&mut g, k),
        half(&mut g, v),
        half(&mut g, dp),
    );
    // The mask is made before the scores (so nothing runs between the
    // scale and the add, as in GPT-2's graph).
    let m = mask.then(|| {
        let m = g.placeholder("mask", TensorType::f32([b, 1, s, s]));
        half(&mut g, m)
    });
    let mut x = g.matmul_t(q, k, false, true);
    if scale {
        x = g.scale(x, 0.25);
    }
    if let Some(m) = m {
        x = g.add(x, m);
    }
    if dt != DType::F32 {
        x = g.cast(x, DType::F32);
    }
    let p = g.softmax(x, 3);
    let pl = half(&mut g, p);
    let o = g.matmul(pl, v);
    let dpf = if dt == DType::F32 {
        dp
    } else {
        g.cast(dp, DType::F32)
    };
    let ds = g.op(Op::SoftmaxGrad { axis: 3 }, &[p, dpf])[0];
    let dsl = half(&mut g, ds);
    let dss = g.scale(dsl, 0.25);
    // Read further, as the products of the backward pass read it.
    let dq = g.matmul(dss, k);
    // Fetched as f32 (the comparison reads f32).
    let wide = |g: &mut GraphBuilder, x: Outlet| {
        if dt == DType::F32 {
            x
        } else {
            g.cast(x, DType::F32)
        }
    };
    let (o, dq) = (wide(&mut g, o), wide(&mut g, dq));
    for (o, n) in [(o, "o"), (p, "p"), (dq, "dq")] {
        g.set_name(o, n);
    }
    let (graph, vars) = g.finish().unwrap();
    (graph, vars, vec!["o".into(), "p".into(), "dq".into()])
}

fn feeds(rng: &mut StdRng, mask: bool) -> BTreeMap<String, Tensor> {
    let (b, h, s, d) = (2, 3, 40, 16);
    let mut f: BTreeMap<String, Tensor> = [
        ("q".to_string(), rnd(rng, &[b, h, s, d], -2.0, 2.0)),
        ("k".to_string(), rnd(rng, &[b, h, s, d], -2.0, 2.0)),
        ("v".to_string(), rnd(rng, &[b, h, s, d], -1.0, 1.0)),
        ("dp".to_string(), rnd(rng, &[b, h, s, s], -1.0, 1.0)),
    ]
    .into();
    if mask {
        // Causal: -10000 above the diagonal, a little noise below.
        let mut m = Vec::with_capacity(b * s * s);
        for _ in 0..b {
            for i in 0..s {
                for j in 0..s {
                    m.push(if j > i {
                        -10000.0
                    } else {
                        rng.gen_range(-0.5..0.5)
                    });
                }
            }
        }
        f.insert(
            "mask".into(),
            Tensor::from_f32(vec![b, 1, s, s], m).unwrap(),
        );
    }
    f
}

const VARIANTS: [(DType, bool, bool); 5] = [
    (DType::BF16, true, true),
    (DType::BF16, false, false),
    (DType::F16, true, false),
    (DType::F32, true, true),
    (DType::BF16, false, true),
];

/// Without a GPU: on the planner's layout the matcher finds both chains
/// of every variant, with the ops the variant has.
#[test]
fn softmax_chains_match_on_the_planner_layout() {
    for (dt, mask, scale) in VARIANTS {
        let (graph, _, fetches) = attention(dt, mask, scale);
        let vg = validate(graph, &GraphLimits::default()).unwrap();
        let f = matched_on_plan(&vg, &fetches);
        let what = format!("{dt:?} mask {mask} scale {scale}: {:?}", f.softmax);
        assert_eq!(f.softmax.len(), 2, "{what}");
        let (fwd, bwd) = (&f.softmax[0], &f.softmax[1]);
        assert!(!fwd.grad && bwd.grad, "{what}");
        assert_eq!(fwd.mask.is_some(), mask, "{what}");
        assert_eq!(fwd.scale.is_some(), scale, "{what}");
        // The softmax's output is fetched and read by the gradient: kept.
        assert!(fwd.own, "{what}");
        assert_eq!(fwd.half.is_some(), dt != DType::F32, "{what}");
        assert_eq!(bwd.post_scale, Some(0.25), "{what}");
        assert!(bwd.half.is_some(), "{what}");
        // Every node but the last launches nothing.
        let skipped = fwd.nodes.len() + bwd.nodes.len() - 2;
        assert_eq!(f.skipped(), skipped, "{what}");
    }
}

/// Without a GPU: a fetched intermediate is not absorbed (the Add's sum
/// here), a softmax over another axis does not fuse.
#[test]
fn softmax_chains_leave_what_is_fetched() {
    let (graph, _, mut fetches) = attention(DType::BF16, true, true);
    let vg = validate(graph, &GraphLimits::default()).unwrap();
    let add = vg
        .graph()
        .nodes
        .iter()
        .position(|n| matches!(n.op, Op::Add))
        .unwrap();
    fetches.push(vg.graph().nodes[add].name.clone());
    let f = matched_on_plan(&vg, &fetches);
    assert_eq!(f.softmax.len(), 2, "{:?}", f.softmax);
    assert!(f.softmax[0].mask.is_none() && f.softmax[0].scale.is_none());

    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([4, 6, 5]));
    let xb = g.cast(x, DType::BF16);
    let xf = g.cast(xb, DType::F32);
    let y = g.softmax(xf, 1);
    g.set_name(y, "y");
    let (graph, _) = g.finish().unwrap();
    let vg = validate(graph, &GraphLimits::default()).unwrap();
    let f = matched_on_plan(&vg, &[]);
    assert!(f.softmax.is_empty(), "{:?}", f.softmax);
}

/// On the GPU: fused and unfused programs agree bit for bit over
/// iterations launched op by op and replayed, both chains fuse, and the
/// results are within the dtype's tolerance of the CPU's.
#[test]
#[ignore = "needs a GPU"]
fn softmax_chains_change_no_result() {
    let mut rng = StdRng::seed_from_u64(41);
    for (dt, mask, scale) in VARIANTS {
        let what = format!("{dt:?} mask {mask} scale {scale}");
        let (graph, vars, fetches) = attention(dt, mask, scale);
        let vg = validate(graph, &GraphLimits::default()).unwrap();
        let f = feeds(&mut rng, mask);
        let mut fused = CudaProgram::with_options(vg.clone(), vars.clone(), exact(true)).unwrap();
        let mut plain = CudaProgram::with_options(vg.clone(), vars.clone(), exact(false)).unwrap();
        let mut cpu = CpuProgram::new(vg, vars).unwrap();
        let want = cpu.run(&f, &fetches).unwrap();
        // A bf16 product may differ from the CPU's by an ulp of its
        // accumulation; what follows inherits it.
        let u = match dt {
            DType::BF16 => 1.0 / 128.0,
            DType::F16 => 1.0 / 1024.0,
            _ => 1e-5,
        };
        let tol = Tol {
            rtol: 8.0 * u,
            atol: 8.0 * u,
        };
        for it in 0..4 {
            let a = fused.run(&f, &fetches).unwrap();
            let b = plain.run(&f, &fetches).unwrap();
            for ((x, y), key) in a.iter().zip(&b).zip(&fetches) {
                assert_eq!(
                    x, y,
                    "{what}, iteration {it}: {key} fused differs from unfused"
                );
            }
            for ((c, g), key) in want.iter().zip(&a).zip(&fetches) {
                compare(&format!("{what}, iteration {it}: {key}"), c, g, tol).unwrap();
            }
        }
        assert_eq!(fused.fused_chains().0, 2, "{what}");
        assert_eq!(plain.fused_chains().0, 0, "{what}");
        println!("ok {what}");
    }
}

/// PyTorch's scaled-dot-product attention as exported to ONNX: scores
/// scaled and masked (-∞, a row of the first batch element masked
/// throughout), softmax in f32, then `Where(IsNan(p), 0, p)`, · v. Fetches
/// the cleaned probabilities and the product.
fn sdpa_nan_cleanup() -> (lanes_adaptor::Graph, Vec<String>, BTreeMap<String, Tensor>) {
    let (b, h, s, d) = (2, 3, 40, 16);
    let mut g = GraphBuilder::new();
    let q = g.placeholder("q", TensorType::f32([b, h, s, d]));
    let k = g.placeholder("k", TensorType::f32([b, h, s, d]));
    let v = g.placeholder("v", TensorType::f32([b, h, s, d]));
    let m = g.placeholder("mask", TensorType::f32([b, 1, s, s]));
    let x = g.matmul_t(q, k, false, true);
    let x = g.scale(x, 0.25);
    let x = g.add(x, m);
    let p = g.softmax(x, 3);
    let n = g.op(Op::IsNan, &[p])[0];
    let zero = g.constant(Tensor::from_f32([1], vec![0.0]).unwrap());
    let c = g.op(Op::Where, &[n, zero, p])[0];
    g.set_name(c, "probs");
    let o = g.matmul(c, v);
    g.set_name(o, "o");
    let (graph, _) = g.finish().unwrap();
    let mut rng = StdRng::seed_from_u64(43);
    let mut f = feeds(&mut rng, false);
    f.remove("dp");
    let mut mask = Vec::with_capacity(b * s * s);
    for bi in 0..b {
        for i in 0..s {
            for j in 0..s {
                mask.push(if (bi == 0 && i == 3) || j > i {
                    f32::NEG_INFINITY
                } else {
                    0.0
                });
            }
        }
    }
    f.insert(
        "mask".into(),
        Tensor::from_f32(vec![b, 1, s, s], mask).unwrap(),
    );
    (graph, vec!["probs".into(), "o".into()], f)
}

/// Without a GPU: the NaN cleanup after a softmax joins its chain (which
/// then writes the Where's output), unless the softmax's output is
/// fetched.
#[test]
fn softmax_chains_take_in_the_nan_cleanup() {
    let (graph, fetches, _) = sdpa_nan_cleanup();
    let vg = validate(graph, &GraphLimits::default()).unwrap();
    let f = matched_on_plan(&vg, &fetches);
    assert_eq!(f.softmax.len(), 1, "{:?}", f.softmax);
    let c = &f.softmax[0];
    let probs = vg.graph().resolve("probs").unwrap();
    assert_eq!(c.nan_zero, Some(probs), "{c:?}");
    assert!(!c.own && c.half.is_none() && c.scale == Some(0.25) && c.mask.is_some());
    assert_eq!(c.last(), probs.node);
    // Scale, Add, Softmax, IsNan before the Where launch nothing.
    assert_eq!(f.skipped(), 4);

    let softmax = vg
        .graph()
        .nodes
        .iter()
        .position(|n| matches!(n.op, Op::Softmax { .. }))
        .unwrap();
    let mut more = fetches.clone();
    more.push(vg.graph().nodes[softmax].name.clone());
    let f = matched_on_plan(&vg, &more);
    assert!(
        f.softmax.iter().all(|c| c.nan_zero.is_none()),
        "{:?}",
        f.softmax
    );
}

/// On the GPU: with the cleanup fused, a row masked throughout comes out
/// as zeros, bit for bit as the unfused kernels give it, and the rest
/// within f32 tolerance of the CPU's.
#[test]
#[ignore = "needs a GPU"]
fn softmax_nan_cleanup_changes_no_result() {
    let (graph, fetches, f) = sdpa_nan_cleanup();
    let vg = validate(graph, &GraphLimits::default()).unwrap();
    let vars = VarValues::new();
    let mut fused = CudaProgram::with_options(vg.clone(), vars.clone(), exact(true)).unwrap();
    let mut plain = CudaProgram::with_options(vg.clone(), vars.clone(), exact(false)).unwrap();
    let mut cpu = CpuProgram::new(vg, vars).unwrap();
    let want = cpu.run(&f, &fetches).unwrap();
    let tol = Tol {
        rtol: 1e-4,
        atol: 1e-5,
    };
    for it in 0..3 {
        let a = fused.run(&f, &fetches).unwrap();
        let b = plain.run(&f, &fetches).unwrap();
        for ((x, y), key) in a.iter().zip(&b).zip(&fetches) {
            assert_eq!(x, y, "iteration {it}: {key} fused differs from unfused");
        }
        for ((c, g), key) in want.iter().zip(&a).zip(&fetches) {
            compare(&format!("iteration {it}: {key}"), c, g, tol).unwrap();
        }
        // Batch 0, head 0, row 3: masked throughout, zeros.
        let p = a[0].f32s().unwrap();
        assert!(p[3 * 40..4 * 40].iter().all(|&v| v.to_bits() == 0));
    }
    assert_eq!(fused.fused_chains().0, 1);
}
