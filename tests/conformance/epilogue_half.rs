//! Half epilogue chains (`compile/chains/epilogue.rs`) on the GPU: a
//! convolution's batch norm with the casts around it, its residual Add and
//! Relu in fp16 and bf16 as one kernel (`fused_mixed_planes`,
//! `fused_mixed_flat`) give bit for bit what the unfused kernels give, and
//! what the CPU reference computes within the dtype's tolerance.

use super::*;
use lanes_adaptor::{amp, DType, Precision, TensorData, TensorType};

/// The chains [`net`] has on the planner's layout.
const NET_CHAINS: usize = 4;

/// What [`net`]'s runs fetch.
const FETCHES: [&str; 2] = ["y", "z"];

/// Spatial sizes: 10×10 and 9×9 run one block row per plane (four
/// elements at a time, then one), 4×4 and 5×5 the flat kernel (likewise).
const SIZES: [usize; 4] = [10, 9, 4, 5];

fn half_var(
    g: &mut GraphBuilder,
    rng: &mut StdRng,
    name: &str,
    dims: &[usize],
    dt: DType,
) -> Outlet {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-0.3..0.3)).collect();
    let data = TensorData::from_f32_rounded(dt, &v).unwrap();
    g.variable(name, Tensor::new(dims.to_vec(), data).unwrap())
}

/// A 3×3 convolution 8 → 8 (padding 1) in `dt`.
fn conv(
    g: &mut GraphBuilder,
    rng: &mut StdRng,
    x: Outlet,
    name: &str,
    bias: bool,
    dt: DType,
) -> Outlet {
    let w = half_var(g, rng, &format!("{name}.w"), &[8, 8, 3, 3], dt);
    let b = bias.then(|| half_var(g, rng, &format!("{name}.b"), &[8], dt));
    let attrs = Conv2dAttrs {
        padding: [1, 1],
        ..Default::default()
    };
    g.conv2d(x, w, b, attrs)
}

/// An f32 inference batch norm over 8 channels, its statistics seeded.
fn bn(g: &mut GraphBuilder, rng: &mut StdRng, x: Outlet, name: &str) -> Outlet {
    let mut v = |p: &str, lo: f32, hi: f32| {
        let t = rnd(rng, &[8], lo, hi);
        g.variable(&format!("{name}.{p}"), t)
    };
    let (ga, be, me, va) = (
        v("g", 0.5, 1.5),
        v("b", -0.5, 0.5),
        v("m", -0.2, 0.2),
        v("v", 0.5, 1.5),
    );
    g.batch_norm(x, ga, be, me, va, 1e-5)
}

/// x [2, 8, s, s] (f32, cast to `dt`) through four chains:
/// 1. as a model captured in half has it: conv → Cast f32 → BatchNorm →
///    Cast `dt` → Add x → Relu (`a`);
/// 2. as the `amp` pass writes it: conv(a) → Cast f32 → BatchNorm → Relu →
///    Cast `dt` (`b`);
/// 3. a biased half convolution: conv(b) + bias → Add a → Relu (`c`);
/// 4. an f32 residual: conv(c) → Cast f32 → BatchNorm → Add (c in f32) →
///    Relu, fetched as `y` (f32) and cast to `dt` for a last convolution
///    (the chain writes both), whose output is fetched as `z` (f32).
fn net(dt: DType, s: usize) -> (Graph, VarValues) {
    let mut rng = StdRng::seed_from_u64(77 + s as u64);
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([2, 8, s, s]));
    let xh = g.cast(x, dt);
    // 1.
    let c1 = conv(&mut g, &mut rng, xh, "c1", false, dt);
    let w1 = g.cast(c1, DType::F32);
    let n1 = bn(&mut g, &mut rng, w1, "bn1");
    let h1 = g.cast(n1, dt);
    let s1 = g.add(h1, xh);
    let a = g.relu(s1);
    // 2.
    let c2 = conv(&mut g, &mut rng, a, "c2", false, dt);
    let w2 = g.cast(c2, DType::F32);
    let n2 = bn(&mut g, &mut rng, w2, "bn2");
    let r2 = g.relu(n2);
    let b = g.cast(r2, dt);
    // 3.
    let c3 = conv(&mut g, &mut rng, b, "c3", true, dt);
    let s3 = g.add(a, c3);
    let c = g.relu(s3);
    // 4.
    let wide = g.cast(c, DType::F32);
    let c4 = conv(&mut g, &mut rng, c, "c4", false, dt);
    let w4 = g.cast(c4, DType::F32);
    let n4 = bn(&mut g, &mut rng, w4, "bn4");
    let s4 = g.add(n4, wide);
    let y = g.relu(s4);
    g.set_name(y, "y");
    let yh = g.cast(y, dt);
    let c5 = conv(&mut g, &mut rng, yh, "c5", false, dt);
    let z = g.cast(c5, DType::F32);
    g.set_name(z, "z");
    g.finish().unwrap()
}

fn unit(dt: DType) -> f32 {
    match dt {
        DType::BF16 => 1.0 / 128.0,
        DType::F16 => 1.0 / 1024.0,
        _ => 1e-5,
    }
}

/// Without a GPU: on the planner's layout the matcher finds the four
/// chains of [`net`] at every size, in both dtypes, casts included.
#[test]
fn half_epilogue_chains_match_on_the_planner_layout() {
    for dt in [DType::F16, DType::BF16] {
        for s in SIZES {
            let (graph, _) = net(dt, s);
            let vg = validate(graph, &GraphLimits::default()).unwrap();
            let f = matched_on_plan(&vg, &FETCHES.map(String::from));
            assert_eq!(f.chains.len(), NET_CHAINS, "{dt:?} {s}: {f:?}");
            // Every cast but the input's, the residual's widening and z's.
            let casts = f
                .chains
                .iter()
                .flat_map(|c| &c.nodes)
                .filter(|n| matches!(vg.graph().nodes[n.index()].op, Op::Cast { .. }))
                .count();
            assert_eq!(casts, 6, "{dt:?} {s}: {f:?}");
            assert!(f.chains[3].also.is_some(), "{dt:?} {s}: {f:?}");
        }
    }
}

/// On the GPU: fused and unfused programs agree bit for bit over
/// iterations launched op by op and replayed, the four chains fuse, and
/// the result is within the dtype's tolerance of the CPU's.
#[test]
#[ignore = "needs a GPU"]
fn half_epilogue_chains_change_no_result() {
    let mut failed = Vec::new();
    for dt in [DType::F16, DType::BF16] {
        for s in SIZES {
            let what = format!("{dt:?} {s}x{s}");
            let (graph, vars) = net(dt, s);
            let vg = validate(graph, &GraphLimits::default()).unwrap();
            let mut rng = StdRng::seed_from_u64(s as u64);
            let feeds: BTreeMap<String, Tensor> =
                [("x".to_string(), rnd(&mut rng, &[2, 8, s, s], -1.0, 1.0))].into();
            let fetches = FETCHES.map(String::from).to_vec();
            let mut fused =
                CudaProgram::with_options(vg.clone(), vars.clone(), exact(true)).unwrap();
            let mut plain =
                CudaProgram::with_options(vg.clone(), vars.clone(), exact(false)).unwrap();
            let mut cpu = CpuProgram::new(vg, vars).unwrap();
            let want = cpu.run(&feeds, &fetches).unwrap();
            // Five convolutions of 72 products each, each within the
            // convolution's tolerance, carried through the chains.
            let u = unit(dt);
            let tol = Tol {
                rtol: 16.0 * u,
                atol: 16.0 * u,
            };
            let r = (|| -> Result<f32, String> {
                let mut worst = 0f32;
                for it in 0..3 {
                    let a = fused.run(&feeds, &fetches).map_err(|e| e.to_string())?;
                    let b = plain.run(&feeds, &fetches).map_err(|e| e.to_string())?;
                    if a != b {
                        return Err(format!("iteration {it}: fused differs from unfused"));
                    }
                    for (k, key) in FETCHES.iter().enumerate() {
                        let what = format!("iteration {it}: {key}");
                        worst = worst.max(compare(&what, &want[k], &a[k], tol)?);
                    }
                }
                let (chains, skipped) = fused.fused_chains();
                if chains != NET_CHAINS || plain.fused_chains().0 != 0 {
                    return Err(format!("{chains} chains ({skipped} nodes skipped)"));
                }
                Ok(worst)
            })();
            match r {
                Ok(w) => println!("ok   {what:<16} worst {w:.3} of tolerance"),
                Err(e) => {
                    println!("FAIL {what:<16} {e}");
                    failed.push(what);
                }
            }
        }
    }
    assert!(failed.is_empty(), "failed: {failed:?}");
}

/// ResNet-50 (batch 2, 64×64) served in fp16 and bf16 (the `amp` pass, half
/// weights): fused and unfused agree bit for bit, every batch norm is in a
/// chain, and the output is near the CPU's (50 layers of half rounding:
/// within 5% of the output's largest magnitude for fp16, 10% for bf16).
#[test]
#[ignore = "needs a GPU"]
fn resnet50_half_fused_matches_unfused() {
    for p in [Precision::F16, Precision::Bf16] {
        let b = models::resnet(&[3, 4, 6, 3], 2, 64).unwrap();
        let (graph, vars) = amp::apply(b.graph, b.vars, p).unwrap();
        let vg = validate(graph, &large_limits()).unwrap();
        let bns = vg
            .graph()
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::BatchNorm { .. }))
            .count();
        let mut rng = StdRng::seed_from_u64(5);
        let feeds: BTreeMap<String, Tensor> = b
            .inputs
            .iter()
            .map(|(n, ty)| (n.clone(), rnd(&mut rng, ty.shape.dims(), -1.0, 1.0)))
            .collect();
        let fetches = vec![b.output.clone()];
        let mut fused = CudaProgram::with_options(vg.clone(), vars.clone(), exact(true)).unwrap();
        let mut plain = CudaProgram::with_options(vg.clone(), vars.clone(), exact(false)).unwrap();
        for it in 0..3 {
            let a = fused.run(&feeds, &fetches).unwrap();
            let u = plain.run(&feeds, &fetches).unwrap();
            assert!(
                a == u,
                "resnet50 {p}, iteration {it}: fused differs from unfused"
            );
        }
        let (chains, skipped) = fused.fused_chains();
        println!("resnet50 {p}: {chains} chains, {skipped} nodes skipped, {bns} batch norms");
        assert!(
            chains >= bns,
            "resnet50 {p}: {chains} chains for {bns} batch norms"
        );
        let got = fused.run(&feeds, &fetches).unwrap();
        let mut cpu = CpuProgram::new(vg, vars).unwrap();
        let want = cpu.run(&feeds, &fetches).unwrap();
        let top = want[0]
            .f32s()
            .unwrap()
            .iter()
            .fold(0f32, |m, v| m.max(v.abs()));
        let frac = if p == Precision::F16 { 0.05 } else { 0.1 };
        let tol = Tol {
            rtol: frac,
            atol: frac * top,
        };
        let w = compare(&format!("resnet50 {p} vs cpu"), &want[0], &got[0], tol).unwrap();
        println!("ok   resnet50 {p}: worst {w:.3} of tolerance (largest |y| {top})");
    }
}
