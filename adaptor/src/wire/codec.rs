//! The message bodies and their encoding into frames (decoding is in
//! `decode.rs`).
//!
//! Part 0 is the header: 4 magic bytes `LNS\0`, the protocol version (u32
//! LE), the request id (u64 LE), the header's length (u64 LE), then the
//! body in bincode (fixed-width integers, little endian, decoding bounded
//! by `Limits::max_header_bytes`). Parts 1.. are the raw little-endian
//! values of the tensors the body announces (name and type in the body,
//! values in the part, in order). A request's parts are sent in frames of
//! at most [`CHUNK_BYTES`], a reply's in one frame each (`frames.rs`).

use super::auth::AUTH_BYTES;
use super::error::{ErrorCode, WireError};
use super::frames::{self, push_part, tensor_frame, CHUNK_BYTES};
use super::message::{
    ErrorReply, NamedTensor, Reply, Request, SessionId, SessionSpec, StatusReport,
};
use super::shm::{OwnedSegment, SegmentOffer};
use super::slots::write_shared;
use super::{Limits, PROTOCOL_VERSION};
use crate::graph::Graph;
use crate::tensor::{Tensor, TensorType};
use bincode::Options;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;

/// First bytes of every header frame.
pub const MAGIC: [u8; 4] = *b"LNS\0";
/// Bytes before the bincode body: magic, version, request id, and the
/// header's length (prefix included, u64 LE), which says how many bytes of
/// frames the header spans.
pub const PREFIX_BYTES: usize = 24;
/// Bytes of the header its first frame carries at least (all of it when
/// shorter): the prefix and the body's variant tag, the request's kind.
pub const HEADER_LEAD_BYTES: usize = PREFIX_BYTES + 4;

/// Name and type of a tensor whose values travel in their own part.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct TensorMeta {
    pub(super) name: String,
    pub(super) ty: TensorType,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) enum RequestBody<'a> {
    Hello {
        client: String,
    },
    OpenSession(SessionSpec),
    LoadGraph {
        session: SessionId,
        graph: Cow<'a, Graph>,
        variables: Vec<TensorMeta>,
    },
    Run {
        session: SessionId,
        feeds: Vec<TensorMeta>,
        fetches: Vec<String>,
        /// Set when the feeds' values are in a shared-memory segment
        /// instead of frames.
        shared: Option<SharedFeeds>,
    },
    ReadVariables {
        session: SessionId,
        names: Vec<String>,
    },
    WriteVariables {
        session: SessionId,
        variables: Vec<TensorMeta>,
    },
    CloseSession {
        session: SessionId,
    },
    Status,
    ShareMemory {
        session: SessionId,
        offer: SegmentOffer,
    },
    Authenticate {
        nonce: [u8; AUTH_BYTES],
        proof: [u8; AUTH_BYTES],
    },
}

/// Where in which segment a Run's feeds are (one offset per feed, in
/// order), and the reply slot there for its outputs, if any.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct SharedFeeds {
    pub(super) segment: u32,
    pub(super) offsets: Vec<u64>,
    pub(super) reply: Option<SlotRange>,
    pub(super) doorbell: Option<SlotRange>,
}

/// The reply slot and doorbell a shared Run names, if any.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedAreas {
    pub reply: Option<SlotRange>,
    pub doorbell: Option<SlotRange>,
}

/// A reply slot's or a doorbell's place in a segment (see
/// [`super::shm::ReplySlot`], [`super::shm::Doorbell`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotRange {
    pub offset: u64,
    pub bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) enum ReplyBody {
    Hello {
        server: String,
        version: u32,
        limits: Limits,
        desk: Option<String>,
        challenge: Option<[u8; AUTH_BYTES]>,
    },
    SessionOpened {
        session: SessionId,
    },
    GraphLoaded {
        session: SessionId,
        nodes: u64,
        variables: u64,
        persistent_bytes: u64,
        ephemeral_bytes: u64,
        waiting: Option<String>,
    },
    RunDone {
        outputs: Vec<TensorType>,
    },
    Variables {
        variables: Vec<TensorMeta>,
    },
    VariablesWritten {
        count: u64,
    },
    SessionClosed {
        session: SessionId,
    },
    Status(StatusReport),
    Error(ErrorReply),
    MemoryShared {
        session: SessionId,
        segment: u32,
    },
    Ping,
    Authenticated {
        proof: [u8; AUTH_BYTES],
    },
}

/// A decoded message: its request id and value.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope<T> {
    pub request_id: u64,
    pub message: T,
}

pub(super) fn options() -> impl Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_little_endian()
}

fn metas(ts: &[NamedTensor]) -> Vec<TensorMeta> {
    ts.iter()
        .map(|t| TensorMeta {
            name: t.name.clone(),
            ty: t.tensor.ty(),
        })
        .collect()
}

fn header<B: Serialize>(request_id: u64, body: &B) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(PREFIX_BYTES + 64);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&request_id.to_le_bytes());
    out.extend_from_slice(&0u64.to_le_bytes());
    options()
        .serialize_into(&mut out, body)
        .map_err(|e| WireError::Encode {
            reason: e.to_string(),
        })?;
    let len = (out.len() as u64).to_le_bytes();
    out[16..PREFIX_BYTES].copy_from_slice(&len);
    Ok(out)
}

/// A request's frames: its header and each tensor's values, every part
/// split into frames of at most [`CHUNK_BYTES`] (the service's cap).
fn request_frames(header: Vec<u8>, tensors: &[&Tensor]) -> Vec<Vec<u8>> {
    let mut out = Vec::with_capacity(1 + tensors.len());
    push_part(&mut out, header, CHUNK_BYTES);
    for t in tensors {
        frames::tensor_frames(t, CHUNK_BYTES, &mut out);
    }
    out
}

/// A reply's frames: one per part (the header, then each tensor). Clients
/// trust the service, and their sockets take frames as large as their
/// limits.
fn reply_frames(header: Vec<u8>, tensors: impl Iterator<Item = Vec<u8>>) -> Vec<Vec<u8>> {
    std::iter::once(header).chain(tensors).collect()
}

/// Encodes a request into frames (header, then one frame per tensor).
pub fn encode_request(request_id: u64, req: &Request) -> Result<Vec<Vec<u8>>, WireError> {
    encode_request_into(request_id, req, None)
}

/// [`encode_request`]; a Run's feed values go into `shared` (a segment the
/// service has attached) instead of frames when it is given.
pub fn encode_request_into(
    request_id: u64,
    req: &Request,
    shared: Option<&mut OwnedSegment>,
) -> Result<Vec<Vec<u8>>, WireError> {
    if let (
        Request::Run {
            session,
            feeds,
            fetches,
        },
        Some(seg),
    ) = (req, shared)
    {
        let offsets = write_shared(feeds, seg)?;
        let body = RequestBody::Run {
            session: *session,
            feeds: metas(feeds),
            fetches: fetches.clone(),
            shared: Some(SharedFeeds {
                segment: seg.id(),
                offsets,
                reply: None,
                doorbell: None,
            }),
        };
        return Ok(request_frames(header(request_id, &body)?, &[]));
    }
    fn named(ts: &[NamedTensor]) -> Vec<&Tensor> {
        ts.iter().map(|t| &t.tensor).collect()
    }
    let (body, tensors) = match req {
        Request::Hello { client } => (
            RequestBody::Hello {
                client: client.clone(),
            },
            Vec::new(),
        ),
        Request::OpenSession(spec) => (RequestBody::OpenSession(spec.clone()), Vec::new()),
        Request::LoadGraph {
            session,
            graph,
            variables,
        } => (
            RequestBody::LoadGraph {
                session: *session,
                graph: Cow::Borrowed(graph),
                variables: metas(variables),
            },
            named(variables),
        ),
        Request::Run {
            session,
            feeds,
            fetches,
        } => (
            RequestBody::Run {
                session: *session,
                feeds: metas(feeds),
                fetches: fetches.clone(),
                shared: None,
            },
            named(feeds),
        ),
        Request::RunShared {
            session,
            feeds,
            fetches,
            reply,
            doorbell,
        } => {
            // Re-encoded as the client sent it: the header alone.
            let segment = feeds
                .first()
                .map(|f| f.segment_id())
                .or(reply.as_ref().map(|r| r.segment_id()))
                .unwrap_or(0);
            if feeds.iter().any(|f| f.segment_id() != segment)
                || reply.as_ref().is_some_and(|r| r.segment_id() != segment)
                || doorbell.as_ref().is_some_and(|r| r.segment_id() != segment)
            {
                return Err(WireError::Encode {
                    reason: "a shared Run's feeds lie in more than one segment".into(),
                });
            }
            let feeds = feeds
                .iter()
                .map(|f| (f.name.as_str(), &f.ty, f.offset() as u64));
            let place = |r: std::ops::Range<usize>| SlotRange {
                offset: r.start as u64,
                bytes: r.len() as u64,
            };
            let areas = SharedAreas {
                reply: reply.as_ref().map(|r| place(r.range())),
                doorbell: doorbell.as_ref().map(|r| place(r.range())),
            };
            return encode_shared_run(request_id, *session, feeds, segment, areas, fetches);
        }
        Request::ReadVariables { session, names } => (
            RequestBody::ReadVariables {
                session: *session,
                names: names.clone(),
            },
            Vec::new(),
        ),
        Request::WriteVariables { session, variables } => (
            RequestBody::WriteVariables {
                session: *session,
                variables: metas(variables),
            },
            named(variables),
        ),
        Request::CloseSession { session } => {
            (RequestBody::CloseSession { session: *session }, Vec::new())
        }
        Request::Status => (RequestBody::Status, Vec::new()),
        Request::Authenticate { nonce, proof } => (
            RequestBody::Authenticate {
                nonce: *nonce,
                proof: *proof,
            },
            Vec::new(),
        ),
        Request::ShareMemory { session, offer } => (
            RequestBody::ShareMemory {
                session: *session,
                offer: *offer,
            },
            Vec::new(),
        ),
    };
    Ok(request_frames(header(request_id, &body)?, &tensors))
}

/// A Run whose feeds' values are already in the session's segment
/// `segment` (attached with a ShareMemory request), each `(name, type,
/// offset)`: only the header travels. A job that writes its inputs into the
/// segment in place (the client's feed buffers) sends each iteration so.
/// With a reply slot, the service also writes the fetched tensors into
/// that slot of the segment (see [`super::shm::ReplySlot`], [`super::read_slot`]); a
/// doorbell names where the client may also leave the request itself (see
/// [`super::shm::Doorbell`]).
pub fn encode_shared_run<'a>(
    request_id: u64,
    session: SessionId,
    feeds: impl IntoIterator<Item = (&'a str, &'a TensorType, u64)>,
    segment: u32,
    areas: SharedAreas,
    fetches: &[String],
) -> Result<Vec<Vec<u8>>, WireError> {
    let (metas, offsets): (Vec<TensorMeta>, Vec<u64>) = feeds
        .into_iter()
        .map(|(name, ty, at)| {
            (
                TensorMeta {
                    name: name.to_string(),
                    ty: ty.clone(),
                },
                at,
            )
        })
        .unzip();
    let body = RequestBody::Run {
        session,
        feeds: metas,
        fetches: fetches.to_vec(),
        shared: Some(SharedFeeds {
            segment,
            offsets,
            reply: areas.reply,
            doorbell: areas.doorbell,
        }),
    };
    Ok(request_frames(header(request_id, &body)?, &[]))
}

/// Encodes a reply into frames.
pub fn encode_reply(request_id: u64, reply: &Reply) -> Result<Vec<Vec<u8>>, WireError> {
    let (body, tensors): (ReplyBody, Vec<Vec<u8>>) = match reply {
        Reply::Hello {
            server,
            version,
            limits,
            desk,
            challenge,
        } => (
            ReplyBody::Hello {
                server: server.clone(),
                version: *version,
                limits: *limits,
                desk: desk.clone(),
                challenge: *challenge,
            },
            Vec::new(),
        ),
        Reply::SessionOpened { session } => {
            (ReplyBody::SessionOpened { session: *session }, Vec::new())
        }
        Reply::GraphLoaded {
            session,
            nodes,
            variables,
            persistent_bytes,
            ephemeral_bytes,
            waiting,
        } => (
            ReplyBody::GraphLoaded {
                session: *session,
                nodes: *nodes,
                variables: *variables,
                persistent_bytes: *persistent_bytes,
                ephemeral_bytes: *ephemeral_bytes,
                waiting: waiting.clone(),
            },
            Vec::new(),
        ),
        Reply::RunDone { outputs } => (
            ReplyBody::RunDone {
                outputs: outputs.iter().map(Tensor::ty).collect(),
            },
            outputs.iter().map(tensor_frame).collect(),
        ),
        Reply::Variables { variables } => (
            ReplyBody::Variables {
                variables: metas(variables),
            },
            variables.iter().map(|t| tensor_frame(&t.tensor)).collect(),
        ),
        Reply::VariablesWritten { count } => {
            (ReplyBody::VariablesWritten { count: *count }, Vec::new())
        }
        Reply::SessionClosed { session } => {
            (ReplyBody::SessionClosed { session: *session }, Vec::new())
        }
        Reply::Status(s) => (ReplyBody::Status(s.clone()), Vec::new()),
        Reply::Error(e) => (
            ReplyBody::Error(ErrorReply {
                code: e.code,
                message: bounded_text(&e.message),
            }),
            Vec::new(),
        ),
        Reply::Ping => (ReplyBody::Ping, Vec::new()),
        Reply::Authenticated { proof } => (ReplyBody::Authenticated { proof: *proof }, Vec::new()),
        Reply::MemoryShared { session, segment } => (
            ReplyBody::MemoryShared {
                session: *session,
                segment: *segment,
            },
            Vec::new(),
        ),
    };
    Ok(reply_frames(
        header(request_id, &body)?,
        tensors.into_iter(),
    ))
}

/// An error reply's frames. Never fails: a message that cannot be encoded
/// is replaced by a fixed one.
/// Longest error text a reply carries (bytes); longer ones are cut.
pub const MAX_ERROR_TEXT: usize = 4096;

/// `text` cut to at most [`MAX_ERROR_TEXT`] bytes (at a character
/// boundary), saying how much was cut: an error about a huge graph (say, a
/// million outputs listed) stays a small reply.
pub fn bounded_text(text: &str) -> String {
    if text.len() <= MAX_ERROR_TEXT {
        return text.to_string();
    }
    let mut end = MAX_ERROR_TEXT - 64;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} more bytes cut)", &text[..end], text.len() - end)
}

pub fn encode_error(request_id: u64, code: ErrorCode, message: &str) -> Vec<Vec<u8>> {
    let reply = Reply::error(code, message);
    encode_reply(request_id, &reply).unwrap_or_else(|_| {
        let mut out = Vec::with_capacity(PREFIX_BYTES);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        out.extend_from_slice(&request_id.to_le_bytes());
        out.extend_from_slice(&(PREFIX_BYTES as u64).to_le_bytes());
        vec![out]
    })
}

/// [`Request::name`] of each body variant, in the order of `RequestBody`
/// (bincode writes a variant as its index).
const REQUEST_NAMES: [&str; 10] = [
    "hello",
    "open_session",
    "load_graph",
    "run",
    "read_variables",
    "write_variables",
    "close_session",
    "status",
    "share_memory",
    "authenticate",
];

/// The [`Request::name`] of the request in a header frame, read from its
/// body's variant tag without decoding the body (a LoadGraph's header
/// carries the whole graph); `None` without the magic or with an unknown
/// tag. Nothing is checked beyond the tag: the request may still be
/// malformed.
pub fn peek_request_name(header: &[u8]) -> Option<&'static str> {
    if header.get(..4)? != MAGIC {
        return None;
    }
    let tag = header.get(PREFIX_BYTES..PREFIX_BYTES + 4)?;
    let tag = u32::from_le_bytes(tag.try_into().ok()?);
    REQUEST_NAMES.get(usize::try_from(tag).ok()?).copied()
}

/// `ReplyBody::RunDone`'s variant index (bincode writes a variant as its
/// index): the tag [`peek_run_done`] looks for.
const RUN_DONE_TAG: u32 = 3;

/// Whether a reply's header frame is a [`Reply::RunDone`] (a Run answered
/// with its outputs), read from its body's variant tag without decoding
/// the body; false without the magic or when too short.
pub fn peek_run_done(header: &[u8]) -> bool {
    if header.get(..4) != Some(&MAGIC[..]) {
        return false;
    }
    header
        .get(PREFIX_BYTES..PREFIX_BYTES + 4)
        .and_then(|t| <[u8; 4]>::try_from(t).ok())
        .is_some_and(|t| u32::from_le_bytes(t) == RUN_DONE_TAG)
}

/// Reads the request id from a header frame's prefix, if it has one with the
/// right magic (whatever its version), so an error can still be matched.
pub fn peek_request_id(header: &[u8]) -> Option<u64> {
    if header.len() < PREFIX_BYTES || header[..4] != MAGIC {
        return None;
    }
    let mut id = [0u8; 8];
    id.copy_from_slice(&header[8..16]);
    Some(u64::from_le_bytes(id))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::wire::decode_reply;

    #[test]
    fn run_done_is_told_from_its_tag() {
        let done = encode_reply(
            5,
            &Reply::RunDone {
                outputs: vec![Tensor::from_f32([1], vec![1.0]).unwrap()],
            },
        )
        .unwrap();
        assert!(peek_run_done(&done[0]));
        assert_eq!(peek_request_id(&done[0]), Some(5));
        let opened = encode_reply(
            6,
            &Reply::SessionOpened {
                session: SessionId(1),
            },
        )
        .unwrap();
        assert!(!peek_run_done(&opened[0]));
        assert!(!peek_run_done(
            &encode_error(7, ErrorCode::Internal, "x")[0]
        ));
        assert!(!peek_run_done(b"LNS"));
    }

    #[test]
    fn error_texts_are_bounded() {
        let long = "é".repeat(10_000);
        let frames = encode_error(3, ErrorCode::InvalidGraph, &long);
        let env = decode_reply(&frames, &Limits::default()).unwrap();
        match env.message {
            Reply::Error(e) => {
                assert!(e.message.len() <= MAX_ERROR_TEXT, "{}", e.message.len());
                assert!(e.message.ends_with("more bytes cut)"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(bounded_text("short"), "short");
    }
}
