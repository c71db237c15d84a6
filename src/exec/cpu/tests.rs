//! The CPU executor's arena: T bytes of the memory plan, allocated once,
//! kept across iterations, never grown by fetches; programs in memory
//! handed in (a reservation's regions) as programs alone.

use std::collections::BTreeMap;

use lanes_adaptor::nn::{Mode, Nn};
use lanes_adaptor::zoo::Arch;
use lanes_adaptor::{
    training_graph, validate, GraphLimits, Op, Optimizer, Outlet, Tensor, TensorType, ValidGraph,
    VarValues,
};

use super::{program, run_op, CpuProgram};
use crate::compile;
use crate::exec::{DataMut, TensorMut};

fn lenet() -> Arch {
    Arch::LeNet {
        channels: 1,
        image: 28,
        classes: 10,
    }
}

/// Deterministic feeds: floats in [-1, 1), integers in [0, classes).
fn feeds(inputs: &[(String, TensorType)], seed: u64) -> BTreeMap<String, Tensor> {
    lanes_adaptor::zoo::seeded_feeds(inputs, seed, 10).unwrap()
}

/// Read-only kernel view of tensor `t` of type `ty`.
fn view<'a>(ty: &'a TensorType, t: &'a Tensor) -> crate::exec::TensorRef<'a> {
    crate::exec::TensorRef {
        ty,
        data: t.data().into(),
    }
}

/// The own buffer's address and capacity.
fn buffer(p: &CpuProgram) -> (usize, usize, usize) {
    let b = p.arena.buffer();
    (b.as_ptr() as usize, b.capacity(), b.len())
}

fn training() -> (
    ValidGraph,
    lanes_adaptor::VarValues,
    String,
    Vec<(String, TensorType)>,
) {
    let (t, inputs) = lenet()
        .training(4, 1, &Optimizer::sgd_momentum(0.1, 0.9, 1e-4))
        .unwrap();
    let v = validate(t.graph, &GraphLimits::default()).unwrap();
    (v, t.vars, t.loss, inputs)
}

#[test]
fn the_arena_is_the_planned_t() {
    let (v, vars, _, _) = training();
    let (_, _, loss, inputs) = training();
    let planned = compile::plan(&v).unwrap();
    let mut p = CpuProgram::new(v, vars).unwrap();
    assert!(planned.ephemeral > 0);
    assert_eq!(p.ephemeral_bytes(), planned.ephemeral);
    // Taken at the first iteration.
    assert_eq!(p.arena_bytes(), 0);
    p.run(&feeds(&inputs, 1), &[loss]).unwrap();
    assert_eq!(p.arena_bytes(), planned.ephemeral);
    // Below one buffer per tensor (what every iteration allocated before).
    assert!(planned.ephemeral < planned.no_reuse, "{planned}");

    let m = lenet().inference(2, 1).unwrap();
    let v = validate(m.graph, &GraphLimits::default()).unwrap();
    let planned = compile::plan(&v).unwrap();
    let mut p = CpuProgram::new(v, m.vars).unwrap();
    p.run(&feeds(&m.inputs, 1), &[m.output]).unwrap();
    assert_eq!(p.arena_bytes(), planned.ephemeral);
}

#[test]
fn iterations_reuse_the_arena() {
    let (v, vars, loss, inputs) = training();
    let mut p = CpuProgram::new(v, vars).unwrap();
    let mut first = None;
    let mut losses = Vec::new();
    let mut scratch = None;
    for k in 0..3 {
        let out = p
            .run(&feeds(&inputs, 7), std::slice::from_ref(&loss))
            .unwrap();
        let now = buffer(&p);
        assert_eq!(
            *first.get_or_insert(now),
            now,
            "iteration {k} moved or grew the arena"
        );
        // The old values of the updated variables: sized in the first
        // iteration, then kept.
        let s = p.arena.scratch();
        let now = (s.as_ptr() as usize, s.capacity());
        assert!(now.1 > 0);
        assert_eq!(*scratch.get_or_insert(now), now, "iteration {k}");
        losses.push(out[0].f32s().unwrap()[0]);
    }
    // The updates reached the variables: same batch, lower loss.
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(losses[2] < losses[0], "{losses:?}");
    // An eviction gives the arena up; the next run takes T again.
    p.evict().unwrap();
    assert_eq!(p.arena_bytes(), 0);
    p.run(&feeds(&inputs, 7), std::slice::from_ref(&loss))
        .unwrap();
    assert_eq!(p.arena_bytes(), p.ephemeral_bytes());
}

fn key(v: &ValidGraph, o: Outlet) -> String {
    format!("{}:{}", v.graph().nodes[o.node.index()].name, o.slot)
}

/// Fetching the inputs of the output node (which the plan lets die before
/// the end) neither re-plans nor grows the buffer; the fetched values
/// recompute the output exactly.
#[test]
fn fetched_intermediates_are_right() {
    let m = lenet().inference(2, 3).unwrap();
    let v = validate(m.graph, &GraphLimits::default()).unwrap();
    let sinks = compile::sinks(&v);
    let mut p = CpuProgram::new(v, m.vars).unwrap();
    let f = feeds(&m.inputs, 11);
    let alone = p
        .run(&f, std::slice::from_ref(&m.output))
        .unwrap()
        .remove(0);
    let planned = p.ephemeral_bytes();
    let at_first = buffer(&p);

    let graph = p.graph().clone();
    let g = graph.graph();
    let out = g.resolve(&m.output).unwrap();
    let node = &g.nodes[out.node.index()];
    let inner: Vec<Outlet> = node
        .inputs
        .iter()
        .copied()
        .filter(|o| !g.nodes[o.node.index()].op.is_source())
        .collect();
    assert!(!inner.is_empty());
    // The plan lets them die before the end of the iteration.
    assert!(inner.iter().all(|o| !sinks.contains(o)));
    let mut keys = vec![m.output.clone()];
    keys.extend(inner.iter().map(|o| key(&graph, *o)));
    // Fetched twice in one Run: two copies.
    keys.push(key(&graph, inner[0]));
    let got = p.run(&f, &keys).unwrap();
    assert_eq!(got[0], alone);
    assert_eq!(got[1], got[got.len() - 1]);
    assert_eq!(p.ephemeral_bytes(), planned);
    assert_eq!(buffer(&p), at_first);
    let again = p.run(&f, &keys).unwrap();
    assert_eq!(again, got);
    assert_eq!(buffer(&p), at_first);

    // Recompute the output node from the fetched inputs.
    let vars = p.read_variables(&[]).unwrap();
    let mut fetched = got[1..].iter();
    let held: Vec<Tensor> = node
        .inputs
        .iter()
        .map(|o| {
            let src = &g.nodes[o.node.index()];
            match &src.op {
                Op::Variable(_) => vars[&src.name].clone(),
                Op::Constant(t) => t.clone(),
                Op::Placeholder(_) => f[&src.name].clone(),
                _ => fetched.next().unwrap().clone(),
            }
        })
        .collect();
    let ins: Vec<_> = node
        .inputs
        .iter()
        .zip(&held)
        .map(|(o, t)| view(g.outlet_type(*o).unwrap(), t))
        .collect();
    let ty = &node.outputs[out.slot as usize];
    let mut outs: Vec<Tensor> = node.outputs.iter().map(Tensor::zeros).collect();
    let mut views: Vec<TensorMut<'_>> = node
        .outputs
        .iter()
        .zip(outs.iter_mut())
        .map(|(ty, t)| TensorMut {
            ty,
            data: DataMut::F32(t.f32s_mut().unwrap()),
        })
        .collect();
    run_op(&node.name, &node.op, &ins, &mut [], &mut views).unwrap();
    drop(views);
    assert_eq!(&outs[out.slot as usize].ty(), ty);
    assert_eq!(outs.swap_remove(out.slot as usize), alone);
}

/// Three AdamW steps of a small model with batch norm (running statistics
/// updated in place too): the variables written where they are give
/// exactly what copies written back give.
#[test]
fn in_place_updates_match_copies() {
    let build = || {
        let mut nn = Nn::new(4, Mode::Train);
        let x = nn.g.placeholder("x", TensorType::f32([4, 8]));
        let labels = nn.g.placeholder("labels", TensorType::i64([4]));
        let h = nn.linear("fc1", x, 16, true);
        let h = nn.batch_norm("bn", h, 1e-5, 0.1);
        let h = nn.g.relu(h);
        let y = nn.linear("fc2", h, 10, true);
        let loss = nn.g.cross_entropy(y, labels);
        nn.g.set_name(loss, "loss");
        let t = training_graph(nn.g, loss, &Optimizer::adamw(1e-2, 0.01)).unwrap();
        let v = validate(t.graph, &GraphLimits::default()).unwrap();
        CpuProgram::new(v, t.vars).unwrap()
    };
    let inputs = vec![
        ("x".to_string(), TensorType::f32([4, 8])),
        ("labels".to_string(), TensorType::i64([4])),
    ];
    let fetch = ["loss".to_string()];
    let steps = |p: &mut CpuProgram, cloned: bool| -> (Vec<Tensor>, VarValues) {
        program::FORCE_COPIED.set(cloned);
        let losses = (0..3)
            .map(|k| p.run(&feeds(&inputs, 20 + k), &fetch).unwrap().remove(0))
            .collect();
        program::FORCE_COPIED.set(false);
        (losses, p.read_variables(&[]).unwrap())
    };
    let (mut a, mut b) = (build(), build());
    let before = a.read_variables(&[]).unwrap();
    let (la, va) = steps(&mut a, false);
    let (lb, vb) = steps(&mut b, true);
    assert_eq!(la, lb);
    assert_eq!(va, vb);
    // The steps changed every variable: weights, moments, step counters and
    // the running statistics.
    assert_eq!(va.len(), before.len());
    let same: Vec<&String> = va.keys().filter(|k| va[*k] == before[*k]).collect();
    assert!(same.is_empty(), "unchanged: {same:?}");
    assert!(va.keys().any(|k| k.contains("running_mean")));
}

/// Programs in memory handed in (a reservation's regions, as a service
/// lends them each turn): a training and an inference program with their
/// own persistent regions and one shared arena of the larger T, the
/// regions moved between calls (as a relocation moves them), evicted and
/// brought back there: the same results and variables as alone.
#[test]
fn programs_in_memory_handed_in_match_programs_alone() {
    use super::CpuMemory;
    use crate::residency::Strategy;
    let (v, vars, loss, inputs) = training();
    let m = lenet().inference(2, 5).unwrap();
    let vi = validate(m.graph, &GraphLimits::default()).unwrap();
    let mut alone = (
        CpuProgram::new(v.clone(), vars.clone()).unwrap(),
        CpuProgram::new(vi.clone(), m.vars.clone()).unwrap(),
    );
    let mut given = (
        CpuProgram::new(v, vars).unwrap(),
        CpuProgram::new(vi, m.vars).unwrap(),
    );
    let words = |b: u64| (b as usize).div_ceil(8);
    let (pa, pb) = (
        words(given.0.persistent_buffer_bytes()),
        words(given.1.persistent_buffer_bytes()),
    );
    let t = words(given.0.ephemeral_bytes().max(given.1.ephemeral_bytes()));
    // The "reservation": [P of a | P of b | arena], and a second layout
    // with the regions elsewhere (a relocation copies them over).
    let mut mem = vec![0u64; pa + pb + t + 64];
    let fetch_a = std::slice::from_ref(&loss);
    let fetch_b = std::slice::from_ref(&m.output);
    let run = |p: &mut CpuProgram,
               mem: &mut [u64],
               at: usize,
               len: usize,
               arena_at: usize,
               f: &BTreeMap<String, Tensor>,
               fetch: &[String]| {
        let (head, arena) = mem.split_at_mut(arena_at);
        let m = CpuMemory {
            persistent: &mut head[at..at + len],
            arena: &mut arena[..t],
        };
        p.run_in(Some(m), f, fetch, Strategy::Pipelined).unwrap().0
    };
    for k in 0..4 {
        let fa = feeds(&inputs, 50 + k);
        let fb = feeds(&m.inputs, 60 + k);
        // Layout 0: a at 0, b at pa; from step 2 on: b at 0, a at pb
        // (moved as a relocation would, between calls).
        let (at_a, at_b) = if k < 2 { (0, pa) } else { (pb, 0) };
        if k == 2 {
            let old = mem[..pa + pb].to_vec();
            mem[pb..pb + pa].copy_from_slice(&old[..pa]);
            mem[..pb].copy_from_slice(&old[pa..pa + pb]);
        }
        let want_b = alone.1.run(&fb, fetch_b).unwrap();
        let got_b = run(&mut given.1, &mut mem, at_b, pb, pa + pb, &fb, fetch_b);
        assert_eq!(got_b, want_b, "step {k}");
        let want_a = alone.0.run(&fa, fetch_a).unwrap();
        let got_a = run(&mut given.0, &mut mem, at_a, pa, pa + pb, &fa, fetch_a);
        assert_eq!(got_a, want_a, "step {k}");
        assert!(given.0.is_given() && given.1.is_given());
        assert_eq!(
            (given.0.own_persistent_bytes(), given.0.arena_bytes()),
            (0, 0)
        );
        if k == 1 {
            // Evicted from the region and back into it, by groups.
            given.0.evict_in(Some(&mem[at_a..at_a + pa])).unwrap();
            assert!(!given.0.is_resident());
            mem[at_a..at_a + pa].fill(0);
        }
    }
    // Variables read and written where they live.
    let region = &mut mem[pb..pb + pa];
    let read = given.0.read_variables_in(Some(region), &[]).unwrap();
    assert_eq!(read, alone.0.read_variables(&[]).unwrap());
    let (name, t) = read.iter().next().unwrap();
    let zero = Tensor::zeros(&t.ty());
    let mut one = VarValues::new();
    one.insert(name.clone(), zero.clone());
    given.0.write_variables_in(Some(&mut *region), one).unwrap();
    let back = given
        .0
        .read_variables_in(Some(region), std::slice::from_ref(name))
        .unwrap();
    assert_eq!(back[name], zero);
    // Without the memory, a program living in it refuses rather than guess.
    assert!(given.0.run(&feeds(&inputs, 1), fetch_a).is_err());
    assert!(given.0.read_variables(&[]).is_err());
}

/// Reshapes of ephemeral tensors are views (`compile::views`): the program
/// copies nothing for them, and every member of a class, fetched, reads
/// the right values; a reshape of a variable stays a copy.
#[test]
fn reshape_views_read_their_inputs_bytes() {
    use lanes_adaptor::GraphBuilder;
    let mut b = GraphBuilder::new();
    let x = b.placeholder("x", TensorType::f32([2, 3, 4]));
    let r0 = b.reshape(x, &[6, 4]);
    let a = b.relu(r0);
    let flat = b.reshape(a, &[24]);
    let c = b.reshape(flat, &[4, 6]);
    let d = b.scale(c, 2.0);
    // a is read again after its reshapes.
    let e = b.relu(a);
    let d6 = b.reshape(d, &[6, 4]);
    let y = b.add(d6, e);
    let w = b.variable(
        "w",
        Tensor::from_f32(vec![4, 6], (0..24).map(|k| k as f32).collect()).unwrap(),
    );
    let rw = b.reshape(w, &[24]);
    let z = b.add(flat, rw);
    for (o, n) in [
        (r0, "r0"),
        (a, "a"),
        (flat, "flat"),
        (c, "c"),
        (d, "d"),
        (y, "y"),
        (z, "z"),
    ] {
        b.set_name(o, n);
    }
    let (g, vars) = b.finish().unwrap();
    let v = validate(g, &GraphLimits::default()).unwrap();
    let plan = compile::plan(&v).unwrap();
    compile::verify(&plan).unwrap();
    for o in [r0, flat, c, d6] {
        assert!(plan.is_view(o), "{o:?}");
    }
    assert!(!plan.is_view(rw));
    let at = |o: Outlet| plan.slot(o).unwrap().offset;
    assert_eq!(at(r0), at(x));
    assert_eq!((at(flat), at(c)), (at(a), at(a)));

    let xs: Vec<f32> = (0..24).map(|k| (k as f32 - 11.5) * 0.25).collect();
    let feeds = BTreeMap::from([(
        "x".to_string(),
        Tensor::from_f32(vec![2, 3, 4], xs.clone()).unwrap(),
    )]);
    let keys: Vec<String> = ["r0", "a", "flat", "c", "d", "y", "z"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut p = CpuProgram::new(v, vars).unwrap();
    for _ in 0..2 {
        let out = p.run(&feeds, &keys).unwrap();
        let relu: Vec<f32> = xs.iter().map(|&v| v.max(0.0)).collect();
        let twice: Vec<f32> = relu.iter().map(|&v| 2.0 * v).collect();
        let expect: [(Vec<usize>, Vec<f32>); 7] = [
            (vec![6, 4], xs.clone()),
            (vec![6, 4], relu.clone()),
            (vec![24], relu.clone()),
            (vec![4, 6], relu.clone()),
            (vec![4, 6], twice.clone()),
            (
                vec![6, 4],
                twice.iter().zip(&relu).map(|(t, r)| t + r).collect(),
            ),
            (
                vec![24],
                relu.iter().enumerate().map(|(k, r)| r + k as f32).collect(),
            ),
        ];
        for ((t, (dims, vals)), key) in out.iter().zip(expect).zip(&keys) {
            assert_eq!(t.shape().dims(), &dims[..], "{key}");
            assert_eq!(t.f32s().unwrap(), &vals[..], "{key}");
        }
    }
}
