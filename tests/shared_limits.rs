//! What one client's shared memory may cost the service: doorbells
//! bounded in size (announced at Hello, a larger one refused, never read)
//! and in work (garbage rings copy nothing and close the connection's
//! doorbells after a bound, counted through the service's metrics), and
//! the address space of segments' mappings capped per connection and in
//! all (refused with a typed error while other clients keep working).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod util;

use std::sync::Arc;
use std::time::{Duration, Instant};

use lanes::server::metrics::Metrics;
use lanes_adaptor::wire::shm::{OwnedSegment, DOORBELL_HEADER, SEGMENT_HEADER};
use lanes_adaptor::wire::{self, Reply, Request, SessionId, SharedAreas, SlotRange};
use lanes_adaptor::{Client, ErrorCode, SessionSpec, Tensor, TensorType};
use util::*;

/// The value of the metric line that starts with `series` (0 if absent).
fn metric(m: &Metrics, series: &str) -> u64 {
    let text = m.encode().unwrap();
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .map_or(0, |v| v.parse::<f64>().unwrap() as u64)
}

const GARBAGE: &str = "lanes_doorbell_rings_total{outcome=\"Garbage\"}";
const TAKEN: &str = "lanes_doorbell_rings_total{outcome=\"Taken\"}";
const COPIED: &str = "lanes_doorbell_copied_bytes_total";
const CLOSED: &str = "lanes_doorbells_closed_total";

/// Waits until `f` holds (at most 10 s).
fn until(what: &str, f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(10), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn offer(peer: &RawPeer, id: u64, session: SessionId, seg: &OwnedSegment) -> Reply {
    seg.hand_over(&desk_of(peer)).unwrap();
    let req = Request::ShareMemory {
        session,
        offer: seg.offer(),
    };
    peer.call(wire::encode_request(id, &req).unwrap()).message
}

fn desk_of(peer: &RawPeer) -> String {
    let hello = Request::Hello {
        client: "raw".into(),
    };
    match peer.call(wire::encode_request(3, &hello).unwrap()).message {
        Reply::Hello { desk, .. } => desk.expect("a desk"),
        other => panic!("{other:?}"),
    }
}

/// A raw peer with a `linear_relu` session and a 4 MiB segment (id 1)
/// attached; the doorbell is 4 KiB at 1 MiB.
struct Ringer {
    peer: RawPeer,
    session: SessionId,
    seg: OwnedSegment,
}

const BELL_AT: usize = 1 << 20;
const BELL_LEN: usize = 4096;

impl Ringer {
    fn new(endpoint: &str, name: &str) -> Ringer {
        let peer = RawPeer::connect(endpoint);
        let session = peer.open_and_load(SessionSpec::inference(name), linear_relu(3));
        let mut seg = OwnedSegment::create(1, 4 << 20).unwrap();
        assert!(matches!(
            offer(&peer, 4, session, &seg),
            Reply::MemoryShared { .. }
        ));
        // The feed x at the header's end.
        let x = Tensor::from_f32([BATCH, IN], values(7, BATCH * IN)).unwrap();
        let run = Request::Run {
            session,
            feeds: vec![wire::NamedTensor::new("x", x)],
            fetches: vec!["y".into()],
        };
        let frames = wire::encode_request_into(5, &run, Some(&mut seg)).unwrap();
        assert!(matches!(peer.call(frames).message, Reply::RunDone { .. }));
        Ringer { peer, session, seg }
    }

    /// Run `id`'s one header frame, naming the doorbell of `bytes` at `at`.
    fn run(&self, id: u64, at: usize, bytes: usize) -> Vec<u8> {
        let ty = TensorType::f32([BATCH, IN]);
        let areas = SharedAreas {
            reply: None,
            doorbell: Some(SlotRange {
                offset: at as u64,
                bytes: bytes as u64,
            }),
        };
        let feeds = [("x", &ty, SEGMENT_HEADER as u64)];
        let mut f =
            wire::encode_shared_run(id, self.session, feeds, 1, areas, &["y".to_string()]).unwrap();
        assert_eq!(f.len(), 1);
        f.remove(0)
    }

    fn done(&self, r: wire::Envelope<Reply>, id: u64) {
        assert_eq!(r.request_id, id);
        assert!(
            matches!(r.message, Reply::RunDone { .. }),
            "{:?}",
            r.message
        );
    }
}

/// A client ringing garbage as fast as it can: each ring that is not a
/// Run costs no copy, at most 16 are examined before the connection's
/// doorbells are closed, and after that none at all, however many more
/// it rings; its Runs still come through the socket, and another
/// connection's doorbell keeps serving it.
#[test]
fn garbage_rings_are_bounded_and_close_the_doorbells() {
    let metrics = Arc::new(Metrics::new());
    let m = Arc::clone(&metrics);
    let service = start_with(|c| {
        c.busy_poll = Duration::from_millis(20);
        c.metrics = Some(m);
    });
    let mut bad = Ringer::new(service.endpoint(), "garbage");
    let mut good = Ringer::new(service.endpoint(), "bystander");
    // The socket copies make both doorbells known.
    bad.done(bad.peer.call(vec![bad.run(6, BELL_AT, BELL_LEN)]), 6);
    good.done(good.peer.call(vec![good.run(6, BELL_AT, BELL_LEN)]), 6);
    // The bystander's ring is taken from its doorbell.
    let frame = good.run(7, BELL_AT, BELL_LEN);
    assert!(good.seg.ring(BELL_AT, BELL_LEN, 7, &frame));
    good.done(good.peer.recv(), 7);
    assert_eq!(metric(&metrics, TAKEN), 1);
    // Garbage of every kind the doorbell's checks tell apart: junk, a
    // prefix under another id, a length word past the doorbell, a Run's
    // prefix over junk (copied, then refused by the decoder).
    let mut id = 100u64;
    let run_like = {
        let mut f = bad.run(0, BELL_AT, BELL_LEN);
        f.truncate(24);
        f.extend_from_slice(&[0xAB; 512]);
        f
    };
    let mut rings = 0u64;
    while metric(&metrics, CLOSED) == 0 {
        id += 1;
        let frame: Vec<u8> = match id % 3 {
            0 => b"not a request".to_vec(),
            1 => bad.run(id + 1, BELL_AT, BELL_LEN),
            _ => {
                let mut f = run_like.clone();
                f[8..16].copy_from_slice(&id.to_le_bytes());
                f
            }
        };
        // Counted before the ring: read after it, a ring the service
        // examined first would leave the wait below nothing to see.
        let seen = metric(&metrics, GARBAGE);
        assert!(bad.seg.ring(BELL_AT, BELL_LEN, id, &frame));
        rings += 1;
        // Each ring is seen before the next (the loop takes one a turn).
        until("the ring is examined", || {
            metric(&metrics, GARBAGE) > seen || metric(&metrics, CLOSED) > 0
        });
        assert!(rings <= 16, "closed after 16 garbage rings, not {rings}");
    }
    assert_eq!(metric(&metrics, GARBAGE), 16);
    // Only the Run-like rings were copied, each at most the doorbell.
    let copied = metric(&metrics, COPIED);
    assert!(
        copied <= 6 * (BELL_LEN - DOORBELL_HEADER) as u64,
        "{copied}"
    );
    // As fast as it can, a thousand times more: nothing more examined.
    for _ in 0..20_000 {
        id += 1;
        bad.seg.ring(BELL_AT, BELL_LEN, id, b"garbage");
    }
    // A Run rung in the closed doorbell is not taken; sent through the
    // socket, it is served.
    id += 1;
    let frame = bad.run(id, BELL_AT, BELL_LEN);
    assert!(bad.seg.ring(BELL_AT, BELL_LEN, id, &frame));
    assert!(bad.peer.recv_raw(Duration::from_millis(300)).is_none());
    bad.done(bad.peer.call(vec![frame]), id);
    // The bystander's doorbell still serves it.
    let frame = good.run(8, BELL_AT, BELL_LEN);
    assert!(good.seg.ring(BELL_AT, BELL_LEN, 8, &frame));
    good.done(good.peer.recv(), 8);
    assert_eq!(metric(&metrics, GARBAGE), 16);
    assert_eq!(metric(&metrics, CLOSED), 1);
    assert_eq!(metric(&metrics, TAKEN), 2);
    assert_eq!(metric(&metrics, COPIED) - copied, frame.len() as u64);
}

/// A doorbell larger than the service takes (announced at Hello) is
/// refused when a Run names it, and never read: a 3 MiB doorbell whose
/// length word says 3 MiB − 64, rung, copies nothing.
#[test]
fn a_doorbell_larger_than_the_service_takes_is_refused_and_never_read() {
    let metrics = Arc::new(Metrics::new());
    let m = Arc::clone(&metrics);
    let service = start_with(|c| {
        c.busy_poll = Duration::from_millis(20);
        c.metrics = Some(m);
    });
    let announced = Client::connect(service.endpoint())
        .unwrap()
        .server_limits()
        .max_doorbell_bytes;
    assert_eq!(announced, wire::DEFAULT_DOORBELL_BYTES);
    let mut r = Ringer::new(service.endpoint(), "huge");
    let (at, len) = (1usize << 20, 3usize << 20);
    let frame = r.run(6, at, len);
    let reply = r.peer.call(vec![frame.clone()]).message;
    assert_eq!(error_code(&reply), ErrorCode::SharedMemory, "{reply:?}");
    match &reply {
        Reply::Error(e) => assert!(e.message.contains("max_doorbell_bytes"), "{}", e.message),
        other => panic!("{other:?}"),
    }
    // Rung with a length word that spans it: never polled, never copied.
    let mut huge = vec![0u8; len - DOORBELL_HEADER];
    huge[..frame.len()].copy_from_slice(&frame);
    for id in 7u64..50 {
        huge[8..16].copy_from_slice(&id.to_le_bytes());
        assert!(r.seg.ring(at, len, id, &huge));
    }
    assert!(r.peer.recv_raw(Duration::from_millis(300)).is_none());
    assert_eq!(metric(&metrics, COPIED), 0);
    assert_eq!(metric(&metrics, GARBAGE), 0);
    assert_eq!(metric(&metrics, TAKEN), 0);
    // A doorbell within the limit still works for this connection.
    r.done(r.peer.call(vec![r.run(60, BELL_AT, BELL_LEN)]), 60);
    let frame = r.run(61, BELL_AT, BELL_LEN);
    assert!(r.seg.ring(BELL_AT, BELL_LEN, 61, &frame));
    r.done(r.peer.recv(), 61);
    assert_eq!(metric(&metrics, COPIED), frame.len() as u64);
}

/// The reply to a segment offer of `mib` MiB (id `id`) from `peer`.
fn offer_mib(peer: &RawPeer, session: SessionId, id: u32, mib: usize) -> Reply {
    let seg = OwnedSegment::create(id, mib << 20).unwrap();
    offer(peer, 10 + u64::from(id), session, &seg)
}

fn refused_for(reply: &Reply, flag: &str) {
    match reply {
        Reply::Error(e) => {
            assert_eq!(e.code, ErrorCode::SharedMemory, "{}", e.message);
            assert!(e.message.contains(flag), "{}", e.message);
        }
        other => panic!("expected a refusal naming {flag}, got {other:?}"),
    }
}

/// Segments are mapped twice (read-only, writable for reply slots), each
/// mapping counted: with 20 MiB per connection and 33 MiB in all, a
/// connection's third 4 MiB segment is refused (`--max-shared-per-client`),
/// a third connection's first when the others hold 32 MiB (`--max-shared`);
/// meanwhile another client's Runs work (through the socket once its own
/// segment is refused), and a closed session gives its share back.
#[test]
fn segments_beyond_the_address_space_caps_are_refused() {
    let service = start_with(|c| {
        c.max_shared_per_client = 20 << 20;
        c.max_shared = 33 << 20;
    });
    let a = RawPeer::connect(service.endpoint());
    let sa = a.open_and_load(SessionSpec::inference("a"), linear_relu(1));
    assert!(matches!(
        offer_mib(&a, sa, 1, 4),
        Reply::MemoryShared { .. }
    ));
    assert!(matches!(
        offer_mib(&a, sa, 2, 4),
        Reply::MemoryShared { .. }
    ));
    refused_for(&offer_mib(&a, sa, 3, 4), "(--max-shared-per-client)");
    // A segment as large as the whole cap is refused before it is mapped.
    refused_for(&offer_mib(&a, sa, 4, 16), "(--max-shared-per-client)");
    let b = RawPeer::connect(service.endpoint());
    let sb = b.open_and_load(SessionSpec::inference("b"), linear_relu(2));
    assert!(matches!(
        offer_mib(&b, sb, 1, 4),
        Reply::MemoryShared { .. }
    ));
    assert!(matches!(
        offer_mib(&b, sb, 2, 4),
        Reply::MemoryShared { .. }
    ));
    let c = RawPeer::connect(service.endpoint());
    let sc = c.open_and_load(SessionSpec::inference("c"), linear_relu(3));
    refused_for(&offer_mib(&c, sc, 1, 4), "(--max-shared)");
    // Another client keeps working: its offer refused, its Runs go
    // through the socket.
    let mut client = Client::connect(service.endpoint()).unwrap();
    let mut s = client.open_session(SessionSpec::inference("d")).unwrap();
    let (graph, vars) = linear_relu(4);
    s.load(&graph, vars).unwrap();
    let x = Tensor::from_f32([BATCH, IN], values(9, BATCH * IN)).unwrap();
    let ty = TensorType::f32([BATCH, IN]);
    let e = s.feed_buffers(&[("x", ty)]).unwrap_err();
    assert!(e.to_string().contains("(--max-shared)"), "{e}");
    let out = s.run(vec![("x", x)], &["y"]).unwrap();
    assert_eq!(out.len(), 1);
    s.close().unwrap();
    // A's session closed: its 16 MiB are unmapped and given back.
    let close = Request::CloseSession { session: sa };
    assert!(matches!(
        a.call(wire::encode_request(30, &close).unwrap()).message,
        Reply::SessionClosed { .. }
    ));
    assert!(matches!(
        offer_mib(&c, sc, 1, 4),
        Reply::MemoryShared { .. }
    ));
    assert!(matches!(
        offer_mib(&c, sc, 2, 4),
        Reply::MemoryShared { .. }
    ));
    refused_for(&offer_mib(&c, sc, 3, 4), "(--max-shared-per-client)");
    refused_for(&offer_mib(&b, sb, 3, 1), "(--max-shared)");
}
