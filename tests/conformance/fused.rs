//! Fused epilogues (`exec/cuda/fuse.rs`) against the CPU and against the
//! unfused kernels, and the matcher's chains on the planner's layout.

use super::*;

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
pub(crate) fn matched_on_plan(
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
            models::bert(2, 16, &small_bert()).unwrap(),
        ),
    ];
    let limits = large_limits();
    for (name, b) in built {
        let feeds = model_feeds(&b, 5);
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
