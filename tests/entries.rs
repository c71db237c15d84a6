//! Entries (`lanes_adaptor::Entry`): a training step's graph that also
//! holds the model's evaluation forward on the same variables. A Run that
//! fetches the entry's output runs only the entry: it reads the weights
//! and BatchNorm statistics as the last step left them, updates nothing,
//! needs none of the step's feeds, and leaves the training trajectory as
//! it was. On the CPU reference executor directly, and through a service
//! (`LANES_TEST_DEVICE=cuda`: on the GPU, against the CPU reference).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::collections::BTreeMap;

use lanes::exec::cpu::CpuProgram;
use lanes::exec::ExecError;
use lanes_adaptor::graph::{add_entry, validate, GraphBuilder, GraphLimits, Outlet};
use lanes_adaptor::{
    training_graph_grouped, Client, Optimizer, ParamGroup, SessionSpec, Tensor, TensorType,
    TrainOptions, TrainingGraph, VarValues,
};

const N: usize = 16;
const EVAL_N: usize = 5;
const PARAMS: [&str; 6] = ["w1", "b1", "gamma", "beta", "w2", "b2"];

fn init(n: usize, k: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * k).sin() * 0.3).collect()
}

/// x [n, 8] → linear 16 → BatchNorm → relu → linear 4: in training form
/// (batch statistics, running statistics updated in place) or in
/// evaluation form (the running statistics).
fn forward(g: &mut GraphBuilder, x: Outlet, v: &[Outlet; 8], training: bool) -> Outlet {
    let [w1, b1, gamma, beta, rm, rv, w2, b2] = *v;
    let h = g.matmul(x, w1);
    let h = g.add(h, b1);
    let h = if training {
        g.op(
            lanes_adaptor::Op::BatchNormTrain {
                eps: 1e-5,
                momentum: 0.1,
            },
            &[h, gamma, beta, rm, rv],
        )[0]
    } else {
        g.batch_norm(h, gamma, beta, rm, rv, 1e-5)
    };
    let h = g.relu(h);
    let o = g.matmul(h, w2);
    g.add(o, b2)
}

fn variables(g: &mut GraphBuilder) -> [Outlet; 8] {
    [
        g.variable("w1", Tensor::from_f32([8, 16], init(128, 0.77)).unwrap()),
        g.variable("b1", Tensor::from_f32([16], init(16, 1.3)).unwrap()),
        g.variable("gamma", Tensor::full([16], 1.0)),
        g.variable("beta", Tensor::full([16], 0.0)),
        g.variable("rm", Tensor::full([16], 0.0)),
        g.variable("rv", Tensor::full([16], 1.0)),
        g.variable("w2", Tensor::from_f32([16, 4], init(64, 0.41)).unwrap()),
        g.variable("b2", Tensor::from_f32([4], init(4, 2.1)).unwrap()),
    ]
}

/// The training step with SGD and momentum, and, with `entry`, the
/// evaluation forward of a batch of `EVAL_N` as the entry `eval`
/// (output `eval/out`).
fn training(entry: bool) -> TrainingGraph {
    training_at(N, entry)
}

fn training_at(n: usize, entry: bool) -> TrainingGraph {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([n, 8]));
    let y = g.placeholder("y", TensorType::i64([n]));
    let v = variables(&mut g);
    let o = forward(&mut g, x, &v, true);
    let l = g.cross_entropy(o, y);
    g.set_name(l, "loss");
    if entry {
        let z = g.placeholder("eval/x", TensorType::f32([EVAL_N, 8]));
        let e = forward(&mut g, z, &v, false);
        g.set_name(e, "eval/out");
        g.entry("eval", &[e]);
    }
    let opts = TrainOptions {
        groups: vec![ParamGroup {
            params: PARAMS.iter().map(|s| s.to_string()).collect(),
            optimizer: Optimizer::sgd_momentum(0.1, 0.9, 5e-4),
        }],
        ..TrainOptions::default()
    };
    training_graph_grouped(g, l, &opts).unwrap()
}

/// The evaluation forward alone, on `vars` (the reference).
fn evaluation(vars: &VarValues) -> CpuProgram {
    let mut g = GraphBuilder::new();
    let z = g.placeholder("eval/x", TensorType::f32([EVAL_N, 8]));
    let v = variables(&mut g);
    let e = forward(&mut g, z, &v, false);
    g.set_name(e, "eval/out");
    let (graph, mut init) = g.finish().unwrap();
    for (k, t) in init.iter_mut() {
        *t = vars[k].clone();
    }
    CpuProgram::new(validate(graph, &GraphLimits::default()).unwrap(), init).unwrap()
}

fn step_feeds(k: usize) -> BTreeMap<String, Tensor> {
    util::sine_batch(k, N)
}

fn eval_feeds(k: usize) -> BTreeMap<String, Tensor> {
    let z: Vec<f32> = (0..EVAL_N * 8)
        .map(|i| ((i + 57 * k) as f32 * 0.37).cos() * 1.5)
        .collect();
    BTreeMap::from([(
        "eval/x".to_string(),
        Tensor::from_f32([EVAL_N, 8], z).unwrap(),
    )])
}

fn model_vars() -> Vec<String> {
    let mut names: Vec<String> = PARAMS.iter().map(|s| s.to_string()).collect();
    names.extend(["rm".to_string(), "rv".to_string()]);
    names
}

fn bits(v: &VarValues) -> Vec<(String, Vec<u32>)> {
    v.iter()
        .map(|(k, t)| {
            let b = t.f32s().map(|x| x.iter().map(|f| f.to_bits()).collect());
            (k.clone(), b.unwrap_or_default())
        })
        .collect()
}

/// `got` is `want` bit for bit on the CPU backend; on the GPU each value is
/// within `rel` of its reference (relative to at least 1).
fn assert_matches(got: &[f32], want: &[f32], cuda: bool, rel: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(want) {
        if cuda {
            assert!((g - w).abs() <= rel * w.abs().max(1.0), "{what}: {g} {w}");
        } else {
            assert_eq!(g.to_bits(), w.to_bits(), "{what}: {g} {w}");
        }
    }
}

fn program(t: TrainingGraph) -> CpuProgram {
    CpuProgram::new(validate(t.graph, &GraphLimits::default()).unwrap(), t.vars).unwrap()
}

#[test]
fn an_entry_evaluates_the_current_weights_and_updates_nothing() {
    let mut with = program(training(true));
    let mut without = program(training(false));
    for k in 0..6 {
        let a = with.run(&step_feeds(k), &["loss".to_string()]).unwrap();
        let b = without.run(&step_feeds(k), &["loss".to_string()]).unwrap();
        // Evaluations between steps leave the trajectory as it was.
        assert_eq!(
            a[0].f32s().unwrap()[0].to_bits(),
            b[0].f32s().unwrap()[0].to_bits(),
            "step {k}"
        );
        let before = with.read_variables(&[]).unwrap();
        let e = with.run(&eval_feeds(k), &["eval/out".to_string()]).unwrap();
        let after = with.read_variables(&[]).unwrap();
        assert_eq!(bits(&before), bits(&after), "the entry updated a variable");
        // The running statistics moved, so the entry reads them as they are.
        let rm = after["rm"]
            .f32s()
            .unwrap()
            .iter()
            .map(|x| x.abs())
            .sum::<f32>();
        assert!(rm > 0.0);
        let reference = evaluation(&after)
            .run(&eval_feeds(k), &["eval/out".to_string()])
            .unwrap();
        assert_eq!(
            e[0].f32s().unwrap(),
            reference[0].f32s().unwrap(),
            "step {k}"
        );
    }
}

#[test]
fn a_run_fetches_from_one_part_and_feeds_only_what_it_runs() {
    let mut p = program(training(true));
    // The step needs no evaluation feed, the entry none of the step's.
    p.run(&step_feeds(0), &["loss".to_string()]).unwrap();
    p.run(&eval_feeds(0), &["eval/out".to_string()]).unwrap();
    // A variable may be fetched with the entry's output.
    let out = p
        .run(&eval_feeds(0), &["eval/out".to_string(), "w1".to_string()])
        .unwrap();
    assert_eq!(out[1].shape().dims(), &[8, 16]);
    let mut all = step_feeds(0);
    all.extend(eval_feeds(0));
    let mixed = p
        .run(&all, &["loss".to_string(), "eval/out".to_string()])
        .unwrap_err();
    match mixed {
        ExecError::FetchParts { reason } => {
            assert!(reason.contains("entry `eval`"), "{reason}")
        }
        other => panic!("{other}"),
    }
    let missing = p
        .run(&step_feeds(0), &["eval/out".to_string()])
        .unwrap_err();
    assert!(
        matches!(&missing, ExecError::MissingFeed { name } if name == "eval/x"),
        "{missing}"
    );
}

/// Through a service: steps and evaluations interleaved; each evaluation
/// matches the CPU reference forward of the weights read back, and changes
/// no variable; the losses match a session that never evaluates.
#[test]
fn a_service_session_runs_its_entry_between_steps() {
    let service = util::start();
    let mut client = Client::connect(service.endpoint()).unwrap();
    let mut with = client.open_session(SessionSpec::training("eval")).unwrap();
    let t = training(true);
    with.load(&t.graph, t.vars).unwrap();
    let mut client2 = Client::connect(service.endpoint()).unwrap();
    let mut without = client2
        .open_session(SessionSpec::training("plain"))
        .unwrap();
    let t = training(false);
    without.load(&t.graph, t.vars).unwrap();
    let cuda = util::device() != "cpu";
    let names = model_vars();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    for k in 0..6 {
        let a = with
            .run(step_feeds(k).into_iter().collect(), &["loss"])
            .unwrap();
        let b = without
            .run(step_feeds(k).into_iter().collect(), &["loss"])
            .unwrap();
        let (a, b) = (a[0].f32s().unwrap(), b[0].f32s().unwrap());
        assert_matches(a, b, cuda, 1e-5, &format!("loss of step {k}"));
        let before = with.read_variables(&names).unwrap();
        let e = with
            .run(eval_feeds(k).into_iter().collect(), &["eval/out"])
            .unwrap();
        let after = with.read_variables(&names).unwrap();
        assert_eq!(bits(&before), bits(&after), "the entry updated a variable");
        let reference = evaluation(&after)
            .run(&eval_feeds(k), &["eval/out".to_string()])
            .unwrap();
        // On the GPU, matrix products in another summation order (cuBLAS).
        let (got, want) = (e[0].f32s().unwrap(), reference[0].f32s().unwrap());
        assert_matches(got, want, cuda, 1e-4, &format!("evaluation after step {k}"));
    }
    let err = with
        .run(
            step_feeds(0).into_iter().chain(eval_feeds(0)).collect(),
            &["loss", "eval/out"],
        )
        .unwrap_err();
    assert!(err.to_string().contains("entry `eval`"), "{err}");
    // With only the entry's feeds, the fetches are the error, not a feed.
    let err = with
        .run(eval_feeds(0).into_iter().collect(), &["loss", "eval/out"])
        .unwrap_err();
    assert!(err.to_string().contains("entry `eval`"), "{err}");
    // Evaluations are not iterations: the scheduler's progress (SRTF's
    // remaining iterations) and the status count only the 6 steps.
    assert_eq!(iterations_of(service.endpoint(), "eval"), 6);
    assert_eq!(iterations_of(service.endpoint(), "plain"), 6);
    with.close().unwrap();
    without.close().unwrap();
}

/// The status's iteration count of the session named `name`.
fn iterations_of(endpoint: &str, name: &str) -> u64 {
    let status = Client::connect(endpoint).unwrap().status().unwrap();
    let s = status.sessions.iter().find(|s| s.spec.name == name);
    s.unwrap_or_else(|| panic!("no session {name}")).iterations
}

/// The step at batch 8 joined as the entry `batch8` (`add_entry`) trains
/// the same variables as the main step at 16: steps of both sizes in any
/// order give the losses and state of two programs whose state is copied
/// between them (the way without entries), bit for bit on the CPU backend
/// and within rounding on the GPU; the session holds one copy of the state.
#[test]
fn a_step_at_another_batch_size_as_an_entry_trains_the_same_variables() {
    let mut joined = training_at(N, false);
    let small = training_at(8, false);
    add_entry(
        &mut joined.graph,
        &mut joined.vars,
        small.graph,
        small.vars,
        "batch8",
        "batch8/",
        std::slice::from_ref(&small.loss),
    )
    .unwrap();
    let names: Vec<String> = joined.vars.keys().cloned().collect();
    assert_eq!(
        names.len(),
        training_at(N, false).vars.len(),
        "no second copy"
    );
    let service = util::start();
    let mut client = Client::connect(service.endpoint()).unwrap();
    let mut s = client
        .open_session(SessionSpec::training("joined"))
        .unwrap();
    s.load(&joined.graph, joined.vars).unwrap();
    let mut big = program(training_at(N, false));
    let mut little = program(training_at(8, false));
    let cuda = util::device() != "cpu";
    for (k, size) in [16, 16, 8, 16, 8, 8, 16].into_iter().enumerate() {
        let feeds = util::sine_batch(k, size);
        let got = if size == N {
            s.run(feeds.clone().into_iter().collect(), &["loss"])
                .unwrap()
        } else {
            let fed = feeds
                .clone()
                .into_iter()
                .map(|(name, t)| (format!("batch8/{name}"), t))
                .collect();
            s.run(fed, &["batch8/loss"]).unwrap()
        };
        // The reference: the state copied into the program of this size,
        // one step there, and back.
        let (from, to) = if size == N {
            (&mut little, &mut big)
        } else {
            (&mut big, &mut little)
        };
        to.write_variables(from.read_variables(&[]).unwrap())
            .unwrap();
        let want = to.run(&feeds, &["loss".to_string()]).unwrap();
        from.write_variables(to.read_variables(&[]).unwrap())
            .unwrap();
        let (g, w) = (got[0].f32s().unwrap(), want[0].f32s().unwrap());
        assert_matches(
            g,
            w,
            cuda,
            1e-4,
            &format!("loss of step {k} (batch {size})"),
        );
    }
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let got = s.read_variables(&refs).unwrap();
    let want = big.read_variables(&[]).unwrap();
    for name in &names {
        let (g, w) = (got[name].f32s().unwrap(), want[name].f32s().unwrap());
        assert_matches(g, w, cuda, 1e-3, name);
    }
    // A step at another size updates the variables: it is an iteration.
    assert_eq!(iterations_of(service.endpoint(), "joined"), 7);
    s.close().unwrap();
}
