//! Encoding and bounded decoding of messages into frames.
//!
//! Frame 0 is the header: 4 magic bytes `LNS\0`, the protocol version (u32
//! LE), the request id (u64 LE), then the body in bincode (fixed-width
//! integers, little endian, decoding bounded by `Limits::max_header_bytes`).
//! Frames 1.. are the raw little-endian values of the tensors the body
//! announces (name and type in the body, values in the frame, in order).

use super::auth::AUTH_BYTES;
use super::error::{DecodeError, ErrorCode, WireError};
use super::message::{
    ErrorReply, NamedTensor, Reply, Request, SessionId, SessionSpec, StatusReport,
};
use super::pool::BufferPool;
use super::shm::{self, NoSegments, OwnedSegment, SegmentLookup, SegmentOffer};
use super::{Limits, PROTOCOL_VERSION};
use crate::graph::Graph;
use crate::tensor::{DType, Tensor, TensorData, TensorError, TensorType};
use bincode::Options;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::ops::Deref;
use std::sync::OnceLock;

/// First bytes of every header frame.
pub const MAGIC: [u8; 4] = *b"LNS\0";
/// Bytes before the bincode body: magic, version, request id.
pub const PREFIX_BYTES: usize = 16;

/// Name and type of a tensor whose values travel in their own frame.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct TensorMeta {
    name: String,
    ty: TensorType,
}

#[derive(Debug, Serialize, Deserialize)]
enum RequestBody<'a> {
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
struct SharedFeeds {
    segment: u32,
    offsets: Vec<u64>,
    reply: Option<SlotRange>,
    doorbell: Option<SlotRange>,
}

/// The reply slot and doorbell a shared Run names, if any.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedAreas {
    pub reply: Option<SlotRange>,
    pub doorbell: Option<SlotRange>,
}

/// A reply slot's or a doorbell's place in a segment (see
/// [`shm::ReplySlot`], [`shm::Doorbell`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotRange {
    pub offset: u64,
    pub bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
enum ReplyBody {
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

fn options() -> impl Options {
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
    options()
        .serialize_into(&mut out, body)
        .map_err(|e| WireError::Encode {
            reason: e.to_string(),
        })?;
    Ok(out)
}

/// Frames at least this large are copied by several threads.
const PARALLEL_COPY_BYTES: usize = 4 << 20;
/// Bytes each copying thread gets at least, and most threads per copy.
const BYTES_PER_COPY_THREAD: usize = 2 << 20;
const MAX_COPY_THREADS: usize = 4;

fn copy_threads(bytes: usize) -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if bytes < PARALLEL_COPY_BYTES {
        1
    } else {
        (bytes / BYTES_PER_COPY_THREAD).clamp(1, cores.min(MAX_COPY_THREADS))
    }
}

/// `dst.copy_from_slice(src)`, split over a few scoped threads when large:
/// a large destination is often fresh memory, and its page faults as well
/// as the copy then proceed in parallel.
fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    let threads = copy_threads(src.len());
    if threads <= 1 || dst.len() != src.len() {
        dst.copy_from_slice(src);
        return;
    }
    let chunk = src.len().div_ceil(threads);
    std::thread::scope(|scope| {
        let mut parts = dst.chunks_mut(chunk).zip(src.chunks(chunk));
        let first = parts.next();
        for (d, s) in parts {
            scope.spawn(move || d.copy_from_slice(s));
        }
        if let Some((d, s)) = first {
            d.copy_from_slice(s);
        }
    });
}

/// A copy of `bytes` in a new vector.
fn bytes_to_vec(bytes: &[u8]) -> Vec<u8> {
    if copy_threads(bytes.len()) <= 1 {
        return bytes.to_vec();
    }
    let mut out = vec![0u8; bytes.len()];
    copy_bytes(&mut out, bytes);
    out
}

/// A tensor's values as one little-endian frame.
pub fn tensor_frame(t: &Tensor) -> Vec<u8> {
    #[cfg(target_endian = "little")]
    {
        match t.data() {
            TensorData::F32(v) => bytes_to_vec(bytemuck::cast_slice::<f32, u8>(v)),
            TensorData::I64(v) => bytes_to_vec(bytemuck::cast_slice::<i64, u8>(v)),
        }
    }
    #[cfg(not(target_endian = "little"))]
    {
        t.to_le_bytes()
    }
}

/// Rebuilds a tensor from its type and a little-endian frame (one copy into
/// aligned memory; no per-element decoding on little-endian hosts).
pub fn tensor_from_frame(ty: &TensorType, bytes: &[u8]) -> Result<Tensor, TensorError> {
    tensor_from_frame_in(ty, bytes, None)
}

/// [`tensor_from_frame`] into storage from `pool` when it has a buffer that
/// fits (the one copy then writes into memory already mapped).
pub fn tensor_from_frame_in(
    ty: &TensorType,
    bytes: &[u8],
    pool: Option<&BufferPool>,
) -> Result<Tensor, TensorError> {
    let expected = ty.checked_bytes().ok_or_else(|| TensorError::Overflow {
        shape: ty.shape.clone(),
    })?;
    if expected != bytes.len() {
        return Err(TensorError::Bytes {
            ty: ty.clone(),
            expected,
            got: bytes.len(),
        });
    }
    #[cfg(target_endian = "little")]
    {
        let data = match ty.dtype {
            DType::F32 => {
                let len = bytes.len() / 4;
                let mut v = pool.map_or_else(|| vec![0.0; len], |p| p.f32s(len));
                copy_bytes(bytemuck::cast_slice_mut::<f32, u8>(&mut v), bytes);
                TensorData::F32(v)
            }
            DType::I64 => {
                let len = bytes.len() / 8;
                let mut v = pool.map_or_else(|| vec![0; len], |p| p.i64s(len));
                copy_bytes(bytemuck::cast_slice_mut::<i64, u8>(&mut v), bytes);
                TensorData::I64(v)
            }
        };
        Tensor::new(ty.shape.clone(), data)
    }
    #[cfg(not(target_endian = "little"))]
    {
        let _ = pool;
        Tensor::from_le_bytes(ty, bytes)
    }
}

fn frames_of(header: Vec<u8>, tensors: impl Iterator<Item = Vec<u8>>) -> Vec<Vec<u8>> {
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
        return Ok(vec![header(request_id, &body)?]);
    }
    let named = |ts: &[NamedTensor]| {
        ts.iter()
            .map(|t| tensor_frame(&t.tensor))
            .collect::<Vec<_>>()
    };
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
    Ok(frames_of(header(request_id, &body)?, tensors.into_iter()))
}

/// A Run whose feeds' values are already in the session's segment
/// `segment` (attached with a ShareMemory request), each `(name, type,
/// offset)`: only the header travels. A job that writes its inputs into the
/// segment in place (the client's feed buffers) sends each iteration so.
/// With a reply slot, the service also writes the fetched tensors into
/// that slot of the segment (see [`shm::ReplySlot`], [`read_slot`]); a
/// doorbell names where the client may also leave the request itself (see
/// [`shm::Doorbell`]).
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
    Ok(vec![header(request_id, &body)?])
}

/// Writes the feeds' values into `seg` (packed by [`shm::layout`]) and
/// returns their offsets.
fn write_shared(feeds: &[NamedTensor], seg: &mut OwnedSegment) -> Result<Vec<u64>, WireError> {
    let sizes: Vec<usize> = feeds.iter().map(|f| f.tensor.ty().bytes()).collect();
    let room = seg.len();
    let (offsets, _) = shm::layout(sizes.iter().copied())
        .filter(|(_, end)| *end <= room)
        .ok_or_else(|| WireError::Encode {
            reason: format!("the feeds do not fit the shared segment of {room} bytes"),
        })?;
    let bytes = seg.bytes_mut();
    for ((f, &at), &len) in feeds.iter().zip(&offsets).zip(&sizes) {
        let at = at as usize;
        write_tensor(&mut bytes[at..at + len], &f.tensor);
    }
    Ok(offsets)
}

/// Copies a tensor's values into `dst` (exactly its bytes) little-endian.
fn write_tensor(dst: &mut [u8], t: &Tensor) {
    match t.data() {
        TensorData::F32(v) => {
            write_le(dst, bytemuck::cast_slice::<f32, u8>(v), v, f32::to_le_bytes)
        }
        TensorData::I64(v) => {
            write_le(dst, bytemuck::cast_slice::<i64, u8>(v), v, i64::to_le_bytes)
        }
    }
}

/// Copies values into `dst` little-endian (one memory copy on
/// little-endian hosts).
fn write_le<T: Copy, const N: usize>(
    dst: &mut [u8],
    raw: &[u8],
    values: &[T],
    le: fn(T) -> [u8; N],
) {
    if cfg!(target_endian = "little") {
        copy_bytes(dst, raw);
    } else {
        for (d, v) in dst.chunks_exact_mut(N).zip(values) {
            d.copy_from_slice(&le(*v));
        }
    }
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
    Ok(frames_of(header(request_id, &body)?, tensors.into_iter()))
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

/// Checks frame count and sizes, the prefix, and decodes the body.
fn decode_header<'f, B, F>(
    frames: &'f [F],
    limits: &Limits,
) -> Result<(u64, B, &'f [F]), DecodeError>
where
    B: serde::de::DeserializeOwned,
    F: Deref<Target = [u8]>,
{
    let fail = |request_id, error| DecodeError { request_id, error };
    let Some((head, rest)) = frames.split_first() else {
        return Err(fail(None, WireError::Empty));
    };
    let request_id = peek_request_id(head);
    if frames.len() > limits.max_frames {
        return Err(fail(
            request_id,
            WireError::TooManyFrames {
                frames: frames.len(),
                limit: limits.max_frames,
            },
        ));
    }
    for (index, f) in frames.iter().enumerate() {
        let limit = if index == 0 {
            limits.max_header_bytes.min(limits.max_frame_bytes)
        } else {
            limits.max_frame_bytes
        };
        if f.len() > limit {
            return Err(fail(
                request_id,
                WireError::FrameTooLarge {
                    index,
                    bytes: f.len(),
                    limit,
                },
            ));
        }
    }
    if head.len() < PREFIX_BYTES {
        let error = if head.len() >= 4 && head[..4] == MAGIC {
            WireError::ShortHeader {
                bytes: head.len(),
                needed: PREFIX_BYTES,
            }
        } else {
            WireError::BadMagic
        };
        return Err(fail(None, error));
    }
    if head[..4] != MAGIC {
        return Err(fail(None, WireError::BadMagic));
    }
    let mut v = [0u8; 4];
    v.copy_from_slice(&head[4..8]);
    let version = u32::from_le_bytes(v);
    if version != PROTOCOL_VERSION {
        return Err(fail(
            request_id,
            WireError::VersionMismatch {
                got: version,
                supported: PROTOCOL_VERSION,
            },
        ));
    }
    let body: B = options()
        .with_limit(limits.max_header_bytes as u64)
        .deserialize(&head[PREFIX_BYTES..])
        .map_err(|e| {
            let error = match *e {
                bincode::ErrorKind::Io(ref io)
                    if io.kind() == std::io::ErrorKind::UnexpectedEof =>
                {
                    WireError::TruncatedHeader {
                        reason: e.to_string(),
                    }
                }
                _ => WireError::Malformed {
                    reason: e.to_string(),
                },
            };
            fail(request_id, error)
        })?;
    Ok((request_id.unwrap_or(0), body, rest))
}

/// Pairs tensor metadata with the tensor frames, checking count, size limit
/// and byte length of each.
fn take_tensors<F: Deref<Target = [u8]>>(
    metas: Vec<TensorMeta>,
    frames: &[F],
    limits: &Limits,
    pool: Option<&BufferPool>,
) -> Result<Vec<NamedTensor>, WireError> {
    if metas.len() != frames.len() {
        return Err(WireError::FrameCount {
            expected: metas.len(),
            got: frames.len(),
        });
    }
    metas
        .into_iter()
        .zip(frames)
        .map(|(m, f)| {
            checked_len(&m, limits)?;
            named_from(m, f, pool)
        })
        .collect()
}

/// The byte length of the tensor `m` announces, within the tensor limit.
fn checked_len(m: &TensorMeta, limits: &Limits) -> Result<usize, WireError> {
    m.ty.checked_bytes()
        .filter(|b| *b <= limits.max_tensor_bytes)
        .ok_or_else(|| WireError::TensorTooLarge {
            name: m.name.clone(),
            ty: m.ty.clone(),
            limit: limits.max_tensor_bytes,
        })
}

/// The tensor `m` announces, its values from `bytes`.
fn named_from(
    m: TensorMeta,
    bytes: &[u8],
    pool: Option<&BufferPool>,
) -> Result<NamedTensor, WireError> {
    match tensor_from_frame_in(&m.ty, bytes, pool) {
        Ok(tensor) => Ok(NamedTensor {
            name: m.name,
            tensor,
        }),
        Err(source) => Err(WireError::TensorBytes {
            name: m.name,
            source,
        }),
    }
}

/// A Run's reply carries one frame per fetch after its header: more
/// fetches than `max_frames − 1` could never be answered, and each costs
/// the service a look-up in the graph, so they are refused from the header.
fn check_fetch_count(fetches: &[String], limits: &Limits) -> Result<(), WireError> {
    if fetches.len() >= limits.max_frames {
        return Err(WireError::TooManyFrames {
            frames: fetches.len() + 1,
            limit: limits.max_frames,
        });
    }
    Ok(())
}

/// A Run's feeds in a shared segment at `offsets`, each range checked
/// against the segment and the tensor limit, the ranges pairwise disjoint
/// and under distinct names. Nothing is copied: the feeds are views of the
/// segment, read by the worker that runs the iteration.
fn take_shared(
    metas: Vec<TensorMeta>,
    offsets: &[u64],
    segment_id: u32,
    seg: &std::sync::Arc<shm::AttachedSegment>,
    limits: &Limits,
) -> Result<Vec<shm::SharedFeed>, WireError> {
    if metas.len() != offsets.len() {
        return Err(WireError::SharedMemory {
            reason: format!(
                "{} feeds but {} offsets in the segment",
                metas.len(),
                offsets.len()
            ),
        });
    }
    let seg_len = seg.bytes().len();
    let mut ranges = Vec::with_capacity(metas.len());
    for (m, &at) in metas.iter().zip(offsets) {
        let len = checked_len(m, limits)?;
        let range = usize::try_from(at)
            .ok()
            .filter(|a| *a >= shm::SEGMENT_HEADER)
            .and_then(|a| Some(a..a.checked_add(len)?))
            .filter(|r| r.end <= seg_len);
        let Some(range) = range else {
            return Err(WireError::SharedMemory {
                reason: format!(
                    "feed `{}` ({len} bytes at offset {at}) is outside the segment's {} data bytes",
                    m.name,
                    seg_len.saturating_sub(shm::SEGMENT_HEADER)
                ),
            });
        };
        ranges.push(range);
    }
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| (ranges[i].start, ranges[i].end));
    for w in order.windows(2) {
        let (a, b) = (&ranges[w[0]], &ranges[w[1]]);
        if b.start < a.end && !a.is_empty() && !b.is_empty() {
            return Err(WireError::SharedMemory {
                reason: format!(
                    "feeds `{}` and `{}` overlap in the segment",
                    metas[w[0]].name, metas[w[1]].name
                ),
            });
        }
    }
    let mut names: Vec<&str> = metas.iter().map(|m| m.name.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(WireError::SharedMemory {
            reason: format!("feed `{}` is listed twice", w[0]),
        });
    }
    metas
        .into_iter()
        .zip(ranges)
        .map(|(m, range)| {
            let name = m.name.clone();
            shm::SharedFeed::new(m.name, m.ty, segment_id, range.start, seg.clone()).ok_or_else(
                || WireError::SharedMemory {
                    reason: format!("feed `{name}` is outside the segment"),
                },
            )
        })
        .collect()
}

/// A Run's reply slot or doorbell (`what`) at `r`, made by `make`: inside
/// the segment past its header, aligned, at least `min` bytes long, and
/// disjoint from every feed of the Run and from `other` (the other area).
fn take_area<A>(
    what: &str,
    r: SlotRange,
    min: usize,
    feeds: &[shm::SharedFeed],
    other: Option<std::ops::Range<usize>>,
    make: impl FnOnce(usize, usize) -> Option<(A, std::ops::Range<usize>)>,
    seg_len: usize,
) -> Result<A, WireError> {
    let bad = |why: &str| WireError::SharedMemory {
        reason: format!(
            "the {what} of {} bytes at offset {} {why}",
            r.bytes, r.offset
        ),
    };
    let (Ok(offset), Ok(bytes)) = (usize::try_from(r.offset), usize::try_from(r.bytes)) else {
        return Err(bad("is outside the segment"));
    };
    let (area, range) = make(offset, bytes).ok_or_else(|| {
        bad(&format!(
            "is not inside the segment's {seg_len} bytes past its {}-byte header, at a multiple of {}, at least {min} bytes",
            shm::SEGMENT_HEADER,
            shm::FEED_ALIGN,
        ))
    })?;
    if let Some(f) = feeds.iter().find(|f| {
        let len = f.ty.bytes();
        len > 0 && f.offset() < range.end && range.start < f.offset() + len
    }) {
        return Err(bad(&format!("overlaps feed `{}`", f.name)));
    }
    if other.is_some_and(|o| o.start < range.end && range.start < o.end) {
        return Err(bad("overlaps the Run's other shared area"));
    }
    Ok(area)
}

/// Writes `outputs` into `slot` as Run `seq`'s answer (see
/// [`shm::ReplySlot::post`]); whether they are there (`false`: they go in
/// the socket reply).
pub fn post_outputs(slot: &shm::ReplySlot, seq: u64, outputs: &[Tensor]) -> bool {
    let types: Vec<TensorType> = outputs.iter().map(Tensor::ty).collect();
    let Ok(table) = options().serialize(&types) else {
        return false;
    };
    let Some((offsets, need)) = slot_layout(table.len(), outputs.iter().map(|t| t.ty().bytes()))
    else {
        return false;
    };
    slot.post(seq, need, table.len(), |body| {
        // `body` starts at the slot's header end; offsets are the slot's.
        let at = |o: usize| o - shm::REPLY_HEADER;
        body[..table.len()].copy_from_slice(&table);
        for (t, o) in outputs.iter().zip(offsets) {
            let o = at(o as usize);
            write_tensor(&mut body[o..o + t.ty().bytes()], t);
        }
    })
}

/// Offsets (from the slot's start) of values of `sizes` bytes after a
/// table of `table` bytes, packed as a segment's feeds are, and the bytes
/// the slot then needs.
fn slot_layout(table: usize, sizes: impl IntoIterator<Item = usize>) -> Option<(Vec<u64>, usize)> {
    let start = shm::REPLY_HEADER
        .checked_add(table)?
        .checked_next_multiple_of(shm::FEED_ALIGN)?;
    shm::layout_from(start, sizes)
}

/// What a reply slot holds for one Run (see [`read_slot`]).
#[derive(Debug, Clone, PartialEq)]
pub enum SlotRead {
    /// Not answered here (yet): the sequence word names another Run.
    NotYet,
    /// The Run's outputs.
    Here(Vec<Tensor>),
    /// Its outputs travel in the socket reply; the slot would need `need`
    /// bytes.
    OnSocket { need: u64 },
}

/// Reads Run `seq`'s answer from the slot whose bytes are `slot` (header
/// included), given its sequence word `word` as read with acquire ordering.
/// The table and every range are checked against the slot and `limits`.
pub fn read_slot(slot: &[u8], word: u64, seq: u64, limits: &Limits) -> Result<SlotRead, WireError> {
    if word != seq {
        return Ok(SlotRead::NotYet);
    }
    let bad = |reason: String| WireError::SharedMemory { reason };
    let header = slot
        .get(..shm::REPLY_HEADER)
        .ok_or_else(|| bad("the reply slot is shorter than its header".into()))?;
    let u32_at =
        |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
    let mut need = [0u8; 8];
    need.copy_from_slice(&header[16..24]);
    let need = u64::from_le_bytes(need);
    match u32_at(8) {
        shm::SLOT_HERE => {}
        shm::SLOT_ON_SOCKET => return Ok(SlotRead::OnSocket { need }),
        other => return Err(bad(format!("the reply slot's status is {other}"))),
    }
    let table_len = u32_at(12) as usize;
    let table = slot
        .get(shm::REPLY_HEADER..shm::REPLY_HEADER.saturating_add(table_len))
        .ok_or_else(|| {
            bad(format!(
                "the reply slot's table of {table_len} bytes is outside it"
            ))
        })?;
    let types: Vec<TensorType> = options()
        .with_limit(table_len as u64)
        .deserialize(table)
        .map_err(|e| bad(format!("the reply slot's table: {e}")))?;
    if types.len() > limits.max_frames {
        return Err(bad(format!(
            "the reply slot names {} outputs, more than {}",
            types.len(),
            limits.max_frames
        )));
    }
    let mut sizes = Vec::with_capacity(types.len());
    for (i, ty) in types.iter().enumerate() {
        let m = TensorMeta {
            name: format!("output {i}"),
            ty: ty.clone(),
        };
        sizes.push(checked_len(&m, limits)?);
    }
    let (offsets, _) = slot_layout(table_len, sizes.iter().copied())
        .ok_or_else(|| bad("the reply slot's outputs overflow".into()))?;
    types
        .into_iter()
        .zip(offsets.into_iter().zip(sizes))
        .map(|(ty, (at, len))| {
            let at = usize::try_from(at).unwrap_or(usize::MAX);
            let bytes = slot
                .get(at..at.saturating_add(len))
                .ok_or_else(|| bad(format!("output {ty} lies outside the reply slot")))?;
            tensor_from_frame_in(&ty, bytes, None).map_err(|e| bad(e.to_string()))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(SlotRead::Here)
}

/// A Run's feeds against the session's placeholders, when known: each a
/// placeholder of that type, none twice. Checked from the header alone,
/// before any tensor is copied, so a Run of feeds the graph does not take
/// costs no more than its frames.
fn check_feeds(
    metas: &[TensorMeta],
    types: Option<&std::collections::BTreeMap<String, TensorType>>,
) -> Result<(), WireError> {
    let Some(types) = types else {
        return Ok(());
    };
    let mut seen = std::collections::HashSet::with_capacity(metas.len());
    for m in metas {
        let bad = |reason: String| WireError::Feed {
            name: m.name.clone(),
            reason,
        };
        match types.get(&m.name) {
            None => return Err(bad("the graph has no such placeholder".into())),
            Some(t) if *t != m.ty => {
                return Err(bad(format!("expected {t}, got {}", m.ty)));
            }
            Some(_) => {}
        }
        if !seen.insert(m.name.as_str()) {
            return Err(bad("fed twice".into()));
        }
    }
    Ok(())
}

fn no_tensors<F>(frames: &[F]) -> Result<(), WireError> {
    if frames.is_empty() {
        Ok(())
    } else {
        Err(WireError::FrameCount {
            expected: 0,
            got: frames.len(),
        })
    }
}

/// Decodes a request from its frames, within `limits`. Never panics.
pub fn decode_request<F: Deref<Target = [u8]>>(
    frames: &[F],
    limits: &Limits,
) -> Result<Envelope<Request>, DecodeError> {
    decode_request_in(frames, limits, None)
}

/// [`decode_request`], taking the storage of the tensors it carries from
/// `pool` where a buffer fits.
pub fn decode_request_in<F: Deref<Target = [u8]>>(
    frames: &[F],
    limits: &Limits,
    pool: Option<&BufferPool>,
) -> Result<Envelope<Request>, DecodeError> {
    decode_request_with(frames, limits, pool, &NoSegments)
}

/// [`decode_request_in`], reading the feeds of a Run that names a
/// shared-memory segment from the segment `segments` finds.
pub fn decode_request_with<F: Deref<Target = [u8]>>(
    frames: &[F],
    limits: &Limits,
    pool: Option<&BufferPool>,
    segments: &dyn SegmentLookup,
) -> Result<Envelope<Request>, DecodeError> {
    let (request_id, body, rest) = decode_header::<RequestBody<'static>, F>(frames, limits)?;
    let wrap = |error| DecodeError {
        request_id: Some(request_id),
        error,
    };
    let message = match body {
        RequestBody::Hello { client } => {
            no_tensors(rest).map_err(wrap)?;
            Request::Hello { client }
        }
        RequestBody::OpenSession(spec) => {
            no_tensors(rest).map_err(wrap)?;
            Request::OpenSession(spec)
        }
        RequestBody::LoadGraph {
            session,
            graph,
            variables,
        } => {
            if graph.nodes.len() > limits.max_nodes {
                return Err(wrap(WireError::Malformed {
                    reason: format!(
                        "graph has {} nodes, more than the limit of {}",
                        graph.nodes.len(),
                        limits.max_nodes
                    ),
                }));
            }
            Request::LoadGraph {
                session,
                graph: graph.into_owned(),
                variables: take_tensors(variables, rest, limits, pool).map_err(wrap)?,
            }
        }
        RequestBody::Run {
            session,
            feeds,
            fetches,
            shared: None,
        } => {
            check_fetch_count(&fetches, limits).map_err(wrap)?;
            check_feeds(&feeds, segments.feed_types(session)).map_err(wrap)?;
            Request::Run {
                session,
                feeds: take_tensors(feeds, rest, limits, pool).map_err(wrap)?,
                fetches,
            }
        }
        RequestBody::Run {
            session,
            feeds,
            fetches,
            shared: Some(shared),
        } => {
            no_tensors(rest).map_err(wrap)?;
            check_fetch_count(&fetches, limits).map_err(wrap)?;
            check_feeds(&feeds, segments.feed_types(session)).map_err(wrap)?;
            let seg = segments.segment(session, shared.segment).ok_or_else(|| {
                wrap(WireError::SharedMemory {
                    reason: format!(
                        "segment {} is not attached to session {session} on this connection",
                        shared.segment
                    ),
                })
            })?;
            let feeds =
                take_shared(feeds, &shared.offsets, shared.segment, seg, limits).map_err(wrap)?;
            let (id, len) = (shared.segment, seg.bytes().len());
            let reply = match shared.reply {
                Some(r) => Some(
                    take_area(
                        "reply slot",
                        r,
                        shm::REPLY_HEADER,
                        &feeds,
                        None,
                        |o, b| {
                            let a = shm::ReplySlot::new(seg.clone(), id, o, b)?;
                            Some((a.clone(), a.range()))
                        },
                        len,
                    )
                    .map_err(wrap)?,
                ),
                None => None,
            };
            let doorbell = match shared.doorbell {
                Some(r) if r.bytes > limits.max_doorbell_bytes as u64 => {
                    return Err(wrap(WireError::SharedMemory {
                        reason: format!(
                            "the doorbell of {} bytes is larger than this service's {} (max_doorbell_bytes, announced at Hello)",
                            r.bytes, limits.max_doorbell_bytes
                        ),
                    }))
                }
                Some(r) => Some(
                    take_area(
                        "doorbell",
                        r,
                        shm::DOORBELL_HEADER,
                        &feeds,
                        reply.as_ref().map(shm::ReplySlot::range),
                        |o, b| {
                            let a = shm::Doorbell::new(seg.clone(), id, o, b)?;
                            Some((a.clone(), a.range()))
                        },
                        len,
                    )
                    .map_err(wrap)?,
                ),
                None => None,
            };
            Request::RunShared {
                session,
                feeds,
                fetches,
                reply,
                doorbell,
            }
        }
        RequestBody::ReadVariables { session, names } => {
            no_tensors(rest).map_err(wrap)?;
            Request::ReadVariables { session, names }
        }
        RequestBody::WriteVariables { session, variables } => Request::WriteVariables {
            session,
            variables: take_tensors(variables, rest, limits, pool).map_err(wrap)?,
        },
        RequestBody::CloseSession { session } => {
            no_tensors(rest).map_err(wrap)?;
            Request::CloseSession { session }
        }
        RequestBody::Status => {
            no_tensors(rest).map_err(wrap)?;
            Request::Status
        }
        RequestBody::Authenticate { nonce, proof } => {
            no_tensors(rest).map_err(wrap)?;
            Request::Authenticate { nonce, proof }
        }
        RequestBody::ShareMemory { session, offer } => {
            no_tensors(rest).map_err(wrap)?;
            Request::ShareMemory { session, offer }
        }
    };
    Ok(Envelope {
        request_id,
        message,
    })
}

/// Decodes a reply from its frames, within `limits`. Never panics.
pub fn decode_reply<F: Deref<Target = [u8]>>(
    frames: &[F],
    limits: &Limits,
) -> Result<Envelope<Reply>, DecodeError> {
    decode_reply_in(frames, limits, None)
}

/// [`decode_reply`], taking the storage of the tensors it carries from
/// `pool` where a buffer fits.
pub fn decode_reply_in<F: Deref<Target = [u8]>>(
    frames: &[F],
    limits: &Limits,
    pool: Option<&BufferPool>,
) -> Result<Envelope<Reply>, DecodeError> {
    let (request_id, body, rest) = decode_header::<ReplyBody, F>(frames, limits)?;
    let wrap = |error| DecodeError {
        request_id: Some(request_id),
        error,
    };
    let message = match body {
        ReplyBody::RunDone { outputs } => {
            let metas = outputs
                .into_iter()
                .enumerate()
                .map(|(i, ty)| TensorMeta {
                    name: format!("output {i}"),
                    ty,
                })
                .collect();
            let ts = take_tensors(metas, rest, limits, pool).map_err(wrap)?;
            Reply::RunDone {
                outputs: ts.into_iter().map(|t| t.tensor).collect(),
            }
        }
        ReplyBody::Variables { variables } => Reply::Variables {
            variables: take_tensors(variables, rest, limits, pool).map_err(wrap)?,
        },
        other => {
            no_tensors(rest).map_err(wrap)?;
            match other {
                ReplyBody::Hello {
                    server,
                    version,
                    limits,
                    desk,
                    challenge,
                } => Reply::Hello {
                    server,
                    version,
                    limits,
                    desk,
                    challenge,
                },
                ReplyBody::SessionOpened { session } => Reply::SessionOpened { session },
                ReplyBody::GraphLoaded {
                    session,
                    nodes,
                    variables,
                    persistent_bytes,
                    ephemeral_bytes,
                    waiting,
                } => Reply::GraphLoaded {
                    session,
                    nodes,
                    variables,
                    persistent_bytes,
                    ephemeral_bytes,
                    waiting,
                },
                ReplyBody::VariablesWritten { count } => Reply::VariablesWritten { count },
                ReplyBody::SessionClosed { session } => Reply::SessionClosed { session },
                ReplyBody::Status(s) => Reply::Status(s),
                ReplyBody::Error(e) => Reply::Error(e),
                ReplyBody::MemoryShared { session, segment } => {
                    Reply::MemoryShared { session, segment }
                }
                ReplyBody::Ping => Reply::Ping,
                ReplyBody::Authenticated { proof } => Reply::Authenticated { proof },
                ReplyBody::RunDone { .. } | ReplyBody::Variables { .. } => {
                    return Err(wrap(WireError::Malformed {
                        reason: "unreachable reply body".into(),
                    }))
                }
            }
        }
    };
    Ok(Envelope {
        request_id,
        message,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn meta(name: &str, n: usize) -> TensorMeta {
        TensorMeta {
            name: name.into(),
            ty: TensorType::f32([n]),
        }
    }

    /// A Run's feeds are checked against the session's placeholders from
    /// the header alone: unknown names, wrong types and repeats are BadFeed.
    #[test]
    fn feeds_are_checked_against_the_placeholders() {
        let types: std::collections::BTreeMap<String, TensorType> =
            [("x".to_string(), TensorType::f32([4]))].into();
        assert!(check_feeds(&[meta("x", 4)], Some(&types)).is_ok());
        assert!(check_feeds(&[meta("nope", 4)], None).is_ok());
        for metas in [
            vec![meta("nope", 4)],
            vec![meta("x", 5)],
            vec![meta("x", 4), meta("x", 4)],
        ] {
            let e = check_feeds(&metas, Some(&types)).unwrap_err();
            assert_eq!(e.code(), ErrorCode::BadFeed, "{e}");
        }
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

    /// Shared feeds are checked as a whole before any is copied: feeds
    /// that overlap (a few bytes of header naming one range many times
    /// would copy it that many times) or share a name are refused.
    #[cfg(target_os = "linux")]
    #[test]
    fn shared_feeds_must_be_disjoint_and_distinct() {
        let (_own, seg) = shm::attached_pair(1, shm::SEGMENT_HEADER + 1024);
        let l = Limits::default();
        let at = shm::SEGMENT_HEADER as u64;
        let ok = take_shared(
            vec![meta("a", 64), meta("b", 64)],
            &[at, at + 256],
            1,
            &seg,
            &l,
        )
        .unwrap();
        assert_eq!(ok.len(), 2);
        assert_eq!(
            (ok[1].offset(), ok[1].bytes().len()),
            (at as usize + 256, 256)
        );
        for (metas, offsets) in [
            (vec![meta("a", 64), meta("b", 64)], vec![at, at]),
            (vec![meta("a", 64), meta("b", 64)], vec![at, at + 128]),
            (vec![meta("a", 8), meta("a", 8)], vec![at, at + 512]),
            (vec![meta("a", 64)], vec![at - 1]),
            (vec![meta("a", 64)], vec![at + 1024 - 255]),
        ] {
            let e = take_shared(metas, &offsets, 1, &seg, &l).unwrap_err();
            assert!(matches!(e, WireError::SharedMemory { .. }), "{e}");
        }
    }
}
