use super::*;
use lanes_adaptor::{validate, GraphBuilder, GraphLimits, Op, Tensor, TensorType};
use proptest::prelude::*;

fn valid(b: GraphBuilder) -> ValidGraph {
    let (g, _) = b.finish().unwrap();
    validate(g, &GraphLimits::default()).unwrap()
}

/// x[4,256] -> matmul w1 -> relu -> matmul w2 -> relu: every activation is
/// 4 KiB, and at most two are live at once.
fn mlp() -> (ValidGraph, Outlet) {
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", TensorType::f32([4, 256]));
    let w1 = b.variable("w1", Tensor::full([256, 256], 0.1));
    let h1 = b.matmul(x, w1);
    b.set_name(h1, "h1");
    let r1 = b.relu(h1);
    let w2 = b.variable("w2", Tensor::full([256, 256], 0.1));
    let h2 = b.matmul(r1, w2);
    let r2 = b.relu(h2);
    b.set_name(r2, "y");
    (valid(b), h1)
}

const ACT: u64 = 4 * 256 * 4;

#[test]
fn mlp_peak_is_two_activations() {
    let (g, _) = mlp();
    let p = plan(&g).unwrap();
    verify(&p).unwrap();
    assert_eq!(p.persistent, 2 * 256 * 256 * 4);
    assert_eq!(p.ephemeral, 2 * ACT);
    assert_eq!(p.lower_bound, 2 * ACT);
    assert_eq!(p.no_reuse, 5 * ACT);
    assert_eq!(p.tensors.len(), 5);
    assert_eq!(p.persistent_slots.len(), 2);
    let y = g.graph().resolve("y").unwrap();
    assert!(p.covers_fetch(y));
    assert_eq!(p.slot(y).unwrap().last, p.steps - 1);
}

#[test]
fn fetching_an_intermediate_extends_its_life() {
    let (g, h1) = mlp();
    let p = plan_with_fetches(&g, &["h1", "y"], PlanOptions::default()).unwrap();
    verify(&p).unwrap();
    // h1 now lives to the end: at the second matmul h1, r1 and h2 are live.
    assert_eq!(p.ephemeral, 3 * ACT);
    assert!(p.covers_fetch(h1));
    let d = plan(&g).unwrap();
    assert!(!d.covers_fetch(h1));
}

#[test]
fn unknown_fetch_and_bad_alignment_are_typed() {
    let (g, _) = mlp();
    assert_eq!(
        plan_with_fetches(&g, &["nope"], PlanOptions::default()).unwrap_err(),
        PlanError::UnknownFetch { key: "nope".into() }
    );
    assert_eq!(
        plan_with_fetches(
            &g,
            &["y"],
            PlanOptions {
                alignment: 3,
                views: true
            }
        )
        .unwrap_err(),
        PlanError::BadAlignment { alignment: 3 }
    );
}

#[test]
fn residual_block_peaks_at_three() {
    // x -> a = relu(x); b = relu(a); c = a + b: at the add, a, b and c are live.
    let mut bld = GraphBuilder::new();
    let x = bld.placeholder("x", TensorType::f32([1000]));
    let a = bld.relu(x);
    let b = bld.relu(a);
    let c = bld.add(a, b);
    let _ = bld.relu(c);
    let p = plan(&valid(bld)).unwrap();
    verify(&p).unwrap();
    let unit = 4096; // 4000 bytes rounded to 256
    assert_eq!(p.lower_bound, 3 * unit);
    assert_eq!(p.ephemeral, 3 * unit);
    assert_eq!(p.no_reuse, 5 * unit);
    assert_eq!(p.persistent, 0);
}

#[test]
fn training_step_counts_optimizer_state_as_persistent() {
    // loss = mse(x w, target); dw by hand; sgd with momentum updates w and buf.
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", TensorType::f32([8, 16]));
    let t = b.placeholder("t", TensorType::f32([8, 4]));
    let w = b.variable("w", Tensor::full([16, 4], 0.0));
    let buf = b.variable("w/momentum", Tensor::full([16, 4], 0.0));
    let y = b.matmul(x, w);
    let loss = b.mse_loss(y, t);
    b.set_name(loss, "loss");
    let d = b.sub(y, t);
    let dw = b.op1(
        Op::MatMul {
            transpose_a: true,
            transpose_b: false,
        },
        &[x, d],
    );
    b.op(
        Op::SgdUpdate {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
            nesterov: false,
        },
        &[w, dw, buf],
    );
    let g = valid(b);
    let p = plan(&g).unwrap();
    verify(&p).unwrap();
    assert_eq!(p.persistent, 2 * 256); // two 256-byte variables
                                       // The loss is a sink and lives to the end; the update has no outputs.
    let loss = g.graph().resolve("loss").unwrap();
    assert!(p.fetched.contains(&loss));
    assert!(p.ephemeral >= p.lower_bound);
    assert!(p.ephemeral <= p.no_reuse);
    assert_eq!(p.tensors.len(), 6); // x, t, y, loss, d, dw
}

#[test]
fn verify_rejects_corrupted_plans() {
    let (g, _) = mlp();
    let good = plan(&g).unwrap();
    // Two slots live at the same step put at the same offset.
    let mut bad = good.clone();
    let (i, j) = (0..bad.tensors.len())
        .flat_map(|i| (0..bad.tensors.len()).map(move |j| (i, j)))
        .find(|&(i, j)| {
            let (a, b) = (&bad.tensors[i], &bad.tensors[j]);
            i < j && a.first <= b.last && b.first <= a.last && a.offset != b.offset
        })
        .unwrap();
    bad.tensors[j].offset = bad.tensors[i].offset;
    assert!(matches!(verify(&bad), Err(VerifyError::Overlap { .. })));
    let mut bad = good.clone();
    bad.ephemeral -= 256;
    assert!(matches!(verify(&bad), Err(VerifyError::OutOfArena { .. })));
    let mut bad = good.clone();
    bad.tensors[0].offset += 4;
    assert!(verify(&bad).is_err());
    let mut bad = good.clone();
    bad.persistent_slots[1].offset = 0;
    assert!(matches!(
        verify(&bad),
        Err(VerifyError::PersistentOverlap { .. })
    ));
    let mut bad = good;
    bad.lower_bound += 1;
    assert!(matches!(verify(&bad), Err(VerifyError::Summary { .. })));
}

#[test]
fn plan_survives_serde_round_trip() {
    let (g, h1) = mlp();
    let p = plan(&g).unwrap();
    let json = serde_json::to_string(&p).unwrap();
    let back: MemoryPlan = serde_json::from_str(&json).unwrap();
    assert_eq!(back.slot(h1), p.slot(h1));
    verify(&back).unwrap();
}

/// A random DAG of elementwise ops and reshapes (to the same shape: still
/// `Op::Reshape`) over placeholders of three sizes.
fn random_graph(sizes: &[usize], ops: &[(u8, usize, usize)]) -> ValidGraph {
    let mut b = GraphBuilder::new();
    let mut outs: Vec<(Outlet, usize)> = Vec::new();
    for (i, &s) in sizes.iter().enumerate() {
        let dim = [7usize, 300, 2500][s % 3];
        outs.push((
            b.placeholder(&format!("in{i}"), TensorType::f32([dim])),
            dim,
        ));
    }
    for &(kind, x, y) in ops {
        let (a, da) = outs[x % outs.len()];
        let o = match kind % 5 {
            0 => b.relu(a),
            1 => b.tanh(a),
            2 => {
                let same: Vec<Outlet> = outs
                    .iter()
                    .filter(|(_, d)| *d == da)
                    .map(|(o, _)| *o)
                    .collect();
                let other = same[y % same.len()];
                b.add(a, other)
            }
            3 => b.scale(a, 0.5),
            _ => b.reshape(a, &[da]),
        };
        outs.push((o, da));
    }
    valid(b)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_graphs_plan_soundly(
        sizes in prop::collection::vec(0usize..3, 1..5),
        ops in prop::collection::vec((0u8..5, 0usize..1000, 0usize..1000), 1..60),
        fetch_every in 1usize..8,
    ) {
        let g = random_graph(&sizes, &ops);
        let p = plan(&g).unwrap();
        verify(&p).unwrap();
        prop_assert!(p.lower_bound <= p.ephemeral);
        prop_assert!(p.ephemeral <= p.no_reuse);
        // Independent peak: brute force over steps, an alias class counted
        // once, live from its first member's first step to its last
        // member's last.
        let live = |s: usize, root: Outlet| {
            p.tensors
                .iter()
                .any(|t| t.view_of.unwrap_or(t.outlet) == root && t.first <= s && s <= t.last)
        };
        let between = |s: usize, root: Outlet| {
            (0..=s).any(|k| live(k, root)) && (s..p.steps).any(|k| live(k, root))
        };
        let peak = (0..p.steps)
            .map(|s| {
                p.tensors
                    .iter()
                    .filter(|t| t.view_of.is_none() && between(s, t.outlet))
                    .map(|t| t.size)
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0);
        prop_assert_eq!(peak, p.lower_bound);
        // Views never make T or the bounds larger.
        let apart = plan_outlets(&g, sinks(&g), APART).unwrap();
        verify(&apart).unwrap();
        prop_assert_eq!(apart.views(), 0);
        prop_assert!(p.ephemeral <= apart.ephemeral);
        prop_assert!(p.lower_bound <= apart.lower_bound);
        prop_assert!(p.no_reuse <= apart.no_reuse);
        // Members of a class are reshapes of an ephemeral tensor, at its
        // offset.
        for t in &p.tensors {
            if let Some(root) = t.view_of {
                let is_reshape = matches!(g.graph().nodes[t.outlet.node.index()].op, Op::Reshape { .. });
                prop_assert!(is_reshape);
                prop_assert_eq!(p.slot(root).unwrap().offset, t.offset);
            }
        }
        // An explicit fetch set is planned soundly too.
        let keys: Vec<String> = g.graph().nodes.iter().step_by(fetch_every).map(|n| n.name.clone()).collect();
        let q = plan_with_fetches(&g, &keys, PlanOptions::default()).unwrap();
        verify(&q).unwrap();
        for k in &keys {
            let o = g.graph().resolve(k).unwrap();
            prop_assert!(q.covers_fetch(o));
        }
    }
}

/// conv → batch norm → Relu, beside a branch of the same size that lives
/// over the Relu: the Relu's output starts exactly where the
/// convolution's did (the layout the CUDA backend fuses), and T is still
/// the lower bound. (Plain best-fit happens to place this small graph so
/// too; `arena::tests::preferred_pairs_share_an_offset` has a case where it
/// does not.)
#[test]
fn chain_output_goes_over_its_head() {
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", TensorType::f32([2, 4, 6, 6]));
    let w = b.variable("w", Tensor::full([4, 4, 3, 3], 0.1));
    let attrs = lanes_adaptor::Conv2dAttrs {
        padding: [1, 1],
        ..Default::default()
    };
    let c = b.conv2d(x, w, None, attrs);
    let p: Vec<Outlet> = ["g", "b", "m", "v"]
        .iter()
        .map(|n| b.variable(n, Tensor::full([4], 1.0)))
        .collect();
    let side = b.relu(x);
    let n = b.batch_norm(c, p[0], p[1], p[2], p[3], 1e-5);
    let r = b.relu(n);
    let y = b.add(r, side);
    b.set_name(y, "y");
    let g = valid(b);
    let pl = plan(&g).unwrap();
    verify(&pl).unwrap();
    let at = |o: Outlet| pl.slot(o).unwrap().offset;
    assert_eq!(at(r), at(c));
    assert_ne!(at(n), at(c));
    assert_eq!(pl.ephemeral, pl.lower_bound);
}

/// Options without views: every reshape output has bytes of its own.
const APART: PlanOptions = PlanOptions {
    alignment: DEFAULT_ALIGNMENT,
    views: false,
};

/// x → a = relu(x) → b = reshape(a) → c = reshape(b) → d = relu(c), and a
/// long-lived side branch s = relu(x) read at the end.
fn reshape_chain() -> (ValidGraph, [Outlet; 4]) {
    let mut bld = GraphBuilder::new();
    let x = bld.placeholder("x", TensorType::f32([4, 250]));
    let a = bld.relu(x);
    let b = bld.reshape(a, &[1000]);
    let c = bld.reshape(b, &[10, 100]);
    let d = bld.relu(c);
    let s = bld.relu(x);
    let flat = bld.reshape(s, &[10, 100]);
    let y = bld.add(d, flat);
    bld.set_name(y, "y");
    (valid(bld), [a, b, c, d])
}

#[test]
fn a_reshape_chain_shares_one_offset() {
    let (g, [a, b, c, d]) = reshape_chain();
    let p = plan(&g).unwrap();
    verify(&p).unwrap();
    let at = |o: Outlet| p.slot(o).unwrap().offset;
    assert_eq!(at(b), at(a));
    assert_eq!(at(c), at(a));
    assert_eq!(p.slot(b).unwrap().view_of, Some(a));
    // A reshape of a reshape names the class's root, not its input.
    assert_eq!(p.slot(c).unwrap().view_of, Some(a));
    assert_eq!(p.slot(a).unwrap().view_of, None);
    assert!(p.is_view(c) && !p.is_view(a) && !p.is_view(d));
    // b, c and the side branch's reshape.
    assert_eq!(p.views(), 3);
    // Each member keeps its own lifetime.
    assert!(p.slot(a).unwrap().last < p.slot(c).unwrap().last);

    let q = plan_outlets(&g, sinks(&g), APART).unwrap();
    verify(&q).unwrap();
    assert_eq!(q.views(), 0);
    assert_ne!(q.slot(b).unwrap().offset, q.slot(a).unwrap().offset);
    let unit = 4096; // 4000 bytes rounded to 256
                     // Apart: 8 tensors; as classes: x, {a, b, c}, d, {s, flat}, y.
    assert_eq!(q.no_reuse, 8 * unit);
    assert_eq!(p.no_reuse, 5 * unit);
    assert!(p.lower_bound <= q.lower_bound && p.ephemeral <= q.ephemeral);
}

/// A tensor and its reshape both read late (a forward activation and its
/// flattened form, both kept for a backward pass): apart they take two
/// slots over the same steps, as one class one; T drops by a slot.
#[test]
fn a_class_read_late_saves_a_slot() {
    let mut bld = GraphBuilder::new();
    let x = bld.placeholder("x", TensorType::f32([4, 250]));
    let a = bld.relu(x);
    let b = bld.reshape(a, &[10, 100]);
    let d = bld.relu(b);
    let e = bld.relu(d);
    let y = bld.add(e, b);
    bld.set_name(y, "y");
    let z = bld.relu(a);
    bld.set_name(z, "z");
    let g = valid(bld);
    let p = plan(&g).unwrap();
    let q = plan_outlets(&g, sinks(&g), APART).unwrap();
    verify(&p).unwrap();
    verify(&q).unwrap();
    let unit = 4096;
    // Apart, at e: a, b, d, e; as classes: {a, b}, d, e.
    assert_eq!(q.lower_bound, 4 * unit);
    assert_eq!(p.lower_bound, 3 * unit);
    assert_eq!(p.ephemeral, 3 * unit);
    assert_eq!(q.ephemeral, 4 * unit);
}

/// A graph without reshapes plans as it did before views.
#[test]
fn without_reshapes_views_change_nothing() {
    // Nothing to alias: the same plan either way.
    let (g, _) = mlp();
    assert_eq!(
        plan(&g).unwrap().tensors,
        plan_outlets(&g, sinks(&g), APART).unwrap().tensors
    );
}

#[test]
fn a_reshape_of_a_variable_is_a_copy() {
    let mut bld = GraphBuilder::new();
    let w = bld.variable("w", Tensor::full([4, 64], 0.5));
    let r = bld.reshape(w, &[256]);
    let x = bld.placeholder("x", TensorType::f32([256]));
    let y = bld.add(r, x);
    bld.set_name(y, "y");
    let g = valid(bld);
    let p = plan(&g).unwrap();
    verify(&p).unwrap();
    assert_eq!(p.views(), 0);
    assert!(!p.is_view(r));
    assert!(p.slot(r).is_some());
    // A reshape of a feed is a view: the feed is in its slot before the
    // iteration starts.
    let mut bld = GraphBuilder::new();
    let x = bld.placeholder("x", TensorType::f32([4, 64]));
    let r = bld.reshape(x, &[256]);
    let y = bld.relu(r);
    bld.set_name(y, "y");
    let g = valid(bld);
    let p = plan(&g).unwrap();
    verify(&p).unwrap();
    assert_eq!(p.slot(r).unwrap().view_of, Some(x));
}

/// The class of a tensor that is reshaped, read again later and fetched
/// lives as long as its longest member: nothing else gets its bytes
/// before the end.
#[test]
fn a_fetched_reshape_keeps_its_class_alive() {
    let (g, [a, b, c, _]) = reshape_chain();
    let p = plan_with_fetches(
        &g,
        &["y", &g.graph().nodes[b.node.index()].name],
        PlanOptions::default(),
    )
    .unwrap();
    verify(&p).unwrap();
    assert!(p.covers_fetch(b));
    assert_eq!(p.slot(b).unwrap().last, p.steps - 1);
    let class = (p.slot(a).unwrap().offset, p.slot(a).unwrap().size);
    assert_eq!(p.slot(c).unwrap().offset, class.0);
    // Every tensor outside the class, live after a's producer, lies apart.
    let first = p.slot(a).unwrap().first;
    for t in &p.tensors {
        if [a, b, c].contains(&t.outlet) || t.last < first {
            continue;
        }
        assert!(
            t.offset + t.size <= class.0 || class.0 + class.1 <= t.offset,
            "{:?} overlaps the class",
            t.outlet
        );
    }
}

#[test]
fn verify_checks_alias_classes() {
    let (g, [a, b, c, d]) = reshape_chain();
    let good = plan(&g).unwrap();
    let pos = |o: Outlet| good.tensors.iter().position(|t| t.outlet == o).unwrap();
    // d is written at a step where only c of the class is live, and a is
    // dead: moved onto the class's bytes it is a real overlap.
    let mut bad = good.clone();
    assert!(bad.tensors[pos(a)].last < bad.tensors[pos(d)].first);
    bad.tensors[pos(d)].offset = bad.tensors[pos(a)].offset;
    assert!(matches!(verify(&bad), Err(VerifyError::Overlap { .. })));
    // A view off its root's offset.
    let mut bad = good.clone();
    bad.tensors[pos(c)].offset += 256;
    assert!(matches!(verify(&bad), Err(VerifyError::BadView { .. })));
    // A view of a view, or of nothing.
    let mut bad = good.clone();
    bad.tensors[pos(c)].view_of = Some(b);
    assert!(matches!(verify(&bad), Err(VerifyError::BadView { .. })));
    let mut bad = good.clone();
    bad.tensors[pos(c)].view_of = Some(Outlet::new(NodeId(999), 0));
    assert!(matches!(verify(&bad), Err(VerifyError::BadView { .. })));
    // Without the record the class's members are an overlap.
    let mut bad = good.clone();
    bad.tensors[pos(b)].view_of = None;
    assert!(matches!(verify(&bad), Err(VerifyError::Overlap { .. })));
    // The totals count a class once.
    let mut bad = good.clone();
    bad.no_reuse += bad.tensors[pos(b)].size;
    assert!(matches!(verify(&bad), Err(VerifyError::Summary { .. })));
}
