//! Structured fuzz of the service's request handling: well-formed but
//! hostile request sequences from two connections (sessions opened and
//! closed out of order, Runs on unknown or other connections' sessions,
//! bad graphs, bad feeds and fetches, forged shared-memory offers, answers
//! to challenges never sent, garbage)
//! against one real service through a real socket. Each request is checked
//! against a model of the session table: it is answered, with the reply or
//! the typed error the model expects; after each sequence the service's
//! session table matches the model, and once every session is closed the
//! lanes' memory is all free again.
//!
//! 10,000 sequences per run (`PROPTEST_CASES` overrides); the long run is
//! `handler_sequences_long` (ignored, 1,000,000 sequences).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::time::{Duration, Instant};

use lanes_adaptor::wire::auth::AUTH_BYTES;
use lanes_adaptor::wire::shm::{SegmentOffer, TOKEN_BYTES};
use lanes_adaptor::wire::{self, NamedTensor, Reply, Request, SessionId};
use lanes_adaptor::{ErrorCode, NodeId, Outlet, SessionSpec, Tensor, TensorType};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use util::*;

/// Sessions one connection may hold (small, so the limit is exercised).
const PER_CLIENT: usize = 3;

/// Which session a request names.
#[derive(Debug, Clone)]
enum Target {
    /// The n-th session the model knows of (open or closed, any peer).
    Known(usize),
    /// An id the service never gave out.
    Never(u64),
}

#[derive(Debug, Clone)]
enum GraphCase {
    Good,
    Dangling,
    WrongType,
    MissingVariable,
    ExtraVariable,
}

#[derive(Debug, Clone)]
enum FeedCase {
    Good,
    WrongShape,
    WrongDtype,
    Unknown,
    Twice,
    Missing,
}

#[derive(Debug, Clone)]
enum FetchCase {
    Good,
    Unknown,
    /// The output fetched this many times (beyond P + T when large).
    Repeated(usize),
}

#[derive(Debug, Clone)]
enum Op {
    Hello,
    Open {
        name_len: usize,
    },
    Close(Target),
    Load(Target, GraphCase),
    Run(Target, FeedCase, FetchCase),
    Read(Target, bool),
    Write(Target, bool),
    Offer(Target, [u8; TOKEN_BYTES]),
    /// An answer to a challenge this service never sent (it has no key).
    Authenticate([u8; AUTH_BYTES], [u8; AUTH_BYTES]),
    Status,
    Garbage(Vec<u8>),
}

fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        4 => (0usize..8).prop_map(Target::Known),
        1 => (1_000_000u64..u64::MAX).prop_map(Target::Never),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let graph = prop_oneof![
        4 => Just(GraphCase::Good),
        1 => Just(GraphCase::Dangling),
        1 => Just(GraphCase::WrongType),
        1 => Just(GraphCase::MissingVariable),
        1 => Just(GraphCase::ExtraVariable),
    ];
    let feed = prop_oneof![
        5 => Just(FeedCase::Good),
        1 => Just(FeedCase::WrongShape),
        1 => Just(FeedCase::WrongDtype),
        1 => Just(FeedCase::Unknown),
        1 => Just(FeedCase::Twice),
        1 => Just(FeedCase::Missing),
    ];
    let fetch = prop_oneof![
        5 => Just(FetchCase::Good),
        1 => Just(FetchCase::Unknown),
        1 => (1usize..4096).prop_map(FetchCase::Repeated),
    ];
    prop_oneof![
        1 => Just(Op::Hello),
        4 => prop_oneof![Just(0usize), 1usize..40, Just(300usize)]
            .prop_map(|name_len| Op::Open { name_len }),
        2 => target().prop_map(Op::Close),
        3 => (target(), graph).prop_map(|(t, g)| Op::Load(t, g)),
        4 => (target(), feed, fetch).prop_map(|(t, f, x)| Op::Run(t, f, x)),
        1 => (target(), any::<bool>()).prop_map(|(t, ok)| Op::Read(t, ok)),
        1 => (target(), any::<bool>()).prop_map(|(t, ok)| Op::Write(t, ok)),
        1 => (target(), any::<[u8; TOKEN_BYTES]>()).prop_map(|(t, k)| Op::Offer(t, k)),
        1 => (any::<[u8; AUTH_BYTES]>(), any::<[u8; AUTH_BYTES]>())
            .prop_map(|(n, p)| Op::Authenticate(n, p)),
        1 => Just(Op::Status),
        1 => proptest::collection::vec(any::<u8>(), 0..64).prop_map(Op::Garbage),
    ]
}

/// Requests from one of two connections.
fn sequence() -> impl Strategy<Value = Vec<(usize, Op)>> {
    proptest::collection::vec((0usize..2, op()), 1..10)
}

/// What the model knows of a session the service gave out.
#[derive(Debug, Clone)]
struct Known {
    id: SessionId,
    peer: usize,
    open: bool,
    loaded: bool,
    /// P + T once loaded.
    admitted: u64,
}

/// What a reply should be: a success of this name, or this error code.
#[derive(Debug, PartialEq)]
enum Expect {
    Ok(&'static str),
    Err(ErrorCode),
}

struct Model {
    known: Vec<Known>,
}

impl Model {
    fn resolve(&self, t: &Target) -> (SessionId, Option<usize>) {
        match t {
            Target::Known(i) if !self.known.is_empty() => {
                let i = i % self.known.len();
                (self.known[i].id, Some(i))
            }
            Target::Known(_) => (SessionId(u64::MAX - 1), None),
            Target::Never(id) => (SessionId(*id), None),
        }
    }

    /// The session `t` names if `peer` owns it open.
    fn owned(&self, peer: usize, t: &Target) -> (SessionId, Option<usize>) {
        let (id, i) = self.resolve(t);
        (
            id,
            i.filter(|&i| self.known[i].open && self.known[i].peer == peer),
        )
    }

    fn open_of(&self, peer: usize) -> usize {
        self.known
            .iter()
            .filter(|k| k.open && k.peer == peer)
            .count()
    }
}

fn graph_for(case: &GraphCase) -> (lanes_adaptor::Graph, Vec<NamedTensor>) {
    let (mut graph, mut vars) = linear_relu(3);
    match case {
        GraphCase::Good => {}
        GraphCase::Dangling => graph.nodes[3].inputs[0] = Outlet::new(NodeId(77), 0),
        GraphCase::WrongType => graph.nodes[5].outputs = vec![TensorType::f32([9, 9])],
        GraphCase::MissingVariable => {
            vars.remove("b");
        }
        GraphCase::ExtraVariable => {
            vars.insert("stranger".into(), Tensor::full([2], 1.0));
        }
    }
    let vars = vars
        .into_iter()
        .map(|(n, t)| NamedTensor::new(n, t))
        .collect();
    (graph, vars)
}

fn x() -> Tensor {
    Tensor::from_f32([BATCH, IN], values(1, BATCH * IN)).unwrap()
}

fn feeds_for(case: &FeedCase) -> Vec<NamedTensor> {
    match case {
        FeedCase::Good => vec![NamedTensor::new("x", x())],
        FeedCase::WrongShape => vec![NamedTensor::new("x", Tensor::full([BATCH, IN + 1], 0.5))],
        FeedCase::WrongDtype => vec![NamedTensor::new(
            "x",
            Tensor::from_i64([BATCH, IN], vec![1; BATCH * IN]).unwrap(),
        )],
        FeedCase::Unknown => vec![
            NamedTensor::new("x", x()),
            NamedTensor::new("z", Tensor::full([2], 1.0)),
        ],
        FeedCase::Twice => vec![NamedTensor::new("x", x()), NamedTensor::new("x", x())],
        FeedCase::Missing => Vec::new(),
    }
}

fn fetches_for(case: &FetchCase) -> Vec<String> {
    match case {
        FetchCase::Good => vec!["y".into()],
        FetchCase::Unknown => vec!["y".into(), "nope".into()],
        FetchCase::Repeated(n) => vec!["y".into(); *n],
    }
}

/// The bytes of `linear_relu`'s output `y`.
const Y_BYTES: u64 = (BATCH * OUT * 4) as u64;

/// Sends `op` from `peer`, checks the reply against the model and updates
/// the model.
fn step(
    peers: &[RawPeer; 2],
    model: &mut Model,
    id: u64,
    peer: usize,
    op: &Op,
) -> Result<(), TestCaseError> {
    let p = &peers[peer];
    let (req, expect): (Option<Request>, Expect) = match op {
        Op::Hello => (
            Some(Request::Hello {
                client: "fuzz".into(),
            }),
            Expect::Ok("hello"),
        ),
        Op::Status => (Some(Request::Status), Expect::Ok("status")),
        Op::Authenticate(nonce, proof) => (
            Some(Request::Authenticate {
                nonce: *nonce,
                proof: *proof,
            }),
            Expect::Err(ErrorCode::BadRequest),
        ),
        Op::Garbage(bytes) => {
            let mut frame = bytes.clone();
            if frame.first() == Some(&b'L') {
                frame[0] = b'X';
            }
            p.send(vec![frame]);
            let r = p.recv();
            prop_assert_eq!(error_code(&r.message), ErrorCode::Malformed);
            return Ok(());
        }
        Op::Open { name_len } => {
            let expect = if *name_len == 0 || *name_len > 256 {
                Expect::Err(ErrorCode::BadRequest)
            } else if model.open_of(peer) >= PER_CLIENT {
                Expect::Err(ErrorCode::Overloaded)
            } else {
                Expect::Ok("session_opened")
            };
            let spec = SessionSpec::inference("n".repeat(*name_len));
            (Some(Request::OpenSession(spec)), expect)
        }
        Op::Close(t) => {
            let (session, i) = model.owned(peer, t);
            let expect = match i {
                Some(_) => Expect::Ok("session_closed"),
                None => Expect::Err(ErrorCode::UnknownSession),
            };
            (Some(Request::CloseSession { session }), expect)
        }
        Op::Load(t, case) => {
            let (session, i) = model.owned(peer, t);
            let expect = match (i.map(|i| model.known[i].loaded), case) {
                (None, _) => Expect::Err(ErrorCode::UnknownSession),
                (Some(true), _) => Expect::Err(ErrorCode::GraphAlreadyLoaded),
                (Some(false), GraphCase::Good) => Expect::Ok("graph_loaded"),
                (Some(false), GraphCase::Dangling | GraphCase::WrongType) => {
                    Expect::Err(ErrorCode::InvalidGraph)
                }
                (Some(false), GraphCase::MissingVariable | GraphCase::ExtraVariable) => {
                    Expect::Err(ErrorCode::BadVariable)
                }
            };
            let (graph, variables) = graph_for(case);
            let req = Request::LoadGraph {
                session,
                graph,
                variables,
            };
            (Some(req), expect)
        }
        Op::Run(t, feed, fetch) => {
            let (session, i) = model.owned(peer, t);
            let expect = match i.map(|i| &model.known[i]) {
                None => Expect::Err(ErrorCode::UnknownSession),
                Some(k) if !k.loaded => Expect::Err(ErrorCode::NoGraph),
                Some(k) => match (feed, fetch) {
                    (FeedCase::Good, FetchCase::Good) => Expect::Ok("run_done"),
                    (FeedCase::Good, FetchCase::Unknown) => Expect::Err(ErrorCode::UnknownFetch),
                    (FeedCase::Good, FetchCase::Repeated(n)) => {
                        if *n as u64 * Y_BYTES > k.admitted {
                            Expect::Err(ErrorCode::FetchTooLarge)
                        } else {
                            Expect::Ok("run_done")
                        }
                    }
                    _ => Expect::Err(ErrorCode::BadFeed),
                },
            };
            let req = Request::Run {
                session,
                feeds: feeds_for(feed),
                fetches: fetches_for(fetch),
            };
            (Some(req), expect)
        }
        Op::Read(t, ok) => {
            let (session, i) = model.owned(peer, t);
            let expect = match (i.map(|i| model.known[i].loaded), ok) {
                (None, _) => Expect::Err(ErrorCode::UnknownSession),
                (Some(false), _) => Expect::Err(ErrorCode::NoGraph),
                (Some(true), true) => Expect::Ok("variables"),
                (Some(true), false) => Expect::Err(ErrorCode::BadVariable),
            };
            let names = if *ok {
                vec!["w".into()]
            } else {
                vec!["missing".into()]
            };
            (Some(Request::ReadVariables { session, names }), expect)
        }
        Op::Write(t, ok) => {
            let (session, i) = model.owned(peer, t);
            let expect = match (i.map(|i| model.known[i].loaded), ok) {
                (None, _) => Expect::Err(ErrorCode::UnknownSession),
                (Some(false), _) => Expect::Err(ErrorCode::NoGraph),
                (Some(true), true) => Expect::Ok("variables_written"),
                (Some(true), false) => Expect::Err(ErrorCode::BadVariable),
            };
            let value = if *ok {
                Tensor::full([OUT], 0.25)
            } else {
                Tensor::full([OUT + 1], 0.25)
            };
            let variables = vec![NamedTensor::new("b", value)];
            (Some(Request::WriteVariables { session, variables }), expect)
        }
        Op::Offer(t, token) => {
            let (session, i) = model.owned(peer, t);
            let expect = match i {
                None => Expect::Err(ErrorCode::UnknownSession),
                Some(_) => Expect::Err(ErrorCode::SharedMemory),
            };
            let offer = SegmentOffer {
                segment: 1,
                bytes: 4 << 20,
                token: *token,
            };
            (Some(Request::ShareMemory { session, offer }), expect)
        }
    };
    let Some(req) = req else { return Ok(()) };
    let r = p.call(wire::encode_request(id, &req).unwrap());
    prop_assert_eq!(r.request_id, id);
    let got = match &r.message {
        Reply::Error(e) => {
            prop_assert!(e.message.len() <= wire::MAX_ERROR_TEXT);
            Expect::Err(e.code)
        }
        other => Expect::Ok(other.name()),
    };
    prop_assert_eq!(
        &got,
        &expect,
        "{:?} from peer {}: {:?}",
        op,
        peer,
        r.message
    );
    match (&r.message, op) {
        (Reply::SessionOpened { session }, _) => model.known.push(Known {
            id: *session,
            peer,
            open: true,
            loaded: false,
            admitted: 0,
        }),
        (Reply::SessionClosed { session }, _) => {
            if let Some(k) = model.known.iter_mut().find(|k| k.id == *session) {
                k.open = false;
            }
        }
        (
            Reply::GraphLoaded {
                persistent_bytes,
                ephemeral_bytes,
                ..
            },
            Op::Load(t, _),
        ) => {
            let (_, i) = model.owned(peer, t);
            let k = &mut model.known[i.unwrap()];
            k.loaded = true;
            k.admitted = persistent_bytes + ephemeral_bytes;
        }
        (Reply::Status(s), _) => {
            let open = model.known.iter().filter(|k| k.open).count();
            prop_assert_eq!(s.sessions.len(), open);
        }
        (Reply::RunDone { outputs }, Op::Run(_, _, fetch)) => {
            prop_assert_eq!(outputs.len(), fetches_for(fetch).len());
        }
        _ => {}
    }
    Ok(())
}

/// The lanes' first status line: `reservation A, …; free B (…`, as (A, B).
fn reservation_and_free(lanes: &str) -> (String, String) {
    let first = lanes.lines().next().unwrap_or_default();
    let reservation = first
        .strip_prefix("reservation ")
        .and_then(|r| r.split(',').next())
        .unwrap_or_default()
        .to_string();
    let free = first
        .split("; free ")
        .nth(1)
        .and_then(|r| r.split(" (").next())
        .unwrap_or_default()
        .to_string();
    (reservation, free)
}

/// Closes what the model has open and checks the service is back to an
/// empty table with all its memory free.
fn close_all(peers: &[RawPeer; 2], model: &mut Model) -> Result<(), TestCaseError> {
    for k in model.known.iter_mut().filter(|k| k.open) {
        let req = Request::CloseSession { session: k.id };
        let r = peers[k.peer].call(wire::encode_request(1, &req).unwrap());
        prop_assert!(
            matches!(r.message, Reply::SessionClosed { .. }),
            "{:?}",
            r.message
        );
        k.open = false;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let r = peers[0].call(wire::encode_request(2, &Request::Status).unwrap());
        let Reply::Status(s) = r.message else {
            return Err(TestCaseError::fail(format!("{:?}", r.message)));
        };
        prop_assert!(s.sessions.is_empty(), "{:?}", s.sessions);
        let lanes = s.lanes.map(|l| *l).unwrap_or_default();
        let (reservation, free) = reservation_and_free(&lanes);
        prop_assert!(!reservation.is_empty(), "{}", lanes);
        if reservation == free {
            return Ok(());
        }
        // A closed session's running request may still hold its memory
        // for a moment.
        prop_assert!(
            Instant::now() < deadline,
            "memory not all free after every session closed:\n{}",
            lanes
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn run_sequences(cases: u32) {
    let service = start_with(|c| {
        c.memory_bytes = Some(64 << 20);
        c.max_sessions_per_client = Some(PER_CLIENT);
        c.idle_timeout = Duration::from_secs(600);
    });
    let peers = [
        RawPeer::connect(service.endpoint()),
        RawPeer::connect(service.endpoint()),
    ];
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let t0 = Instant::now();
    let requests = std::cell::Cell::new(0u64);
    let result = runner.run(&sequence(), |ops| {
        let mut model = Model { known: Vec::new() };
        for (i, (peer, op)) in ops.iter().enumerate() {
            step(&peers, &mut model, 100 + i as u64, *peer, op)?;
        }
        requests.set(requests.get() + ops.len() as u64);
        close_all(&peers, &mut model)
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    println!(
        "{cases} sequences, {} requests in {:.1} s",
        requests.get(),
        t0.elapsed().as_secs_f64()
    );
}

/// Cases per run: `PROPTEST_CASES`, else 10,000.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn handler_sequences() {
    run_sequences(cases(10_000));
}

#[test]
#[ignore = "long run: 1,000,000 sequences"]
fn handler_sequences_long() {
    run_sequences(cases(1_000_000));
}
