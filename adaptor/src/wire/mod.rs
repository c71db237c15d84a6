//! The wire protocol: the only place that knows the byte format.
//!
//! A message is a ZeroMQ multipart message of parts: a header (magic,
//! protocol version, request id, header length, bincode body), then one
//! part of raw little-endian values per tensor the body names, never
//! re-encoded. A part spans one or more consecutive frames: requests are
//! sent in frames of at most [`CHUNK_BYTES`] (the cap of the service's
//! socket on every frame, ZeroMQ's handshake included), replies in one
//! frame per part (`frames.rs`). The service's ROUTER socket prepends the peer's routing id;
//! jobs use a DEALER and see only the frames described here.
//!
//! Decoding is bounded everywhere by [`Limits`]: frames per message, bytes
//! per frame, bytes of bincode per header, nodes per graph, bytes per
//! tensor. Every failure is a [`WireError`] with a stable [`ErrorCode`].
//! The byte layout is documented in `docs/protocol.md`.

pub mod auth;
mod codec;
mod decode;
mod error;
mod frames;
mod message;
mod pool;
pub mod shm;
mod slots;

pub use codec::{
    bounded_text, encode_error, encode_reply, encode_request, encode_request_into,
    encode_shared_run, peek_request_id, peek_request_name, peek_run_done, Envelope, SharedAreas,
    SlotRange, MAGIC, MAX_ERROR_TEXT, PREFIX_BYTES,
};
pub use decode::{
    decode_reply, decode_reply_in, decode_request, decode_request_in, decode_request_with,
};
pub use error::{DecodeError, ErrorCode, WireError};
pub use frames::{
    chunk_frames, copy_bytes, max_message_frames, tensor_frame, tensor_from_chunks,
    tensor_from_frame, tensor_from_frame_in, CHUNK_BYTES,
};
pub use message::{
    ErrorReply, JobKind, NamedTensor, Reply, Request, SessionId, SessionSpec, SessionState,
    SessionStatus, SloAttainment, SpecError, StatusReport, MAX_SLO_MS, SLO_WINDOW,
};
pub use pool::{keep_freed_blocks_mapped, BufferPool, MIN_POOLED_BYTES};
pub use slots::{
    find_in_slot, post_outputs, post_outputs_with, read_slot, slot_outputs, write_tensor, SlotFind,
    SlotRead,
};

use crate::graph::GraphLimits;
use serde::{Deserialize, Serialize};

/// The protocol version this build speaks. Bumped on any change to the byte
/// format; a peer with another version gets [`ErrorCode::VersionMismatch`].
pub const PROTOCOL_VERSION: u32 = 12;

/// Bounds on what one side accepts from the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Largest part (the header, or one tensor's values) in bytes, however
    /// many frames carry it.
    pub max_frame_bytes: usize,
    /// Largest header frame, and the bincode decoding limit, in bytes.
    pub max_header_bytes: usize,
    /// Largest tensor sent as a frame, in bytes.
    pub max_tensor_bytes: usize,
    /// Most parts in one message (the header and one per tensor); the
    /// frames they may take are bounded by [`max_message_frames`].
    pub max_frames: usize,
    /// Most nodes in one graph.
    pub max_nodes: usize,
    /// Largest doorbell a shared Run may name, header included (see
    /// [`shm::Doorbell`]): a larger one is refused with `SharedMemory`,
    /// and the service never reads more than this from a doorbell.
    pub max_doorbell_bytes: usize,
}

/// Default of [`Limits::max_doorbell_bytes`]: room for a Run's header of
/// a few hundred feeds and fetches (the client's doorbells are
/// [`crate::client::DOORBELL_BYTES`]).
pub const DEFAULT_DOORBELL_BYTES: usize = 64 << 10;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_bytes: 1 << 30,
            max_header_bytes: 64 << 20,
            max_tensor_bytes: 1 << 30,
            max_frames: 4096,
            max_nodes: 100_000,
            max_doorbell_bytes: DEFAULT_DOORBELL_BYTES,
        }
    }
}

impl Limits {
    /// The graph validation limits these wire limits imply.
    pub fn graph_limits(&self) -> GraphLimits {
        let d = GraphLimits::default();
        GraphLimits {
            max_nodes: self.max_nodes,
            max_constant_bytes: d.max_constant_bytes.min(self.max_header_bytes),
            ..d
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::graph::GraphBuilder;
    use crate::tensor::{Tensor, TensorType};

    #[test]
    fn large_tensors_round_trip_through_the_split_copies() {
        // Above the size at which frames are copied by several threads, with
        // a length that does not divide evenly.
        let n = 1_500_001;
        let f = Tensor::from_f32([n], (0..n).map(|i| i as f32 * 0.25 - 7.0).collect()).unwrap();
        let i = Tensor::from_i64([n], (0..n as i64).map(|i| i * 3 - 11).collect()).unwrap();
        let req = Request::Run {
            session: SessionId(4),
            feeds: vec![NamedTensor::new("f", f), NamedTensor::new("i", i)],
            fetches: vec![],
        };
        let frames = encode_request(9, &req).unwrap();
        // Sent in frames of at most the service's cap, two parts of n × 4
        // and n × 8 bytes after the one-frame header.
        assert!(frames.iter().all(|f| f.len() <= CHUNK_BYTES));
        assert_eq!(
            frames.len(),
            1 + (n * 4).div_ceil(CHUNK_BYTES) + (n * 8).div_ceil(CHUNK_BYTES)
        );
        let pool = BufferPool::new(1 << 30);
        for round in 0..2 {
            let env = decode_request_in(&frames, &Limits::default(), Some(&pool)).unwrap();
            assert_eq!(env.message, req, "round {round}");
            // Second round: decoded into the storage given back here.
            if let Request::Run { feeds, .. } = env.message {
                feeds.into_iter().for_each(|t| pool.give(t.tensor));
            }
        }
        assert_eq!(
            decode_request(&frames, &Limits::default()).unwrap().message,
            req
        );
        // One frame per part (as the service replies) decodes the same.
        let whole = [
            frames[0].clone(),
            tensor_frame(
                &Tensor::from_f32([n], (0..n).map(|i| i as f32 * 0.25 - 7.0).collect()).unwrap(),
            ),
            frames[1 + (n * 4).div_ceil(CHUNK_BYTES)..].concat(),
        ];
        assert_eq!(whole[1].len(), n * 4);
        assert_eq!(
            decode_request(&whole, &Limits::default()).unwrap().message,
            req
        );
    }

    /// A large graph's header spans several frames, and a LoadGraph with
    /// large variables too: every frame within the cap, the request the same.
    #[test]
    fn large_headers_and_variables_are_sent_in_chunks() {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([1, 1000]));
        let w = g.variable("w", Tensor::full([1000, 3000], 0.5));
        let mut y = g.matmul(x, w);
        for i in 0..3000 {
            y = g.relu(y);
            g.set_name(y, &format!("a fairly long node name number {i}"));
        }
        let (graph, vars) = g.finish().unwrap();
        let req = Request::LoadGraph {
            session: SessionId(1),
            graph,
            variables: vars
                .into_iter()
                .map(|(n, t)| NamedTensor::new(n, t))
                .collect(),
        };
        let frames = encode_request(3, &req).unwrap();
        assert!(frames.iter().all(|f| f.len() <= CHUNK_BYTES));
        let header = u64::from_le_bytes(frames[0][16..24].try_into().unwrap()) as usize;
        assert!(header > CHUNK_BYTES, "header of {header} bytes");
        assert_eq!(
            decode_request(&frames, &Limits::default()).unwrap().message,
            req
        );
        // The header's length is checked against the header limit before
        // any frame is gathered.
        let small = Limits {
            max_header_bytes: header - 1,
            ..Limits::default()
        };
        let e = decode_request(&frames, &small).unwrap_err();
        assert_eq!(e.error.code(), ErrorCode::FrameTooLarge, "{e}");
        // A part above the part limit, though each frame is small.
        let small = Limits {
            max_frame_bytes: 1000 * 3000 * 4 - 1,
            ..Limits::default()
        };
        let e = decode_request(&frames, &small).unwrap_err();
        assert_eq!(e.error.code(), ErrorCode::FrameTooLarge, "{e}");
    }

    fn load_graph() -> Request {
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::f32([2, 3]));
        let w = g.variable("w", Tensor::full([3, 4], 0.5));
        let y = g.matmul(x, w);
        g.set_name(y, "y");
        let (graph, vars) = g.finish().unwrap();
        Request::LoadGraph {
            session: SessionId(7),
            graph,
            variables: vars
                .into_iter()
                .map(|(n, t)| NamedTensor::new(n, t))
                .collect(),
        }
    }

    fn run() -> Request {
        Request::Run {
            session: SessionId(3),
            feeds: vec![
                NamedTensor::new(
                    "x",
                    Tensor::from_f32([2, 2], vec![1.0, -2.0, 3.5, f32::MAX]).unwrap(),
                ),
                NamedTensor::new("i", Tensor::from_i64([3], vec![1, -7, i64::MIN]).unwrap()),
            ],
            fetches: vec!["y".into(), "z:1".into()],
        }
    }

    #[test]
    fn requests_round_trip() {
        let l = Limits::default();
        for req in [
            Request::Hello { client: "t".into() },
            Request::OpenSession(SessionSpec::training("job").with_priority(-3)),
            Request::OpenSession(
                SessionSpec::inference("resnet")
                    .with_slo_ms(5.25)
                    .unwrap()
                    .with_expected_iterations(7),
            ),
            load_graph(),
            run(),
            Request::ReadVariables {
                session: SessionId(1),
                names: vec!["w".into()],
            },
            Request::WriteVariables {
                session: SessionId(1),
                variables: vec![NamedTensor::new("w", Tensor::scalar(1.5))],
            },
            Request::CloseSession {
                session: SessionId(9),
            },
            Request::Status,
            Request::ShareMemory {
                session: SessionId(2),
                offer: shm::SegmentOffer {
                    segment: 5,
                    bytes: 1 << 21,
                    token: [3; shm::TOKEN_BYTES],
                },
            },
            Request::Authenticate {
                nonce: [7; auth::AUTH_BYTES],
                proof: [9; auth::AUTH_BYTES],
            },
        ] {
            let frames = encode_request(42, &req).unwrap();
            // The kind is read from the tag alone.
            assert_eq!(peek_request_name(&frames[0]), Some(req.name()));
            let env = decode_request(&frames, &l).unwrap();
            assert_eq!(env.request_id, 42);
            assert_eq!(env.message, req);
        }
        assert_eq!(peek_request_name(b"not a request"), None);
        let mut unknown = encode_request(1, &Request::Status).unwrap();
        unknown[0][PREFIX_BYTES..PREFIX_BYTES + 4].copy_from_slice(&99u32.to_le_bytes());
        assert_eq!(peek_request_name(&unknown[0]), None);
    }

    #[test]
    fn tensors_travel_as_raw_frames() {
        let frames = encode_request(1, &run()).unwrap();
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[1].len(), 16);
        assert_eq!(&frames[1][..4], &1.0f32.to_le_bytes());
        assert_eq!(&frames[2][8..16], &(-7i64).to_le_bytes());
    }

    /// f16 and bf16 tensors travel as their raw little-endian u16 values:
    /// in a Run (one small, one split over frames and decoded into pooled
    /// storage), a LoadGraph of a bf16 graph and its variables, and a reply.
    #[test]
    fn half_tensors_round_trip_in_runs_and_load_graphs() {
        use crate::tensor::{bf16, f16, DType};
        let small =
            Tensor::from_f16([3], vec![f16::ONE, f16::from_f32(-0.1), f16::INFINITY]).unwrap();
        let n = 700_001;
        let big = Tensor::from_bf16(
            [n],
            (0..n).map(|i| bf16::from_f32(i as f32 - 5.0)).collect(),
        )
        .unwrap();
        let req = Request::Run {
            session: SessionId(2),
            feeds: vec![
                NamedTensor::new("h", small.clone()),
                NamedTensor::new("b", big.clone()),
            ],
            fetches: vec!["y".into()],
        };
        let frames = encode_request(5, &req).unwrap();
        assert!(frames.iter().all(|f| f.len() <= CHUNK_BYTES));
        assert_eq!(frames[1], vec![0x00, 0x3c, 0x66, 0xae, 0x00, 0x7c]);
        assert_eq!(frames.len(), 2 + (n * 2).div_ceil(CHUNK_BYTES));
        let pool = BufferPool::new(1 << 30);
        for round in 0..2 {
            let env = decode_request_in(&frames, &Limits::default(), Some(&pool)).unwrap();
            assert_eq!(env.message, req, "round {round}");
            if let Request::Run { feeds, .. } = env.message {
                feeds.into_iter().for_each(|t| pool.give(t.tensor));
            }
        }
        // A LoadGraph of a bf16 graph with bf16 variables.
        let mut g = GraphBuilder::new();
        let x = g.placeholder("x", TensorType::new(DType::BF16, [2, 3]));
        let w = g.variable(
            "w",
            Tensor::from_bf16([3, 4], vec![bf16::from_f32(0.5); 12]).unwrap(),
        );
        let y = g.matmul(x, w);
        let y = g.cast(y, DType::F32);
        g.set_name(y, "y");
        let (graph, vars) = g.finish().unwrap();
        let load = Request::LoadGraph {
            session: SessionId(7),
            graph,
            variables: vars
                .into_iter()
                .map(|(n, t)| NamedTensor::new(n, t))
                .collect(),
        };
        let frames = encode_request(6, &load).unwrap();
        assert_eq!(frames.last().unwrap().len(), 24);
        assert_eq!(
            decode_request(&frames, &Limits::default()).unwrap().message,
            load
        );
        let rep = Reply::RunDone {
            outputs: vec![small, big],
        };
        let frames = encode_reply(8, &rep).unwrap();
        assert_eq!(
            decode_reply(&frames, &Limits::default()).unwrap().message,
            rep
        );
    }

    /// `slo_ms` travels as the float given; outside (0, MAX_SLO_MS] or not
    /// finite it is a typed error, from the builder and from `check` (what
    /// the service runs on a decoded spec, which a peer may have built by
    /// hand).
    #[test]
    fn slo_ms_round_trips_and_is_checked() {
        let spec = SessionSpec::inference("a").with_slo_ms(60_000.0).unwrap();
        assert_eq!(spec.slo_ms, Some(60_000.0));
        assert_eq!(spec.check(), Ok(()));
        assert_eq!(SessionSpec::inference("b").check(), Ok(()));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, MAX_SLO_MS * 2.0] {
            let e = SessionSpec::inference("c").with_slo_ms(bad).unwrap_err();
            assert!(matches!(e, SpecError::Slo { .. }), "{bad}: {e}");
            assert!(e.to_string().contains("slo_ms"), "{e}");
            let mut raw = SessionSpec::inference("d");
            raw.slo_ms = Some(bad);
            // A hand-built spec crosses the wire as it is; the service checks it.
            let frames = encode_request(1, &Request::OpenSession(raw.clone())).unwrap();
            match decode_request(&frames, &Limits::default()).unwrap().message {
                Request::OpenSession(got) => assert!(got.check().is_err(), "{bad}"),
                other => panic!("{other:?}"),
            }
        }
        let report = StatusReport {
            server: "s".into(),
            version: PROTOCOL_VERSION,
            device: "cpu".into(),
            policy: "priority".into(),
            memory_bytes: None,
            lanes: None,
            lanes_json: None,
            max_lanes: 1,
            workers: 1,
            uptime_ms: 1,
            queued: 0,
            sessions: vec![SessionStatus {
                session: SessionId(1),
                spec,
                state: SessionState::Ready,
                iterations: 4,
                idle_ms: 0,
                queueing_mean_us: 0,
                service_mean_us: 0,
                resident: true,
                evictions: 0,
                returns: 0,
                shared_bytes: 0,
                slo: Some(SloAttainment {
                    slo_ms: 60_000.0,
                    runs: 4,
                    within: 3,
                    recent_p99_ms: Some(2.5),
                }),
            }],
        };
        let rep = Reply::Status(report);
        let frames = encode_reply(3, &rep).unwrap();
        assert_eq!(
            decode_reply(&frames, &Limits::default()).unwrap().message,
            rep
        );
        let a = SloAttainment {
            slo_ms: 1.0,
            runs: 4,
            within: 3,
            recent_p99_ms: None,
        };
        assert_eq!(a.attainment(), Some(0.75));
        assert_eq!(
            SloAttainment {
                runs: 0,
                within: 0,
                ..a
            }
            .attainment(),
            None
        );
    }

    #[test]
    fn replies_round_trip() {
        let l = Limits::default();
        for rep in [
            Reply::RunDone {
                outputs: vec![Tensor::scalar(2.5), Tensor::from_i64([1], vec![4]).unwrap()],
            },
            Reply::error(ErrorCode::BadFeed, "nope"),
            Reply::MemoryShared {
                session: SessionId(2),
                segment: 5,
            },
            Reply::Hello {
                server: "s".into(),
                version: PROTOCOL_VERSION,
                limits: l,
                desk: Some("lanes-desk-1".into()),
                challenge: Some([1; auth::AUTH_BYTES]),
            },
            Reply::Ping,
            Reply::Authenticated {
                proof: [2; auth::AUTH_BYTES],
            },
        ] {
            let frames = encode_reply(u64::MAX, &rep).unwrap();
            let env = decode_reply(&frames, &l).unwrap();
            assert_eq!(env.request_id, u64::MAX);
            assert_eq!(env.message, rep);
        }
    }

    #[test]
    fn bad_input_gives_typed_errors() {
        let l = Limits::default();
        let err = |frames: &[Vec<u8>]| decode_request(frames, &l).unwrap_err();
        // Garbage.
        let e = err(&[b"definitely not a lanes message".to_vec()]);
        assert_eq!(e.error, WireError::BadMagic);
        assert_eq!(e.error.code(), ErrorCode::Malformed);
        assert_eq!(err(&[]).error, WireError::Empty);
        // Wrong version keeps the request id.
        let mut frames = encode_request(5, &run()).unwrap();
        frames[0][4..8].copy_from_slice(&99u32.to_le_bytes());
        let e = err(&frames);
        assert_eq!(e.request_id, Some(5));
        assert_eq!(e.error.code(), ErrorCode::VersionMismatch);
        // Missing tensor frame.
        let mut frames = encode_request(6, &run()).unwrap();
        frames.pop();
        let e = err(&frames);
        assert_eq!(
            e.error,
            WireError::FrameCount {
                expected: 2,
                got: 1
            }
        );
        assert_eq!(e.error.code(), ErrorCode::Truncated);
        // An extra tensor frame.
        let mut frames = encode_request(6, &run()).unwrap();
        frames.push(frames[1].clone());
        assert_eq!(err(&frames).error.code(), ErrorCode::Malformed);
        // Short tensor frame.
        let mut frames = encode_request(6, &run()).unwrap();
        frames[1].truncate(10);
        assert_eq!(err(&frames).error.code(), ErrorCode::Truncated);
        // Truncated header.
        let mut frames = encode_request(6, &load_graph()).unwrap();
        let n = frames[0].len();
        frames[0].truncate(n / 2);
        let e = err(&frames);
        assert_eq!(e.error.code(), ErrorCode::Truncated, "{e}");
        assert_eq!(e.request_id, Some(6));
        // Every prefix of a header fails cleanly.
        let frames = encode_request(6, &load_graph()).unwrap();
        for cut in 0..frames[0].len() {
            let mut f = frames.clone();
            f[0].truncate(cut);
            assert!(decode_request(&f, &l).is_err());
        }
    }

    #[test]
    fn limits_are_enforced() {
        let small = Limits {
            max_frame_bytes: 12,
            ..Limits::default()
        };
        let frames = encode_request(1, &run()).unwrap();
        let e = decode_request(&frames, &small).unwrap_err();
        assert!(matches!(e.error, WireError::FrameTooLarge { .. }), "{e}");
        let few = Limits {
            max_frames: 2,
            ..Limits::default()
        };
        assert_eq!(
            decode_request(&frames, &few).unwrap_err().error.code(),
            ErrorCode::TooManyFrames
        );
        let tiny_tensor = Limits {
            max_tensor_bytes: 8,
            ..Limits::default()
        };
        assert_eq!(
            decode_request(&frames, &tiny_tensor)
                .unwrap_err()
                .error
                .code(),
            ErrorCode::TensorTooLarge
        );
        let nodes = Limits {
            max_nodes: 1,
            ..Limits::default()
        };
        let frames = encode_request(1, &load_graph()).unwrap();
        assert!(decode_request(&frames, &nodes).is_err());
        // A header claiming a huge vector length is refused by the bincode limit.
        let mut frames = encode_request(1, &Request::Status).unwrap();
        frames[0].truncate(PREFIX_BYTES);
        frames[0].extend_from_slice(&3u32.to_le_bytes()); // Run
        frames[0].extend_from_slice(&1u64.to_le_bytes()); // session
        frames[0].extend_from_slice(&u64::MAX.to_le_bytes()); // feeds.len()
        assert!(decode_request(&frames, &Limits::default()).is_err());
    }

    /// Finds one segment, as the service's table would.
    struct OneSegment<'a>(SessionId, u32, &'a std::sync::Arc<shm::AttachedSegment>);
    impl shm::SegmentLookup for OneSegment<'_> {
        fn segment(
            &self,
            session: SessionId,
            segment: u32,
        ) -> Option<&std::sync::Arc<shm::AttachedSegment>> {
            (session == self.0 && segment == self.1).then_some(self.2)
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn run_feeds_travel_in_a_shared_segment() {
        let l = Limits::default();
        let req = run();
        let mut seg = shm::OwnedSegment::create(4, 4096).unwrap();
        let frames = encode_request_into(8, &req, Some(&mut seg)).unwrap();
        // Only the header crosses the socket.
        assert_eq!(frames.len(), 1);
        let mut desk = shm::FdDesk::bind().unwrap();
        seg.hand_over(desk.name()).unwrap();
        let file = desk.take(&seg.offer().token).unwrap();
        let attached =
            std::sync::Arc::new(shm::AttachedSegment::attach(file, &seg.offer(), 1 << 20).unwrap());
        let found = OneSegment(SessionId(3), 4, &attached);
        let env = decode_request_with(&frames, &l, None, &found).unwrap();
        // Decoded as views of the segment, nothing copied: the same feeds'
        // values, in the order sent, each where the layout put it.
        let Request::Run { feeds: sent, .. } = &req else {
            unreachable!()
        };
        let Request::RunShared {
            session,
            feeds,
            fetches,
            reply: None,
            doorbell: None,
        } = &env.message
        else {
            panic!("{:?}", env.message)
        };
        assert_eq!((*session, fetches.len()), (SessionId(3), 2));
        assert_eq!(feeds.len(), sent.len());
        for (f, s) in feeds.iter().zip(sent) {
            assert_eq!((&f.name, f.segment_id()), (&s.name, 4));
            assert_eq!(f.to_tensor(None).unwrap(), s.tensor);
            assert!(std::sync::Arc::ptr_eq(f.segment(), &attached));
        }
        // Re-encoded, the shared Run is the header the client sent.
        assert_eq!(encode_request(8, &env.message).unwrap(), frames);
        // The same header read against another session's segments, or
        // none: typed errors.
        for lookup in [
            OneSegment(SessionId(4), 4, &attached),
            OneSegment(SessionId(3), 5, &attached),
        ] {
            let e = decode_request_with(&frames, &l, None, &lookup).unwrap_err();
            assert_eq!(e.error.code(), ErrorCode::SharedMemory, "{e}");
            assert_eq!(e.request_id, Some(8));
        }
        // A segment too short for the feeds.
        let (_small_own, small) = shm::attached_pair(4, 100);
        let e = decode_request_with(&frames, &l, None, &OneSegment(SessionId(3), 4, &small))
            .unwrap_err();
        assert_eq!(e.error.code(), ErrorCode::SharedMemory, "{e}");
        let e = decode_request(&frames, &l).unwrap_err();
        assert_eq!(e.error.code(), ErrorCode::SharedMemory);
        // Frames next to a shared Run are refused too.
        let mut extra = frames.clone();
        extra.push(vec![0; 16]);
        assert!(decode_request_with(&extra, &l, None, &found).is_err());
        // Feeds larger than the segment are an encoding error, not a panic.
        let mut small = shm::OwnedSegment::create(6, 100).unwrap();
        assert!(matches!(
            encode_request_into(9, &req, Some(&mut small)),
            Err(WireError::Encode { .. })
        ));
        // Other requests ignore the segment.
        let status = encode_request_into(10, &Request::Status, Some(&mut small)).unwrap();
        assert_eq!(
            decode_request(&status, &l).unwrap().message,
            Request::Status
        );
    }

    #[test]
    fn error_codes_are_stable() {
        assert_eq!(ErrorCode::Malformed.as_u16(), 1);
        assert_eq!(ErrorCode::UnknownSession.as_u16(), 10);
        assert_eq!(ErrorCode::BadFeed.as_u16(), 14);
        assert_eq!(ErrorCode::SharedMemory.as_u16(), 24);
        for c in 0..40u16 {
            assert_eq!(ErrorCode::from(c).as_u16(), c);
        }
    }

    /// `parts` (one frame each) re-split at the cut points `cuts` picks:
    /// each part into non-empty frames (an empty part stays one frame), the
    /// header's first frame no shorter than `HEADER_LEAD_BYTES`.
    fn resplit(parts: &[Vec<u8>], cuts: &[usize]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut k = 0;
        for (i, p) in parts.iter().enumerate() {
            let mut rest = &p[..];
            let mut least = if i == 0 { codec::HEADER_LEAD_BYTES } else { 1 };
            loop {
                let c = cuts.get(k).copied().unwrap_or(usize::MAX);
                k += 1;
                if rest.len() <= least || c % 3 == 0 {
                    out.push(rest.to_vec());
                    break;
                }
                let at = least + c % (rest.len() - least);
                least = 1;
                out.push(rest[..at].to_vec());
                rest = &rest[at..];
            }
        }
        out
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(
            std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000)
        ))]
        /// Parts split into frames at random points decode to the same
        /// message; frames that do not add up to the parts (a byte moved
        /// across a boundary, a frame lost, doubled or emptied) are typed
        /// errors, never panics.
        #[test]
        fn parts_split_anywhere_decode_the_same(
            cuts in proptest::collection::vec(proptest::prelude::any::<usize>(), 0..64),
            which in proptest::prelude::any::<usize>(),
        ) {
            let l = Limits::default();
            for req in [load_graph(), run()] {
                let parts = encode_request(9, &req).unwrap();
                let frames = resplit(&parts, &cuts);
                proptest::prop_assert_eq!(&decode_request(&frames, &l).unwrap().message, &req);
                let i = which % frames.len();
                // A byte moved from one frame to the next (across a part
                // boundary when they belong to different parts).
                let mut moved = frames.clone();
                if i + 1 < moved.len() && !moved[i].is_empty() {
                    let b = moved[i].pop().unwrap();
                    moved[i + 1].insert(0, b);
                    if let Ok(env) = decode_request(&moved, &l) {
                        // Only when both frames are of one part.
                        proptest::prop_assert_eq!(&env.message, &req);
                    }
                }
                let mut lost = frames.clone();
                lost.remove(i);
                proptest::prop_assert!(decode_request(&lost, &l).is_err());
                let mut doubled = frames.clone();
                doubled.insert(i, frames[i].clone());
                proptest::prop_assert!(decode_request(&doubled, &l).is_err());
                if !frames[i].is_empty() {
                    let mut emptied = frames.clone();
                    emptied.insert(i, Vec::new());
                    proptest::prop_assert!(decode_request(&emptied, &l).is_err());
                }
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(
            std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000)
        ))]
        /// Random bytes and corrupted valid messages decode to errors, never
        /// panics: 10,000 cases in CI; `PROPTEST_CASES=1000000` for a long run.
        #[test]
        fn decoding_never_panics(
            junk in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
            flips in proptest::collection::vec((proptest::prelude::any::<usize>(), proptest::prelude::any::<u8>()), 1..8),
            cut in proptest::prelude::any::<usize>(),
        ) {
            let l = Limits::default();
            let _ = decode_request(std::slice::from_ref(&junk), &l);
            let _ = decode_reply(&[junk.clone(), junk], &l);
            for req in [load_graph(), run()] {
                let mut frames = encode_request(9, &req).unwrap();
                let n = frames[0].len();
                for &(pos, byte) in &flips {
                    // Keep the prefix valid so the body decoder is exercised.
                    let i = PREFIX_BYTES + pos % (n - PREFIX_BYTES);
                    frames[0][i] ^= byte;
                }
                let _ = decode_request(&frames, &l);
                let mut whole = encode_request(9, &req).unwrap();
                whole[0].truncate(PREFIX_BYTES + cut % (n - PREFIX_BYTES));
                proptest::prop_assert!(decode_request(&whole, &l).is_err());
            }
        }
    }
}
