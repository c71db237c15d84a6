//! Bounded decoding of requests and replies from their frames: the
//! prefix and the header's frames, the body, then each tensor's part
//! (`frames.rs`) or, for a Run whose feeds are in a shared segment, views
//! of that segment (`slots.rs`). Never panics: every failure is a typed
//! [`DecodeError`].

use std::ops::Deref;

use bincode::Options;

use super::codec::{
    options, peek_request_id, ReplyBody, RequestBody, TensorMeta, HEADER_LEAD_BYTES, MAGIC,
    PREFIX_BYTES,
};
use super::error::{DecodeError, WireError};
use super::frames::{self, Parts};
use super::message::{Reply, Request};
use super::pool::BufferPool;
use super::shm::{self, NoSegments, SegmentLookup};
use super::slots::{take_area, take_shared};
use super::{Envelope, Limits, PROTOCOL_VERSION};
use crate::tensor::TensorType;

/// Checks the frame count and the prefix, gathers the header's frames and
/// decodes its body; the frames after the header are left in the `Parts`.
fn decode_header<'f, B, F>(
    frames: &'f [F],
    limits: &Limits,
) -> Result<(u64, B, Parts<'f, F>), DecodeError>
where
    B: serde::de::DeserializeOwned,
    F: Deref<Target = [u8]>,
{
    let fail = |request_id, error| DecodeError { request_id, error };
    let Some(head) = frames.first() else {
        return Err(fail(None, WireError::Empty));
    };
    let request_id = peek_request_id(head);
    let most = frames::max_message_frames(limits);
    if frames.len() > most {
        return Err(fail(
            request_id,
            WireError::TooManyFrames {
                frames: frames.len(),
                limit: most,
            },
        ));
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
    let mut len = [0u8; 8];
    len.copy_from_slice(&head[16..PREFIX_BYTES]);
    let len = u64::from_le_bytes(len);
    let limit = limits.max_header_bytes.min(limits.max_frame_bytes);
    let len = match usize::try_from(len) {
        Ok(l) if l > limit => {
            return Err(fail(
                request_id,
                WireError::FrameTooLarge {
                    index: 0,
                    bytes: l,
                    limit,
                },
            ))
        }
        Ok(l) if l >= PREFIX_BYTES => l,
        _ => {
            return Err(fail(
                request_id,
                WireError::Malformed {
                    reason: format!(
                        "the prefix gives the header {len} bytes, outside {PREFIX_BYTES}..={limit}"
                    ),
                },
            ))
        }
    };
    // The request's kind is read from the first frame alone (see
    // `peek_request_name`).
    if head.len() < len.min(HEADER_LEAD_BYTES) {
        return Err(fail(
            request_id,
            WireError::PartFrames {
                part: 0,
                expected: len,
                reason: "its first frame is shorter than the prefix and the body's tag",
            },
        ));
    }
    let mut parts = Parts::new(frames);
    let chunks = match parts.take(len) {
        Some(Ok(c)) => c,
        Some(Err(e)) => return Err(fail(request_id, e)),
        None => return Err(fail(request_id, WireError::Empty)),
    };
    // One frame (every header but a large graph's) is read where it lies;
    // several are gathered first (at most the header limit, checked above).
    let joined;
    let bytes: &[u8] = match chunks.as_slice() {
        [one] => one,
        many => {
            joined = many.concat();
            &joined
        }
    };
    let body: B = options()
        .with_limit(limits.max_header_bytes as u64)
        .deserialize(&bytes[PREFIX_BYTES..])
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
    Ok((request_id.unwrap_or(0), body, parts))
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

fn no_tensors<F: Deref<Target = [u8]>>(parts: &Parts<'_, F>) -> Result<(), WireError> {
    frames::no_more(parts, 0)
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
    let (request_id, body, mut rest) = decode_header::<RequestBody<'static>, F>(frames, limits)?;
    let wrap = |error| DecodeError {
        request_id: Some(request_id),
        error,
    };
    let message = match body {
        RequestBody::Hello { client } => {
            no_tensors(&rest).map_err(wrap)?;
            Request::Hello { client }
        }
        RequestBody::OpenSession(spec) => {
            no_tensors(&rest).map_err(wrap)?;
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
                variables: frames::take_tensors(variables, &mut rest, limits, pool)
                    .map_err(wrap)?,
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
                feeds: frames::take_tensors(feeds, &mut rest, limits, pool).map_err(wrap)?,
                fetches,
            }
        }
        RequestBody::Run {
            session,
            feeds,
            fetches,
            shared: Some(shared),
        } => {
            no_tensors(&rest).map_err(wrap)?;
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
            no_tensors(&rest).map_err(wrap)?;
            Request::ReadVariables { session, names }
        }
        RequestBody::WriteVariables { session, variables } => Request::WriteVariables {
            session,
            variables: frames::take_tensors(variables, &mut rest, limits, pool).map_err(wrap)?,
        },
        RequestBody::CloseSession { session } => {
            no_tensors(&rest).map_err(wrap)?;
            Request::CloseSession { session }
        }
        RequestBody::Status => {
            no_tensors(&rest).map_err(wrap)?;
            Request::Status
        }
        RequestBody::Authenticate { nonce, proof } => {
            no_tensors(&rest).map_err(wrap)?;
            Request::Authenticate { nonce, proof }
        }
        RequestBody::ShareMemory { session, offer } => {
            no_tensors(&rest).map_err(wrap)?;
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
    let (request_id, body, mut rest) = decode_header::<ReplyBody, F>(frames, limits)?;
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
            let ts = frames::take_tensors(metas, &mut rest, limits, pool).map_err(wrap)?;
            Reply::RunDone {
                outputs: ts.into_iter().map(|t| t.tensor).collect(),
            }
        }
        ReplyBody::Variables { variables } => Reply::Variables {
            variables: frames::take_tensors(variables, &mut rest, limits, pool).map_err(wrap)?,
        },
        other => {
            no_tensors(&rest).map_err(wrap)?;
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
    use crate::wire::ErrorCode;

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
}
