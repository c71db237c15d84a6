//! Large feeds through shared memory, end to end: a client on the service's
//! host sends a Run's feeds in a sealed memfd segment instead of the socket;
//! the results are the socket path's, runs in flight each get their own
//! segment, a service that refuses segments is used over the socket, and
//! bad offers or Runs naming unknown segments get typed errors.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use lanes_adaptor::wire::shm::{OwnedSegment, SegmentOffer, TOKEN_BYTES};
use lanes_adaptor::wire::{self, NamedTensor, Reply, Request, SessionId};
use lanes_adaptor::{
    Client, ClientOptions, ErrorCode, Graph, GraphBuilder, SessionSpec, Tensor, TensorType,
    VarValues,
};
use util::*;

/// Rows of the feed: 65 536 × 8 f32 = 2 MiB, above the client's threshold.
const ROWS: usize = 1 << 16;
const COLS: usize = 8;
const OUTS: usize = 2;

/// `y = relu(x @ w + b)` with a large x.
fn wide(seed: u64) -> (Graph, VarValues) {
    let mut g = GraphBuilder::new();
    let x = g.placeholder("x", TensorType::f32([ROWS, COLS]));
    let w = g.variable(
        "w",
        Tensor::from_f32([COLS, OUTS], values(seed, COLS * OUTS)).unwrap(),
    );
    let b = g.variable(
        "b",
        Tensor::from_f32([OUTS], values(seed + 1, OUTS)).unwrap(),
    );
    let h = g.matmul(x, w);
    let h = g.add(h, b);
    let y = g.relu(h);
    g.set_name(y, "y");
    g.finish().unwrap()
}

fn wide_ref(x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
    dense_relu_ref(x, w, b, ROWS, COLS, OUTS)
}

/// Loads `wide(3)` into `session`; what its `y` is for `x_for(seed)`.
fn load_wide(session: &mut lanes_adaptor::Session<'_>) -> impl Fn(u64) -> Vec<f32> {
    let (graph, vars) = wide(3);
    let w = vars["w"].f32s().unwrap().to_vec();
    let b = vars["b"].f32s().unwrap().to_vec();
    session.load(&graph, vars).unwrap();
    move |seed: u64| wide_ref(x_for(seed).f32s().unwrap(), &w, &b)
}

fn x_for(seed: u64) -> Tensor {
    Tensor::from_f32([ROWS, COLS], values(seed, ROWS * COLS)).unwrap()
}

/// Runs `iters` iterations (two in flight at a time) and checks each.
fn run_checked(client: &mut Client, name: &str, iters: u64) {
    let mut session = client.open_session(SessionSpec::inference(name)).unwrap();
    let want = load_wide(&mut session);
    let out = session.run(vec![("x", x_for(100))], &["y"]).unwrap();
    assert_close(out[0].f32s().unwrap(), &want(100));
    let mut pending = session.submit_run(vec![("x", x_for(0))], &["y"]).unwrap();
    for i in 1..iters {
        let next = session.submit_run(vec![("x", x_for(i))], &["y"]).unwrap();
        let out = session.wait_run(pending).unwrap();
        assert_close(out[0].f32s().unwrap(), &want(i - 1));
        pending = next;
    }
    let out = session.wait_run(pending).unwrap();
    assert_close(out[0].f32s().unwrap(), &want(iters - 1));
    session.close().unwrap();
}

#[test]
fn large_feeds_through_shared_memory_give_the_socket_results() {
    let service = start();
    let mut shared = Client::connect(service.endpoint()).unwrap();
    assert!(shared.shares_memory(), "loopback endpoints share memory");
    run_checked(&mut shared, "shared", 5);
    assert!(
        shared.shares_memory(),
        "the service attached the segments (the client did not fall back)"
    );
    // Status (asked on another connection) shows the attached segment: a
    // 2 MiB feed and the header, in 2 MiB granules.
    {
        let mut s = shared
            .open_session(SessionSpec::inference("status"))
            .unwrap();
        let (graph, vars) = wide(5);
        s.load(&graph, vars).unwrap();
        s.run(vec![("x", x_for(1))], &["y"]).unwrap();
        let report = Client::connect(service.endpoint())
            .unwrap()
            .status()
            .unwrap();
        let row = report.sessions.iter().find(|r| r.session == s.id());
        assert_eq!(row.map(|r| r.shared_bytes), Some(4 << 20), "{report:?}");
        s.close().unwrap();
    }
    let mut socket = Client::connect_with(
        service.endpoint(),
        ClientOptions {
            shared_memory: false,
            ..ClientOptions::default()
        },
    )
    .unwrap();
    assert!(!socket.shares_memory());
    run_checked(&mut socket, "socket", 3);
}

#[test]
fn a_service_that_refuses_segments_is_used_over_the_socket() {
    let service = start_with(|c| c.shared_memory = false);
    let mut client = Client::connect(service.endpoint()).unwrap();
    run_checked(&mut client, "refused", 3);
    assert!(
        !client.shares_memory(),
        "the client fell back to the socket"
    );
}

fn offer_reply(peer: &RawPeer, id: u64, session: SessionId, offer: SegmentOffer) -> Reply {
    let req = Request::ShareMemory { session, offer };
    peer.call(wire::encode_request(id, &req).unwrap()).message
}

/// The desk the service names in its Hello reply.
fn desk_of(peer: &RawPeer) -> String {
    let hello = Request::Hello {
        client: "raw".into(),
    };
    match peer.call(wire::encode_request(3, &hello).unwrap()).message {
        Reply::Hello { desk, .. } => {
            desk.expect("a service that attaches shared memory names its desk")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_offers_and_unknown_segments_get_typed_errors() {
    let service = start();
    let peer = RawPeer::connect(service.endpoint());
    let session = peer.open_and_load(SessionSpec::inference("raw"), wide(3));
    let desk = desk_of(&peer);
    let mut seg = OwnedSegment::create(1, 4 << 20).unwrap();
    let good = seg.offer();
    // An offer whose descriptor was never handed over (whatever token it
    // names: the service opens no file a peer names), then one handed over
    // but offered as longer than it is.
    for (i, bad) in [
        SegmentOffer {
            token: [9; TOKEN_BYTES],
            ..good
        },
        good,
    ]
    .into_iter()
    .enumerate()
    {
        let r = offer_reply(&peer, 10 + i as u64, session, bad);
        assert_eq!(error_code(&r), ErrorCode::SharedMemory, "offer {i}: {r:?}");
    }
    seg.hand_over(&desk).unwrap();
    let longer = SegmentOffer {
        bytes: good.bytes * 2,
        ..good
    };
    let r = offer_reply(&peer, 12, session, longer);
    assert_eq!(error_code(&r), ErrorCode::SharedMemory, "{r:?}");
    // The descriptor went with that refused offer: hand it over again.
    seg.hand_over(&desk).unwrap();
    let r = offer_reply(&peer, 20, SessionId(session.0 + 100), good);
    assert_eq!(error_code(&r), ErrorCode::UnknownSession);
    // A Run naming a segment that was never attached.
    let run = Request::Run {
        session,
        feeds: vec![NamedTensor::new("x", x_for(1))],
        fetches: vec!["y".into()],
    };
    let frames = wire::encode_request_into(21, &run, Some(&mut seg)).unwrap();
    assert_eq!(
        error_code(&peer.call(frames).message),
        ErrorCode::SharedMemory
    );
    // Attached, the same Run works, and gives what the socket gives.
    assert!(matches!(
        offer_reply(&peer, 22, session, good),
        Reply::MemoryShared { segment: 1, .. }
    ));
    // A token attaches once: offered again (by anyone), nothing is found.
    assert_eq!(
        error_code(&offer_reply(&peer, 26, session, good)),
        ErrorCode::SharedMemory
    );
    let frames = wire::encode_request_into(23, &run, Some(&mut seg)).unwrap();
    let via_shared = match peer.call(frames).message {
        Reply::RunDone { outputs } => outputs,
        other => panic!("{other:?}"),
    };
    let via_socket = match peer.call(wire::encode_request(24, &run).unwrap()).message {
        Reply::RunDone { outputs } => outputs,
        other => panic!("{other:?}"),
    };
    assert_eq!(via_shared, via_socket);
    // Another connection cannot use this session's segment.
    let other = RawPeer::connect(service.endpoint());
    let frames = wire::encode_request_into(25, &run, Some(&mut seg)).unwrap();
    let r = other.call(frames).message;
    assert!(
        matches!(
            error_code(&r),
            ErrorCode::SharedMemory | ErrorCode::UnknownSession
        ),
        "{r:?}"
    );
}

/// Feed buffers: the job writes its input into the shared segment in place
/// and a Run sends only a header; the results are the socket path's, two
/// buffers may be in flight at once, and misuse gets typed errors.
#[test]
fn feed_buffers_written_in_place_give_the_socket_results() {
    use lanes_adaptor::ClientError;
    let service = start();
    let mut client = Client::connect(service.endpoint()).unwrap();
    let mut session = client
        .open_session(SessionSpec::inference("buffers"))
        .unwrap();
    let want = load_wide(&mut session);
    let ty = TensorType::f32([ROWS, COLS]);
    let mut a = session.feed_buffers(&[("x", ty.clone())]).unwrap();
    let mut b2 = session.feed_buffers(&[("x", ty.clone())]).unwrap();
    assert_eq!(a.feeds().collect::<Vec<_>>(), vec![("x", &ty)]);
    // Written in place, element by element.
    a.f32s_mut("x")
        .unwrap()
        .copy_from_slice(x_for(7).f32s().unwrap());
    let out = session.run_buffers(&mut a, &["y"]).unwrap();
    assert_close(out[0].f32s().unwrap(), &want(7));
    // Rewritten: the next Run sees the new values.
    a.write("x", &x_for(8)).unwrap();
    let out = session.run_buffers(&mut a, &["y"]).unwrap();
    assert_close(out[0].f32s().unwrap(), &want(8));
    // Two in flight, each from its own buffers, waited in either order.
    b2.write("x", &x_for(9)).unwrap();
    let pa = session.submit_run_buffers(&mut a, &["y"]).unwrap();
    let pb = session.submit_run_buffers(&mut b2, &["y"]).unwrap();
    let ob = session.wait_buffer_run(pb).unwrap();
    let oa = session.wait_buffer_run(pa).unwrap();
    assert_close(oa[0].f32s().unwrap(), &want(8));
    assert_close(ob[0].f32s().unwrap(), &want(9));
    // Same answer as the socket.
    let via_socket = session.run(vec![("x", x_for(9))], &["y"]).unwrap();
    assert_eq!(ob, via_socket);
    // Misuse: a feed they do not hold, the wrong dtype, a value of another
    // type, a placeholder listed twice.
    for e in [
        a.f32s_mut("nope").map(|_| ()).unwrap_err(),
        a.i64s_mut("x").map(|_| ()).unwrap_err(),
        a.write("x", &Tensor::full([2], 1.0)).unwrap_err(),
        session
            .feed_buffers(&[("x", ty.clone()), ("x", ty.clone())])
            .map(|_| ())
            .unwrap_err(),
    ] {
        assert!(matches!(e, ClientError::FeedBuffer { .. }), "{e}");
    }
    // Buffers whose types are not the graph's: the service's typed error.
    let mut wrong = session
        .feed_buffers(&[("x", TensorType::f32([ROWS, COLS + 1]))])
        .unwrap();
    let e = session.run_buffers(&mut wrong, &["y"]).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::BadFeed), "{e}");
    session.close().unwrap();
    // Buffers of one session are refused by another.
    let mut other = client
        .open_session(SessionSpec::inference("other"))
        .unwrap();
    let (graph, vars) = wide(3);
    other.load(&graph, vars).unwrap();
    let e = other.run_buffers(&mut a, &["y"]).unwrap_err();
    assert!(matches!(e, ClientError::FeedBuffer { .. }), "{e}");
    other.close().unwrap();
    // A service that attaches no shared memory: a clear error.
    let refusing = start_with(|c| c.shared_memory = false);
    let mut client = Client::connect(refusing.endpoint()).unwrap();
    let mut s = client
        .open_session(SessionSpec::inference("refused"))
        .unwrap();
    let e = s.feed_buffers(&[("x", ty)]).unwrap_err();
    assert!(matches!(e, ClientError::NoSharedMemory { .. }), "{e}");
}

/// A raw peer with a session of `wide(3)` named `name`, a 4 MiB segment
/// (id 1) attached to it, and the outputs of a Run (id 5) whose feed `x`
/// (`x_for(5)`) went into the segment at its header's end.
fn attached_with_a_run(
    service: &lanes::server::ServerHandle,
    name: &str,
) -> (RawPeer, SessionId, OwnedSegment, Vec<Tensor>) {
    let peer = RawPeer::connect(service.endpoint());
    let session = peer.open_and_load(SessionSpec::inference(name), wide(3));
    let desk = desk_of(&peer);
    let mut seg = OwnedSegment::create(1, 4 << 20).unwrap();
    seg.hand_over(&desk).unwrap();
    assert!(matches!(
        offer_reply(&peer, 4, session, seg.offer()),
        Reply::MemoryShared { segment: 1, .. }
    ));
    let run = Request::Run {
        session,
        feeds: vec![NamedTensor::new("x", x_for(5))],
        fetches: vec!["y".into()],
    };
    let frames = wire::encode_request_into(5, &run, Some(&mut seg)).unwrap();
    let want = match peer.call(frames).message {
        Reply::RunDone { outputs } => outputs,
        other => panic!("{other:?}"),
    };
    (peer, session, seg, want)
}

/// Reply slots: a shared Run may ask the service to write its outputs into
/// a slot of its segment; the socket reply then carries none, the slot
/// holds what the socket would have, a slot too small says how large one
/// must be (and the outputs come in the reply), and a slot that is not
/// one (overlapping a feed, outside the segment, in its header, not
/// aligned) is refused with a typed error before the Run runs.
#[test]
fn reply_slots_carry_the_outputs_or_say_what_they_need() {
    use lanes_adaptor::wire::shm::{REPLY_HEADER, SEGMENT_HEADER};
    use lanes_adaptor::wire::{SlotRange, SlotRead};
    let service = start();
    let (peer, session, seg, want) = attached_with_a_run(&service, "slots");
    let ty = TensorType::f32([ROWS, COLS]);
    let shared_run = |id: u64, reply: SlotRange| {
        let feeds = [("x", &ty, SEGMENT_HEADER as u64)];
        let frames = wire::encode_shared_run(
            id,
            session,
            feeds,
            1,
            wire::SharedAreas {
                reply: Some(reply),
                doorbell: None,
            },
            &["y".to_string()],
        )
        .unwrap();
        peer.call(frames).message
    };
    let limits = wire::Limits::default();
    let (at, bytes) = (3usize << 20, 1usize << 20);
    let slot = SlotRange {
        offset: at as u64,
        bytes: bytes as u64,
    };
    for id in [6, 7] {
        // Not answered before the Run.
        assert_eq!(
            seg.read_slot(at, bytes, id, &limits).unwrap(),
            SlotRead::NotYet
        );
        match shared_run(id, slot) {
            Reply::RunDone { outputs } => assert!(outputs.is_empty(), "{outputs:?}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            seg.read_slot(at, bytes, id, &limits).unwrap(),
            SlotRead::Here(want.clone()),
            "Run {id}"
        );
        // Found in place: ranges inside the slot, whose bytes are the
        // same outputs (what a Python view of the slot shows).
        match seg.find_in_slot(at, bytes, id, &limits).unwrap() {
            wire::SlotFind::Here(places) => {
                assert_eq!(places.len(), want.len());
                for ((ty, r), t) in places.iter().zip(&want) {
                    assert_eq!(*ty, t.ty());
                    assert!(r.start >= at && r.end <= at + bytes, "{r:?}");
                }
                assert_eq!(wire::slot_outputs(seg.bytes(), &places).unwrap(), want);
            }
            other => panic!("{other:?}"),
        }
    }
    // Too small: the outputs travel in the reply; the slot says how much
    // room they need (a table, then 512 KiB of values).
    let small = SlotRange {
        offset: at as u64,
        bytes: REPLY_HEADER as u64,
    };
    match shared_run(8, small) {
        Reply::RunDone { outputs } => assert_eq!(outputs, want),
        other => panic!("{other:?}"),
    }
    match seg.read_slot(at, REPLY_HEADER, 8, &limits).unwrap() {
        SlotRead::OnSocket { need } => {
            let values = (ROWS * OUTS * 4) as u64;
            assert!(need > values && need < values + 1024, "{need}");
        }
        other => panic!("{other:?}"),
    }
    // Not slots: each refused, and nothing is written.
    let feed_end = (SEGMENT_HEADER + ROWS * COLS * 4) as u64;
    for (i, (offset, bytes)) in [
        (feed_end - 64, 4096),  // overlaps the feed
        (0, 4096),              // the segment's header
        ((4 << 20) - 64, 4096), // past the end
        (at as u64 + 8, 4096),  // not aligned
        (at as u64, 16),        // shorter than a slot's header
        (u64::MAX - 63, 4096),  // overflows
    ]
    .into_iter()
    .enumerate()
    {
        let id = 20 + i as u64;
        let r = shared_run(id, SlotRange { offset, bytes });
        assert_eq!(error_code(&r), ErrorCode::SharedMemory, "slot {i}: {r:?}");
    }
    // The slot still answers Run 8: none of the refused Runs wrote it.
    assert!(matches!(
        seg.read_slot(at, REPLY_HEADER, 8, &limits).unwrap(),
        SlotRead::OnSocket { .. }
    ));
}

/// Feed buffers with reply slots through the client: busy-polling and
/// blocking clients get the socket path's outputs whether they come from
/// the slot or (slot too small, or none) from the reply, and a slot too
/// small tells how large one must be. A window of 1 µs is shorter than
/// every Run: after the first, each wait sleeps on the socket until most
/// of the last Run's time has passed (a Run that comes back sooner is
/// taken from the socket there) and then polls the slot.
#[test]
fn feed_buffers_take_their_outputs_from_the_reply_slot() {
    use lanes_adaptor::client::DEFAULT_REPLY_BYTES;
    let service = start();
    for busy in [
        std::time::Duration::ZERO,
        std::time::Duration::from_millis(50),
        std::time::Duration::from_micros(1),
    ] {
        let options = ClientOptions {
            busy_poll: busy,
            ..ClientOptions::default()
        };
        let mut client = Client::connect_with(service.endpoint(), options).unwrap();
        let mut session = client.open_session(SessionSpec::inference("slot")).unwrap();
        let want = load_wide(&mut session);
        let ty = TensorType::f32([ROWS, COLS]);
        let mut buffers = session.feed_buffers(&[("x", ty.clone())]).unwrap();
        assert_eq!(buffers.reply_bytes(), DEFAULT_REPLY_BYTES);
        for seed in 0..4 {
            buffers.write("x", &x_for(seed)).unwrap();
            let out = session.run_buffers(&mut buffers, &["y"]).unwrap();
            assert_close(out[0].f32s().unwrap(), &want(seed));
        }
        assert_eq!(buffers.reply_wanted(), None, "busy {busy:?}");
        // Two in flight from two buffers, waited for in reverse.
        let mut other = session.feed_buffers(&[("x", ty.clone())]).unwrap();
        other.write("x", &x_for(11)).unwrap();
        let pa = session.submit_run_buffers(&mut buffers, &["y"]).unwrap();
        let pb = session.submit_run_buffers(&mut other, &["y"]).unwrap();
        let ob = session.wait_buffer_run(pb).unwrap();
        let oa = session.wait_buffer_run(pa).unwrap();
        assert_close(oa[0].f32s().unwrap(), &want(3));
        assert_close(ob[0].f32s().unwrap(), &want(11));
        // A slot too small, and none: the outputs come in the reply.
        for reply in [4096, 0] {
            let mut small = session
                .feed_buffers_with_reply(&[("x", ty.clone())], reply)
                .unwrap();
            small.write("x", &x_for(12)).unwrap();
            let out = session.run_buffers(&mut small, &["y"]).unwrap();
            assert_close(out[0].f32s().unwrap(), &want(12));
            if reply == 0 {
                assert_eq!(small.reply_wanted(), None);
                continue;
            }
            let need = small.reply_wanted().expect("the slot says what it needs");
            assert!(need > ROWS * OUTS * 4, "{need}");
            // Made with that much, the slot holds them.
            let mut fits = session
                .feed_buffers_with_reply(&[("x", ty.clone())], need)
                .unwrap();
            fits.write("x", &x_for(13)).unwrap();
            let out = session.run_buffers(&mut fits, &["y"]).unwrap();
            assert_close(out[0].f32s().unwrap(), &want(13));
            assert_eq!(fits.reply_wanted(), None);
        }
        // Several outputs, one of them the 2 MiB feed fetched back: each
        // written in its place of the slot (on the GPU straight from the
        // device), in order.
        let mut both = session
            .feed_buffers_with_reply(&[("x", ty.clone())], 4 << 20)
            .unwrap();
        for seed in [15, 16] {
            both.write("x", &x_for(seed)).unwrap();
            let out = session.run_buffers(&mut both, &["y", "x"]).unwrap();
            assert_close(out[0].f32s().unwrap(), &want(seed));
            assert_eq!(out[1], x_for(seed));
            assert_eq!(both.reply_wanted(), None);
        }
        // Socket runs and errors still go through the same connection.
        let out = session.run(vec![("x", x_for(14))], &["y"]).unwrap();
        assert_close(out[0].f32s().unwrap(), &want(14));
        let e = session.run_buffers(&mut buffers, &["nope"]).unwrap_err();
        assert!(e.code().is_some(), "{e}");
        session.close().unwrap();
    }
}

/// Doorbells: a Run left in its feed buffers' doorbell is served from
/// there by a service that polls it, without the socket; garbage or
/// another id in a doorbell is ignored; and a Run that comes both ways is
/// served once (the copy seen second is dropped).
#[test]
fn doorbell_runs_are_served_once() {
    use lanes_adaptor::wire::shm::DOORBELL_HEADER;
    use lanes_adaptor::wire::{SharedAreas, SlotRange};
    let service = start_with(|c| c.busy_poll = std::time::Duration::from_millis(20));
    let (peer, session, mut seg, want) = attached_with_a_run(&service, "bell");
    let ty = TensorType::f32([ROWS, COLS]);
    let (bell_at, bell_len) = (3usize << 20, 4096usize);
    let encode = |id: u64| {
        let areas = SharedAreas {
            reply: None,
            doorbell: Some(SlotRange {
                offset: bell_at as u64,
                bytes: bell_len as u64,
            }),
        };
        let feeds = [("x", &ty, wire::shm::SEGMENT_HEADER as u64)];
        wire::encode_shared_run(id, session, feeds, 1, areas, &["y".to_string()]).unwrap()
    };
    let outputs = |r: wire::Envelope<Reply>| match r.message {
        Reply::RunDone { outputs } => (r.request_id, outputs),
        other => panic!("{other:?}"),
    };
    // Through the socket first: the service learns the doorbell.
    assert_eq!(outputs(peer.call(encode(6))), (6, want.clone()));
    // Rung only: served from the doorbell.
    let frames = encode(7);
    assert!(seg.ring(bell_at, bell_len, 7, &frames[0]));
    assert_eq!(outputs(peer.recv()), (7, want.clone()));
    // Rung and sent: one reply.
    let frames = encode(8);
    assert!(seg.ring(bell_at, bell_len, 8, &frames[0]));
    peer.send(frames);
    assert_eq!(outputs(peer.recv()), (8, want.clone()));
    // Garbage, and a Run under another id than the word's: ignored.
    assert!(seg.ring(bell_at, bell_len, 9, b"not a request"));
    let frames = encode(11);
    assert!(seg.ring(bell_at, bell_len, 10, &frames[0]));
    // A frame longer than the doorbell is not rung.
    assert!(!seg.ring(
        bell_at,
        bell_len,
        12,
        &vec![0; bell_len - DOORBELL_HEADER + 1]
    ));
    assert!(
        peer.recv_raw(std::time::Duration::from_millis(300))
            .is_none(),
        "nothing is answered for them"
    );
    // The service still serves the session, and answers 8 no second time.
    assert_eq!(outputs(peer.call(encode(13))), (13, want.clone()));
    // A copy through the socket of a Run already taken: dropped.
    let frames = encode(14);
    assert!(seg.ring(bell_at, bell_len, 14, &frames[0]));
    assert_eq!(outputs(peer.recv()), (14, want));
    peer.send(encode(14));
    assert!(peer
        .recv_raw(std::time::Duration::from_millis(300))
        .is_none());
    // A doorbell over the feed is refused.
    let areas = SharedAreas {
        reply: None,
        doorbell: Some(SlotRange {
            offset: 64,
            bytes: 4096,
        }),
    };
    let feeds = [("x", &ty, wire::shm::SEGMENT_HEADER as u64)];
    let frames = wire::encode_shared_run(15, session, feeds, 1, areas, &["y".to_string()]).unwrap();
    assert_eq!(
        error_code(&peer.call(frames).message),
        ErrorCode::SharedMemory
    );
}

/// A training job through a busy-polling client's feed buffers (each Run
/// rung in the doorbell and sent through the socket) trains exactly as the
/// same job through the socket alone: no iteration ran twice.
#[test]
fn a_training_job_through_doorbells_runs_each_iteration_once() {
    use lanes_adaptor::optim::{training_graph, Optimizer};
    const N: usize = 64;
    const ITERS: u64 = 25;
    let build = || {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([N, COLS]));
        let t = g.placeholder("t", TensorType::f32([N, OUTS]));
        let w = g.variable(
            "w",
            Tensor::from_f32([COLS, OUTS], values(7, COLS * OUTS)).unwrap(),
        );
        let y = g.matmul(x, w);
        let loss = g.mse_loss(y, t);
        training_graph(g, loss, &Optimizer::sgd(0.05)).unwrap()
    };
    let x = Tensor::from_f32([N, COLS], values(8, N * COLS)).unwrap();
    let t = Tensor::from_f32([N, OUTS], values(9, N * OUTS)).unwrap();
    let service = start_with(|c| c.busy_poll = std::time::Duration::from_millis(20));
    let train = |busy: bool| {
        let options = ClientOptions {
            busy_poll: if busy {
                std::time::Duration::from_millis(50)
            } else {
                std::time::Duration::ZERO
            },
            ..ClientOptions::default()
        };
        let mut client = Client::connect_with(service.endpoint(), options).unwrap();
        let tg = build();
        let mut s = client
            .open_session(SessionSpec::training(if busy { "bell" } else { "socket" }))
            .unwrap();
        s.load(&tg.graph, tg.vars.clone()).unwrap();
        let mut losses = Vec::new();
        if busy {
            let mut b = s.feed_buffers(&[("x", x.ty()), ("t", t.ty())]).unwrap();
            b.write("x", &x).unwrap();
            b.write("t", &t).unwrap();
            for _ in 0..ITERS {
                losses.push(s.run_buffers(&mut b, &[tg.loss.as_str()]).unwrap());
            }
        } else {
            for _ in 0..ITERS {
                let feeds = vec![("x", x.clone()), ("t", t.clone())];
                losses.push(s.run(feeds, &[tg.loss.as_str()]).unwrap());
            }
        }
        let w = s.read_variables(&["w"]).unwrap();
        let id = s.id();
        let status = Client::connect(service.endpoint())
            .unwrap()
            .status()
            .unwrap();
        let iterations = status
            .sessions
            .iter()
            .find(|e| e.session == id)
            .map(|e| e.iterations);
        (losses, w, iterations)
    };
    let (bell_losses, bell_w, bell_iters) = train(true);
    let (socket_losses, socket_w, socket_iters) = train(false);
    assert_eq!(bell_iters, Some(ITERS));
    assert_eq!(socket_iters, Some(ITERS));
    assert_eq!(bell_losses, socket_losses);
    assert_eq!(bell_w, socket_w);
}
