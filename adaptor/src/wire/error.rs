//! Errors of the wire layer and the stable numeric codes every error reply
//! carries.

use crate::tensor::{TensorError, TensorType};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Stable numeric code of an error reply. Codes are never reused or
/// renumbered; new ones are appended. A code a client does not know decodes
/// as [`ErrorCode::Unknown`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "u16", into = "u16")]
pub enum ErrorCode {
    /// Bytes that are not a Lanes message (bad magic, undecodable header).
    Malformed,
    /// A message cut short: missing tensor frames or a frame shorter than its type says.
    Truncated,
    /// A frame larger than the service's frame limit.
    FrameTooLarge,
    /// The header's protocol version is not the service's.
    VersionMismatch,
    /// More frames in one message than the limit.
    TooManyFrames,
    /// A tensor larger than the per-tensor limit.
    TensorTooLarge,
    /// The session id names no open session of this connection.
    UnknownSession,
    /// The graph failed validation.
    InvalidGraph,
    /// The session has no graph loaded yet.
    NoGraph,
    /// The session already has a graph.
    GraphAlreadyLoaded,
    /// A feed is missing, unknown, or has the wrong dtype or shape.
    BadFeed,
    /// A fetch names no output of the graph.
    UnknownFetch,
    /// A variable is missing, unknown, or has the wrong dtype or shape.
    BadVariable,
    /// An op failed while running an iteration.
    Exec,
    /// The requested device is not available.
    NoDevice,
    /// The request is well formed but not acceptable here (e.g. an empty job name).
    BadRequest,
    /// The service is shutting down.
    ShuttingDown,
    /// The service is at its session or queue limit.
    Overloaded,
    /// A bug in the service; the message says where.
    Internal,
    /// The job's memory (P + T) exceeds the service's whole reservation.
    MemoryTooLarge,
    /// A shared-memory segment could not be attached, or a Run names one
    /// that is not attached or reads outside it.
    SharedMemory,
    /// A Run's fetched outputs take more bytes than the memory its job was
    /// admitted with (P + T): the reply would cost the service more than
    /// the job is allowed.
    FetchTooLarge,
    /// The service authenticates its peers and this connection has not
    /// authenticated (or its proof was wrong).
    Unauthenticated,
    /// A code this client does not know (sent by a newer service).
    Unknown(u16),
}

impl ErrorCode {
    /// The number on the wire.
    pub fn as_u16(self) -> u16 {
        match self {
            ErrorCode::Malformed => 1,
            ErrorCode::Truncated => 2,
            ErrorCode::FrameTooLarge => 3,
            ErrorCode::VersionMismatch => 4,
            ErrorCode::TooManyFrames => 5,
            ErrorCode::TensorTooLarge => 6,
            ErrorCode::UnknownSession => 10,
            ErrorCode::InvalidGraph => 11,
            ErrorCode::NoGraph => 12,
            ErrorCode::GraphAlreadyLoaded => 13,
            ErrorCode::BadFeed => 14,
            ErrorCode::UnknownFetch => 15,
            ErrorCode::BadVariable => 16,
            ErrorCode::Exec => 17,
            ErrorCode::NoDevice => 18,
            ErrorCode::BadRequest => 19,
            ErrorCode::ShuttingDown => 20,
            ErrorCode::Overloaded => 21,
            ErrorCode::Internal => 22,
            ErrorCode::MemoryTooLarge => 23,
            ErrorCode::SharedMemory => 24,
            ErrorCode::FetchTooLarge => 25,
            ErrorCode::Unauthenticated => 26,
            ErrorCode::Unknown(c) => c,
        }
    }
}

impl From<u16> for ErrorCode {
    fn from(c: u16) -> Self {
        match c {
            1 => ErrorCode::Malformed,
            2 => ErrorCode::Truncated,
            3 => ErrorCode::FrameTooLarge,
            4 => ErrorCode::VersionMismatch,
            5 => ErrorCode::TooManyFrames,
            6 => ErrorCode::TensorTooLarge,
            10 => ErrorCode::UnknownSession,
            11 => ErrorCode::InvalidGraph,
            12 => ErrorCode::NoGraph,
            13 => ErrorCode::GraphAlreadyLoaded,
            14 => ErrorCode::BadFeed,
            15 => ErrorCode::UnknownFetch,
            16 => ErrorCode::BadVariable,
            17 => ErrorCode::Exec,
            18 => ErrorCode::NoDevice,
            19 => ErrorCode::BadRequest,
            20 => ErrorCode::ShuttingDown,
            21 => ErrorCode::Overloaded,
            22 => ErrorCode::Internal,
            23 => ErrorCode::MemoryTooLarge,
            24 => ErrorCode::SharedMemory,
            25 => ErrorCode::FetchTooLarge,
            26 => ErrorCode::Unauthenticated,
            other => ErrorCode::Unknown(other),
        }
    }
}

impl From<ErrorCode> for u16 {
    fn from(c: ErrorCode) -> u16 {
        c.as_u16()
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ErrorCode::Unknown(c) => write!(f, "unknown({c})"),
            other => write!(f, "{other:?}({})", other.as_u16()),
        }
    }
}

/// Why bytes could not be encoded or decoded as a Lanes message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum WireError {
    #[error("message has no frames")]
    Empty,
    #[error("header does not start with the Lanes magic bytes")]
    BadMagic,
    #[error("header of {bytes} bytes is shorter than the {needed}-byte prefix")]
    ShortHeader { bytes: usize, needed: usize },
    #[error("protocol version {got} is not supported (this side speaks {supported})")]
    VersionMismatch { got: u32, supported: u32 },
    #[error("message has {frames} frames, more than the limit of {limit}")]
    TooManyFrames { frames: usize, limit: usize },
    #[error("frame {index} has {bytes} bytes, more than the limit of {limit}")]
    FrameTooLarge {
        index: usize,
        bytes: usize,
        limit: usize,
    },
    #[error("header could not be decoded: {reason}")]
    Malformed { reason: String },
    #[error("header is truncated: {reason}")]
    TruncatedHeader { reason: String },
    #[error("header announces {expected} tensor parts, message has {got}")]
    FrameCount { expected: usize, got: usize },
    /// The frames of one part (the header is part 0, then each tensor)
    /// do not add up to exactly its byte length: they run out before it,
    /// one straddles its end, or an empty frame lies inside it.
    #[error("part {part} of {expected} bytes: {reason}")]
    PartFrames {
        part: usize,
        expected: usize,
        reason: &'static str,
    },
    #[error("tensor `{name}` of type {ty} is larger than the limit of {limit} bytes")]
    TensorTooLarge {
        name: String,
        ty: TensorType,
        limit: usize,
    },
    #[error("tensor `{name}`: {source}")]
    TensorBytes { name: String, source: TensorError },
    #[error("header could not be encoded: {reason}")]
    Encode { reason: String },
    #[error("shared memory: {reason}")]
    SharedMemory { reason: String },
    /// A Run's feed that the session's graph does not take (checked
    /// before its bytes are copied).
    #[error("feed `{name}`: {reason}")]
    Feed { name: String, reason: String },
}

impl WireError {
    /// The stable code an error reply for this error carries.
    pub fn code(&self) -> ErrorCode {
        match self {
            WireError::Empty
            | WireError::BadMagic
            | WireError::ShortHeader { .. }
            | WireError::Malformed { .. }
            | WireError::Encode { .. } => ErrorCode::Malformed,
            WireError::VersionMismatch { .. } => ErrorCode::VersionMismatch,
            WireError::TooManyFrames { .. } => ErrorCode::TooManyFrames,
            WireError::FrameTooLarge { .. } => ErrorCode::FrameTooLarge,
            // More frames than announced is a malformed message, fewer a
            // truncated one (as docs/protocol.md states).
            WireError::FrameCount { expected, got } if got > expected => ErrorCode::Malformed,
            WireError::TruncatedHeader { .. }
            | WireError::FrameCount { .. }
            | WireError::PartFrames { .. }
            | WireError::TensorBytes { .. } => ErrorCode::Truncated,
            WireError::TensorTooLarge { .. } => ErrorCode::TensorTooLarge,
            WireError::SharedMemory { .. } => ErrorCode::SharedMemory,
            WireError::Feed { .. } => ErrorCode::BadFeed,
        }
    }
}

/// A decode failure, with the request id when the prefix was readable (so
/// the error reply can still be matched to its request).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{error}")]
pub struct DecodeError {
    pub request_id: Option<u64>,
    pub error: WireError,
}
