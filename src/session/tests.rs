//! The session's unit tests (CPU backend).

use super::*;
use lanes_adaptor::{Graph, GraphBuilder, GraphLimits, NodeId, Outlet};

fn graph() -> (Graph, Vec<NamedTensor>) {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([2, 3]));
    let w = g.variable("w", Tensor::full([3, 4], 0.5));
    let y = g.matmul(x, w);
    g.set_name(y, "y");
    let (graph, vars) = g.finish().unwrap();
    (
        graph,
        vars.into_iter()
            .map(|(n, t)| NamedTensor::new(n, t))
            .collect(),
    )
}

fn session() -> Session {
    Session::new(SessionId(1), SessionSpec::inference("t"))
}

#[test]
fn requests_before_load_are_no_graph() {
    let mut s = session();
    let e = s.run(vec![], &[]).unwrap_err();
    assert_eq!(e.code(), ErrorCode::NoGraph);
    assert_eq!(
        s.read_variables(&[]).unwrap_err().code(),
        ErrorCode::NoGraph
    );
    assert_eq!(
        s.write_variables(vec![]).unwrap_err().code(),
        ErrorCode::NoGraph
    );
    assert_eq!(s.iterations(), 0);
}

#[test]
fn load_checks_graph_and_variables() {
    let limits = GraphLimits::default();
    let (mut g, vars) = graph();
    g.nodes[2].inputs[1] = Outlet::new(NodeId(40), 0);
    let e = session().load(g, vars, &limits).unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidGraph);
    assert!(e.to_string().contains("matmul"), "{e}");

    let (g, _) = graph();
    let e = session().load(g, vec![], &limits).unwrap_err();
    assert!(
        matches!(&e, SessionError::Variable { name, .. } if name == "w"),
        "{e}"
    );

    let (g, _) = graph();
    let wrong = vec![NamedTensor::new("w", Tensor::full([4, 3], 0.5))];
    let e = session().load(g, wrong, &limits).unwrap_err();
    assert_eq!(e.code(), ErrorCode::BadVariable);

    let (g, mut vars) = graph();
    vars.push(NamedTensor::new("extra", Tensor::scalar(1.0)));
    assert_eq!(
        session().load(g, vars, &limits).unwrap_err().code(),
        ErrorCode::BadVariable
    );
}

#[test]
fn exec_errors_map_to_stable_codes() {
    let e = SessionError::Exec(ExecError::MissingFeed { name: "x".into() });
    assert_eq!(e.code(), ErrorCode::BadFeed);
    let e = SessionError::Exec(ExecError::Op {
        node: "n".into(),
        op: "relu",
        reason: "r".into(),
    });
    assert_eq!(e.code(), ErrorCode::Exec);
}

/// A CPU session over lanes that own 1 MiB, its graph loaded.
fn loaded_in_a_reservation() -> (SharedLanes, Session) {
    let lanes = SharedLanes::new(crate::lanes::LanesConfig::new(1 << 20)).unwrap();
    let mut s = session().with_lanes(Some(lanes.clone()));
    let (g, vars) = graph();
    s.load(g, vars, &GraphLimits::default()).unwrap();
    (lanes, s)
}

/// On the CPU with lanes that own memory, the job's variables live in
/// the reservation (the program keeps none of its own) and every path —
/// run, read, write, evict, return — works there.
#[test]
fn cpu_jobs_live_in_the_reservation() {
    let (lanes, mut s) = loaded_in_a_reservation();
    let x = || vec![NamedTensor::new("x", Tensor::full([2, 3], 1.0))];
    let y = s.run(x(), &["y".to_string()]).unwrap();
    assert_eq!(y[0].f32s().unwrap(), &[1.5; 8]);
    let program = &s.loaded.as_ref().unwrap().program;
    assert!(program.needs_memory());
    let Program::Cpu(cpu) = program else {
        panic!("a CPU program")
    };
    assert_eq!((cpu.own_persistent_bytes(), cpu.arena_bytes()), (0, 0));
    // w's twelve 0.5s are in the job's persistent region.
    let job = JobId(1);
    let held = lanes
        .with_persistent(job, |b| bytemuck::cast_slice::<u8, f32>(&b[..48]).to_vec())
        .unwrap();
    assert_eq!(held, vec![0.5; 12]);
    // Written and read where they live.
    s.write_variables(vec![NamedTensor::new("w", Tensor::full([3, 4], 2.0))])
        .unwrap();
    let w = s.read_variables(&["w".to_string()]).unwrap();
    assert_eq!(w[0].tensor.f32s().unwrap(), &[2.0; 12]);
    assert_eq!(
        s.run(x(), &["y".to_string()]).unwrap()[0].f32s().unwrap(),
        &[6.0; 8]
    );
    // Evicted: the memory goes back to the lanes; the next run returns.
    s.evict().unwrap();
    assert!(lanes.placement(job).is_none());
    assert_eq!(
        s.read_variables(&[]).unwrap()[0].tensor.f32s().unwrap(),
        &[2.0; 12]
    );
    assert_eq!(
        s.run(x(), &["y".to_string()]).unwrap()[0].f32s().unwrap(),
        &[6.0; 8]
    );
    assert!(lanes.placement(job).is_some());
    assert_eq!(s.switches(), (1, 1));
}

/// Evicting without waiting leaves a CPU job in place while its lane
/// runs an iteration, and evicts it once the lane is free.
#[test]
fn try_evict_never_waits_for_the_lane() {
    let (lanes, mut s) = loaded_in_a_reservation();
    let x = vec![NamedTensor::new("x", Tensor::full([2, 3], 1.0))];
    s.run(x, &["y".to_string()]).unwrap();
    let busy = lanes.turn(JobId(1)).unwrap();
    assert_eq!(s.try_evict().unwrap(), None);
    assert!(s.is_resident() && lanes.placement(JobId(1)).is_some());
    drop(busy);
    // The whole persistent buffer: P of the plan (w's 48 bytes, aligned).
    let (p, _) = s.memory().unwrap();
    assert_eq!(p, 256);
    assert_eq!(s.try_evict().unwrap(), Some(p));
    assert!(!s.is_resident() && lanes.placement(JobId(1)).is_none());
    assert_eq!(s.try_evict().unwrap(), Some(0));
}
