//! Many jobs, one small reservation: planner, lane manager and lane workers
//! together, with every tensor of every iteration living in the reservation
//! at the offsets the plan and the lanes gave it.
//!
//! Six MLP jobs of different sizes arrive at once on their own threads; the
//! reservation holds only the two largest side by side, so some must wait
//! in the admission queue. Each job, once admitted, writes its weights into
//! its persistent region (`SharedLanes::with_memory`) and runs iterations on
//! its lane's worker thread, each in its lane's turn, through the words the
//! turn lends (`LaneTurn::memory`): a small interpreter (matmul, add, relu)
//! reads and writes every tensor at `arena + slot offset` (ephemeral) or
//! `persistent region + slot offset` (weights), checks it stays inside its
//! lane, and compares the result with a reference computed in ordinary
//! vectors. Jobs leaving trigger re-partitioning, whose relocations move
//! live weights (held back while turns of the old layout run); later
//! iterations must still be exact.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use lanes::compile::{self, MemoryPlan};
use lanes::lanes::{
    Admission, JobId, JobMemory, LaneManager, LaneWorkers, LanesConfig, Placement, Reservation,
    SharedLanes,
};
use lanes_adaptor::{validate, GraphBuilder, GraphLimits, Op, Tensor, TensorType, ValidGraph};
use std::collections::HashMap;
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

const BATCH: usize = 8;
const IN: usize = 32;
const OUT: usize = 16;
const ITERS: usize = 4;

/// x[B, IN] -> matmul w1 -> + b1 -> relu -> matmul w2, plus a skip path
/// matmul(x, w3) added at the end (so x lives across the whole iteration)
/// -> y[B, OUT].
fn mlp(hidden: usize, seed: usize) -> (ValidGraph, HashMap<String, Vec<f32>>) {
    let mut b = GraphBuilder::new();
    let val = |n: usize, k: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 31 + k * 17 + seed * 7) % 23) as f32 - 11.0) / 16.0)
            .collect()
    };
    let x = b.placeholder("x", TensorType::f32([BATCH, IN]));
    let w1 = b.variable(
        "w1",
        Tensor::from_f32([IN, hidden], val(IN * hidden, 1)).unwrap(),
    );
    let b1 = b.variable("b1", Tensor::from_f32([hidden], val(hidden, 2)).unwrap());
    let w2 = b.variable(
        "w2",
        Tensor::from_f32([hidden, OUT], val(hidden * OUT, 3)).unwrap(),
    );
    let w3 = b.variable("w3", Tensor::from_f32([IN, OUT], val(IN * OUT, 4)).unwrap());
    let h = b.matmul(x, w1);
    let h = b.add(h, b1);
    let h = b.relu(h);
    let y = b.matmul(h, w2);
    let skip = b.matmul(x, w3);
    let y = b.add(y, skip);
    b.set_name(y, "y");
    let (g, vars) = b.finish().unwrap();
    let vals = vars
        .into_iter()
        .map(|(k, t)| (k, t.f32s().unwrap().to_vec()))
        .collect();
    (validate(g, &GraphLimits::default()).unwrap(), vals)
}

fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; m * n];
    for i in 0..m {
        for p in 0..k {
            let av = a[i * k + p];
            for j in 0..n {
                out[i * n + j] += av * b[p * n + j];
            }
        }
    }
    out
}

/// `add` with numpy broadcasting of a trailing vector, then `relu`, as the IR defines them.
fn add(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter()
        .enumerate()
        .map(|(i, &v)| v + b[i % b.len()])
        .collect()
}

fn relu(a: &[f32]) -> Vec<f32> {
    a.iter().map(|&v| v.max(0.0)).collect()
}

fn feed(job: usize, iter: usize) -> Vec<f32> {
    (0..BATCH * IN)
        .map(|i| ((i + job * 5 + iter * 3) % 13) as f32 / 8.0 - 0.75)
        .collect()
}

fn reference(vars: &HashMap<String, Vec<f32>>, hidden: usize, x: &[f32]) -> Vec<f32> {
    let h = matmul(x, &vars["w1"], BATCH, IN, hidden);
    let h = relu(&add(&h, &vars["b1"]));
    let y = matmul(&h, &vars["w2"], BATCH, hidden, OUT);
    add(&y, &matmul(x, &vars["w3"], BATCH, IN, OUT))
}

/// Byte range of a tensor in the reservation, checked against its region.
fn place(base: u64, offset: u64, bytes: u64, region: (u64, u64)) -> (u64, u64) {
    let start = base + offset;
    assert!(
        start >= region.0 && start + bytes <= region.1,
        "tensor [{start}, {}) outside its region [{}, {})",
        start + bytes,
        region.0,
        region.1
    );
    (start, bytes)
}

/// Memory addressed by absolute byte ranges of the reservation: the whole
/// reservation (loading weights), or one job's regions during its turn.
trait Bytes {
    fn bytes(&mut self, at: (u64, u64)) -> &mut [u8];
}

impl Bytes for Reservation {
    fn bytes(&mut self, at: (u64, u64)) -> &mut [u8] {
        self.region_mut(at.0, at.1).unwrap()
    }
}

impl Bytes for JobMemory<'_> {
    /// Only the job's persistent region and its lane's arena are there.
    fn bytes(&mut self, at: (u64, u64)) -> &mut [u8] {
        let pl = self.placement;
        let (words, base) = if at.0 >= pl.p_offset && at.0 + at.1 <= pl.p_offset + pl.p_bytes {
            (&mut *self.persistent, pl.p_offset)
        } else {
            (&mut *self.arena, pl.arena_offset)
        };
        let start = (at.0 - base) as usize;
        &mut bytemuck::cast_slice_mut::<u64, u8>(words)[start..start + at.1 as usize]
    }
}

fn read(mem: &mut impl Bytes, at: (u64, u64)) -> Vec<f32> {
    bytemuck::pod_collect_to_vec::<u8, f32>(mem.bytes(at))
}

fn write(mem: &mut impl Bytes, at: (u64, u64), v: &[f32]) {
    mem.bytes(at).copy_from_slice(bytemuck::cast_slice(v));
}

/// Where every output of `g` lives for a job placed at `pl`.
fn locate(plan: &MemoryPlan, pl: &Placement, node: usize) -> (u64, u64) {
    let id = lanes_adaptor::NodeId(node as u32);
    if let Some(s) = plan.persistent_slot(id) {
        return place(
            pl.p_offset,
            s.offset,
            s.bytes,
            (pl.p_offset, pl.p_offset + pl.p_bytes),
        );
    }
    let s = plan.slot(lanes_adaptor::Outlet::new(id, 0)).unwrap();
    let arena = (pl.arena_offset, pl.arena_offset + pl.arena_bytes);
    assert!(plan.ephemeral <= pl.arena_bytes, "arena smaller than T");
    place(pl.arena_offset, s.offset, s.bytes, arena)
}

/// One iteration in a job's turn, every tensor in its regions of the
/// reservation.
fn run_in_place(g: &ValidGraph, plan: &MemoryPlan, mem: &mut JobMemory<'_>, x: &[f32]) -> Vec<f32> {
    let placement = mem.placement;
    let pl = &placement;
    let graph = g.graph();
    let dims = |o: lanes_adaptor::Outlet| graph.outlet_type(o).unwrap().shape.dims().to_vec();
    for &id in g.order() {
        let node = &graph.nodes[id.index()];
        let at = |n: lanes_adaptor::NodeId| locate(plan, pl, n.index());
        let out = match &node.op {
            Op::Variable(_) => continue,
            Op::Placeholder(_) => x.to_vec(),
            Op::MatMul { .. } => {
                let (a, b) = (node.inputs[0], node.inputs[1]);
                let (da, db) = (dims(a), dims(b));
                matmul(
                    &read(mem, at(a.node)),
                    &read(mem, at(b.node)),
                    da[0],
                    da[1],
                    db[1],
                )
            }
            Op::Add => add(
                &read(mem, at(node.inputs[0].node)),
                &read(mem, at(node.inputs[1].node)),
            ),
            Op::Relu => relu(&read(mem, at(node.inputs[0].node))),
            other => panic!("the test interpreter has no {}", other.name()),
        };
        write(mem, at(id), &out);
    }
    let y = graph.resolve("y").unwrap();
    read(mem, locate(plan, pl, y.node.index()))
}

#[test]
fn more_jobs_than_fit_all_complete_exactly() {
    let hidden = [64usize, 256, 128, 512, 96, 384];
    let jobs: Vec<_> = hidden
        .iter()
        .enumerate()
        .map(|(i, &h)| (mlp(h, i), h))
        .collect();
    let plans: Vec<MemoryPlan> = jobs
        .iter()
        .map(|((g, _), _)| compile::plan(g).unwrap())
        .collect();
    for p in &plans {
        compile::verify(p).unwrap();
    }
    let mut needs: Vec<u64> = plans.iter().map(|p| p.persistent + p.ephemeral).collect();
    needs.sort_unstable();
    let capacity = needs[needs.len() - 1] + needs[needs.len() - 2];
    let cfg = LanesConfig {
        capacity,
        alignment: 256,
        max_lanes: 2,
    };
    // The whole set cannot be resident at once.
    assert!(needs.iter().sum::<u64>() > capacity);
    assert!(LaneManager::new(cfg).is_ok());
    let lanes = SharedLanes::new(cfg).unwrap();
    let workers = Arc::new(Mutex::new(LaneWorkers::new()));
    let start = Arc::new(Barrier::new(jobs.len()));
    // Every job asks for admission before any runs (admission does not
    // wait), so the ones that do not fit are queued whatever the threads'
    // timing: without it, a job could finish and release before the last
    // one asked, and none would wait.
    let asked = Arc::new(Barrier::new(jobs.len()));
    let waited = Arc::new(Mutex::new(Vec::new()));

    let handles: Vec<_> = jobs
        .into_iter()
        .zip(plans)
        .enumerate()
        .map(|(j, (((g, vars), h), plan))| {
            let (lanes, workers, start, asked, waited) = (
                lanes.clone(),
                workers.clone(),
                start.clone(),
                asked.clone(),
                waited.clone(),
            );
            std::thread::spawn(move || {
                let job = JobId(j as u64);
                let g = Arc::new(g);
                let plan = Arc::new(plan);
                start.wait();
                let (lease, adm) = lanes.admit_plan(job, &plan).unwrap();
                if let Admission::Queued { reason, .. } = adm {
                    waited.lock().unwrap().push((j, reason.to_string()));
                }
                asked.wait();
                let pl = lease
                    .wait(Duration::from_secs(120))
                    .expect("admitted in time");
                // Load: weights into the persistent region.
                lanes
                    .with_memory(job, |pl, mem| {
                        for (name, v) in &vars {
                            let id = g.graph().find(name).unwrap();
                            write(mem, locate(&plan, &pl, id.index()), v);
                        }
                    })
                    .unwrap();
                for it in 0..ITERS {
                    let x = feed(j, it);
                    let want = reference(&vars, h, &x);
                    let (lanes2, g2, plan2) = (lanes.clone(), g.clone(), plan.clone());
                    // In the job's turn: its lane runs one iteration at a
                    // time, other lanes alongside, relocations held back.
                    let rx = workers
                        .lock()
                        .unwrap()
                        .submit(pl.lane, move || {
                            let mut turn = lanes2.turn(job).expect("admitted");
                            let mut mem = turn.memory().expect("the lanes own memory");
                            run_in_place(&g2, &plan2, &mut mem, &x)
                        })
                        .unwrap();
                    let got = rx.recv_timeout(Duration::from_secs(60)).unwrap();
                    assert_eq!(got, want, "job {j} iteration {it}");
                    assert_eq!(lease.placement().unwrap().lane, pl.lane);
                }
                let released = lease.release().unwrap();
                (j, released.moves.len())
            })
        })
        .collect();
    let results: Vec<(usize, usize)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let moves: usize = results.iter().map(|r| r.1).sum();
    let mut done: Vec<usize> = results.iter().map(|r| r.0).collect();
    done.sort_unstable();
    assert_eq!(done, (0..hidden.len()).collect::<Vec<_>>());
    let waited = waited.lock().unwrap();
    assert!(!waited.is_empty(), "no job had to wait");
    for (_, reason) in waited.iter() {
        assert!(reason.contains("free after re-partitioning"), "{reason}");
    }
    println!(
        "{} of {} jobs waited; {moves} relocations on release",
        waited.len(),
        hidden.len()
    );
    let s = lanes.snapshot();
    assert!(s.lanes.is_empty() && s.queue.is_empty());
    assert_eq!(s.free, capacity);
}

#[test]
fn a_job_larger_than_the_reservation_is_refused_at_once() {
    let (g, _) = mlp(512, 0);
    let plan = compile::plan(&g).unwrap();
    let lanes = SharedLanes::new(LanesConfig {
        capacity: plan.persistent,
        alignment: 256,
        max_lanes: 2,
    })
    .unwrap();
    let e = lanes.admit_plan(JobId(1), &plan).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains(&(plan.persistent + plan.ephemeral).to_string()),
        "{msg}"
    );
    assert!(msg.contains(&plan.persistent.to_string()), "{msg}");
    assert!(lanes.snapshot().queue.is_empty());
}

// ---- through the service: ZeroMQ sockets, `lanes serve --memory` ----------

mod service {
    use super::*;
    use lanes::server::{self, ServerConfig, ServerHandle};
    use lanes_adaptor::wire::{NamedTensor, Reply, Request};
    use lanes_adaptor::{Client, ClientOptions, ErrorCode, SessionSpec};
    use std::time::Instant;

    fn serve(memory: u64) -> ServerHandle {
        serve_on(util::device(), memory)
    }

    fn serve_on(device: String, memory: u64) -> ServerHandle {
        server::start(ServerConfig {
            endpoint: "tcp://127.0.0.1:*".into(),
            workers: 2,
            memory_bytes: Some(memory),
            // `LANES_TEST_DEVICE=cuda`: a GPU-backed service.
            device,
            // Jobs wait for memory here; evicting idle ones to make room is
            // tested in tests/residency_e2e.rs.
            evict_idle: false,
            ..ServerConfig::default()
        })
        .unwrap()
    }

    fn client(endpoint: &str) -> Client {
        Client::connect_with(
            endpoint,
            ClientOptions {
                timeout: Duration::from_secs(60),
                name: "lanes_e2e".into(),
                ..ClientOptions::default()
            },
        )
        .unwrap()
    }

    fn graph_and_vars(
        hidden: usize,
        seed: usize,
    ) -> (
        lanes_adaptor::Graph,
        Vec<NamedTensor>,
        HashMap<String, Vec<f32>>,
    ) {
        let (g, vals) = mlp(hidden, seed);
        let named = vals
            .iter()
            .map(|(k, v)| {
                let shape = g
                    .graph()
                    .outlet_type(g.graph().resolve(k).unwrap())
                    .unwrap()
                    .shape
                    .clone();
                NamedTensor::new(k.clone(), Tensor::from_f32(shape, v.clone()).unwrap())
            })
            .collect();
        (g.into_graph(), named, vals)
    }

    /// Opens a session that stays open until closed by id.
    fn open(c: &mut Client, name: &str) -> lanes_adaptor::SessionId {
        match c
            .request(&Request::OpenSession(SessionSpec::inference(name)))
            .unwrap()
        {
            Reply::SessionOpened { session } => session,
            other => panic!("unexpected reply {other:?}"),
        }
    }

    #[test]
    fn a_job_larger_than_memory_is_refused_with_both_sizes() {
        // The CPU's lanes: 64 KiB is less than one GPU mapping granule.
        let srv = serve_on("cpu".into(), 64 << 10);
        let mut c = client(srv.endpoint());
        let (graph, variables, _) = graph_and_vars(512, 0);
        let sid = open(&mut c, "big");
        let e = c
            .request(&Request::LoadGraph {
                session: sid,
                graph,
                variables,
            })
            .unwrap_err();
        assert_eq!(e.code(), Some(ErrorCode::MemoryTooLarge), "{e}");
        assert!(e.to_string().contains(&(64u64 << 10).to_string()), "{e}");
        let st = c.status().unwrap();
        let lanes = st.lanes.expect("lanes in status");
        assert!(lanes.contains("reservation 64.00 KiB"), "{lanes}");
        assert!(lanes.contains("queue: empty"), "{lanes}");
    }

    /// More jobs than the reservation holds, through real sockets on the
    /// CPU backend: all complete with correct results, some waited.
    #[test]
    fn more_jobs_than_memory_all_complete_through_the_service() {
        let hidden = [64usize, 256, 128, 512, 96, 384];
        // (P, T) as the lanes count them on the test's device.
        let sizes: Vec<(u64, u64)> = hidden
            .iter()
            .enumerate()
            .map(|(i, &h)| server::admission_sizes(&util::device(), &mlp(h, i).0, false).unwrap())
            .collect();
        // One lane holding every job is the most compact placement (one
        // arena for all); memory one alignment unit short of it: not all
        // can be admitted at once, whatever the arrival order (on the GPU
        // T is mostly the shared workspaces, so "the two largest" would
        // let them all share one lane), yet each job fits alone.
        let sum_p: u64 = sizes.iter().map(|s| s.0).sum();
        let max_t = sizes.iter().map(|s| s.1).max().unwrap();
        let memory = sum_p + max_t - 256;
        assert!(sizes.iter().all(|(p, t)| p + t <= memory));
        let srv = serve(memory);
        let endpoint = srv.endpoint().to_string();
        let loaded = Arc::new(Barrier::new(hidden.len()));
        let handles: Vec<_> = hidden
            .iter()
            .enumerate()
            .map(|(j, &h)| {
                let (endpoint, loaded) = (endpoint.clone(), loaded.clone());
                std::thread::spawn(move || {
                    let mut c = client(&endpoint);
                    let (graph, variables, vals) = graph_and_vars(h, j);
                    let plan = compile::plan(&mlp(h, j).0).unwrap();
                    let sid = open(&mut c, &format!("mlp{j}"));
                    let reply = c
                        .request(&Request::LoadGraph {
                            session: sid,
                            graph,
                            variables,
                        })
                        .unwrap();
                    let Reply::GraphLoaded {
                        persistent_bytes,
                        ephemeral_bytes,
                        waiting,
                        ..
                    } = reply
                    else {
                        panic!("unexpected reply {reply:?}")
                    };
                    assert_eq!(persistent_bytes, plan.persistent);
                    if util::device() == "cpu" {
                        assert_eq!(ephemeral_bytes, plan.ephemeral);
                    } else {
                        // On the GPU T also holds the cuDNN/cuBLAS workspaces.
                        assert!(ephemeral_bytes > plan.ephemeral);
                    }
                    // Every job has loaded before any runs: the set cannot all be resident.
                    loaded.wait();
                    let t0 = Instant::now();
                    for it in 0..ITERS {
                        let x = feed(j, it);
                        let want = reference(&vals, h, &x);
                        let xt = Tensor::from_f32([BATCH, IN], x).unwrap();
                        let out = c.run_in(sid, vec![("x", xt)], &["y"]).unwrap();
                        let got = out[0].f32s().unwrap();
                        for (g, w) in got.iter().zip(&want) {
                            assert!(
                                (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                                "job {j}: {g} vs {w}"
                            );
                        }
                    }
                    c.close_in(sid).unwrap();
                    (waiting.is_some(), t0.elapsed())
                })
            })
            .collect();
        let results: Vec<(bool, Duration)> =
            handles.into_iter().map(|h| h.join().unwrap()).collect();
        let waited = results.iter().filter(|r| r.0).count();
        assert!(waited >= 1, "no job waited for memory");
        let mut c = client(&endpoint);
        let lanes = c.status().unwrap().lanes.unwrap();
        assert!(
            lanes.contains("0 lane(s)") && lanes.contains("queue: empty"),
            "{lanes}"
        );
        srv.shutdown().unwrap();
    }

    /// Jobs that wait for memory are admitted in the policy's order: under
    /// `priority` an inference job that queued after a training job gets
    /// the memory first when it frees up; under `fifo` the training job.
    #[test]
    fn waiting_jobs_are_admitted_in_the_policys_order() {
        use lanes::server::PolicyChoice;
        let hidden = 512;
        let (p, t) = server::admission_sizes(&util::device(), &mlp(hidden, 0).0, false).unwrap();
        for (policy, first) in [(PolicyChoice::Priority, 3u64), (PolicyChoice::Fifo, 2)] {
            // Room for one job only.
            let srv = server::start(ServerConfig {
                endpoint: "tcp://127.0.0.1:*".into(),
                workers: 2,
                memory_bytes: Some(p + t + p / 2),
                device: util::device(),
                evict_idle: false,
                policy,
                ..ServerConfig::default()
            })
            .unwrap();
            let mut c = client(srv.endpoint());
            let load = |c: &mut Client, spec: SessionSpec| {
                let sid = match c.request(&Request::OpenSession(spec)).unwrap() {
                    Reply::SessionOpened { session } => session,
                    other => panic!("unexpected reply {other:?}"),
                };
                let (graph, variables, _) = graph_and_vars(hidden, 0);
                match c
                    .request(&Request::LoadGraph {
                        session: sid,
                        graph,
                        variables,
                    })
                    .unwrap()
                {
                    Reply::GraphLoaded { waiting, .. } => (sid, waiting.is_some()),
                    other => panic!("unexpected reply {other:?}"),
                }
            };
            let (holder, waits) = load(&mut c, SessionSpec::training("holder"));
            assert!(!waits);
            let (training, waits) = load(&mut c, SessionSpec::training("training"));
            assert!(waits);
            let (inference, waits) = load(&mut c, SessionSpec::inference("inference"));
            assert!(waits);
            assert_eq!((training.0, inference.0), (2, 3));
            c.close_in(holder).unwrap();
            // The lanes now hold exactly one of the two.
            let t0 = Instant::now();
            let lanes = loop {
                let lanes = c.status().unwrap().lanes.unwrap();
                if lanes.contains("1 job(s)") || t0.elapsed() > Duration::from_secs(10) {
                    break lanes;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            let other = 5 - first;
            assert!(
                lanes.contains(&format!("job {first} "))
                    && lanes.contains("queue: 1 waiting")
                    && lanes.contains(&format!("      job {other}")),
                "{policy}: expected job {first} admitted, job {other} waiting:\n{lanes}"
            );
            srv.shutdown().unwrap();
        }
    }

    /// Fetching intermediates the memory plan lets die early: right values;
    /// on the CPU the job keeps the T it was admitted with (copies taken as
    /// the ops run), on the GPU the re-planned T is admitted again first
    /// (one eviction and return); a T that could never fit is refused with
    /// `MemoryTooLarge` and the job runs on as before.
    #[test]
    fn fetching_intermediates_keeps_the_admitted_memory() {
        let hidden = 512;
        let (valid, vals) = mlp(hidden, 3);
        let (p, t) = server::admission_sizes(&util::device(), &valid, false).unwrap();
        // The first matmul's and the relu's outputs: kept to the end, they
        // raise the peak of a GPU re-plan by one [B, hidden] tensor.
        let g = valid.graph();
        let name = |op: &str, nth: usize| {
            g.nodes
                .iter()
                .filter(|n| n.op.name() == op)
                .nth(nth)
                .map(|n| format!("{}:0", n.name))
                .unwrap()
        };
        let (h0, h2) = (name("matmul", 0), name("relu", 0));
        let run_all = |memory: u64| {
            let srv = serve(memory);
            let mut c = client(srv.endpoint());
            let (graph, variables, _) = graph_and_vars(hidden, 3);
            let sid = open(&mut c, "fetcher");
            c.request(&Request::LoadGraph {
                session: sid,
                graph,
                variables,
            })
            .unwrap();
            let x = feed(1, 0);
            let xt = || Tensor::from_f32([BATCH, IN], x.clone()).unwrap();
            let want = reference(&vals, hidden, &x);
            let y = c.run_in(sid, vec![("x", xt())], &["y"]).unwrap();
            assert_eq!(y[0].f32s().unwrap().len(), want.len());
            let got = c.run_in(sid, vec![("x", xt())], &["y", &h0, &h2]);
            let y2 = c.run_in(sid, vec![("x", xt())], &["y"]).unwrap();
            assert_eq!(y2, y);
            let st = c.status().unwrap();
            let me = st.sessions.iter().find(|s| s.session == sid).unwrap();
            let switched = (me.evictions, me.returns);
            srv.shutdown().unwrap();
            (got, y, want, x, switched)
        };
        let roomy = p + t + (4 << 20) + (64 << 20);
        let (got, y, want, x, switched) = run_all(roomy);
        let got = got.unwrap();
        for (a, b) in y[0].f32s().unwrap().iter().zip(&want) {
            assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
        }
        assert_eq!(got[0], y[0]);
        let pre = matmul(&x, &vals["w1"], BATCH, IN, hidden);
        let post = relu(&add(&pre, &vals["b1"]));
        for (fetched, want) in [(&got[1], &pre), (&got[2], &post)] {
            for (a, b) in fetched.f32s().unwrap().iter().zip(want) {
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
        if util::device() == "cpu" {
            assert_eq!(switched, (0, 0));
        } else {
            assert_eq!(switched, (1, 1));
            // Room for the T admitted at load, not for the re-planned one.
            let exact = (p + t).next_multiple_of(256);
            let (refused, _, _, _, switched) = run_all(exact);
            let e = refused.unwrap_err();
            assert_eq!(e.code(), Some(ErrorCode::MemoryTooLarge), "{e}");
            assert_eq!(switched, (0, 0));
        }
    }
}
