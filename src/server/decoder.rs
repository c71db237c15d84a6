//! Large requests decoded off the socket thread.
//!
//! Decoding a LoadGraph copies and checks the model's variables: tens of
//! megabytes, tens of milliseconds. On the socket thread that stalls every
//! other client meanwhile: no reply is forwarded and no request is taken
//! in, so a running job's pipeline of Runs drains, an inference job's
//! latency jumps, and the policy's order breaks (the next job in line runs
//! while the first one's Runs are stuck in the socket). Requests of at
//! least [`OFFLOAD_BYTES`] (LoadGraph, WriteVariables) are therefore
//! decoded by a thread of their own;
//! the socket thread keeps serving the others and takes the decoded
//! request back when the decoder wakes it (through [`DECODED`], an inproc
//! socket it polls with the others).
//!
//! A peer's requests keep their order: while one of them is being decoded,
//! the peer's later messages wait (undecoded) behind it, and are handled
//! in order once it is back (see `Frontend::drain_held`).
//!
//! Runs are not sent here, whatever their size: their feeds are checked
//! against the session's graph before they are copied, which needs the
//! socket thread's session table. Requests decoded here see no
//! shared-memory segments (`NoSegments`).

use std::thread::JoinHandle;
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender};
use lanes_adaptor::wire::shm::NoSegments;
use lanes_adaptor::wire::{self, BufferPool, DecodeError, Envelope, Limits, Request};

use super::ServerError;

/// Messages this large or larger (other than Runs) are decoded by the
/// decoder thread.
pub(super) const OFFLOAD_BYTES: usize = 1 << 20;

/// Where the decoder wakes the socket thread.
pub(super) const DECODED: &str = "inproc://lanes-decoded";

/// A request the decoder finished.
pub(super) struct Decoded {
    /// The peer's routing id.
    pub peer: Vec<u8>,
    pub result: Result<Envelope<Request>, DecodeError>,
    /// The message's size.
    pub bytes: usize,
    /// When the socket thread received it.
    pub received: Instant,
}

/// One message to decode: the peer, its frames, when it was received.
type Job = (Vec<u8>, Vec<zmq::Message>, Instant);

/// The decoder thread and its channels.
pub(super) struct Decoder {
    jobs: Option<Sender<Job>>,
    done: Receiver<Decoded>,
    thread: Option<JoinHandle<()>>,
}

impl Decoder {
    /// Starts the thread; it wakes the socket thread through [`DECODED`],
    /// which the caller has bound (a PULL socket) in `ctx`.
    pub fn start(
        ctx: &zmq::Context,
        limits: Limits,
        pool: Option<BufferPool>,
    ) -> Result<Self, ServerError> {
        let wake = ctx.socket(zmq::PUSH)?;
        wake.set_linger(0)?;
        wake.connect(DECODED)?;
        let (jobs, inbox) = crossbeam_channel::unbounded::<Job>();
        let (out, done) = crossbeam_channel::unbounded();
        let thread = std::thread::Builder::new()
            .name("lanes-decoder".into())
            .spawn(move || {
                for (peer, frames, received) in inbox {
                    let result =
                        wire::decode_request_with(&frames, &limits, pool.as_ref(), &NoSegments);
                    let bytes = frames.iter().map(|f| f.len()).sum();
                    drop(frames);
                    if out
                        .send(Decoded {
                            peer,
                            result,
                            bytes,
                            received,
                        })
                        .is_err()
                    {
                        return; // the socket thread is gone
                    }
                    // A lost wake-up only delays: the socket thread also
                    // looks at the channel every turn of its loop while a
                    // request is at the decoder.
                    let _ = wake.send(zmq::Message::new(), zmq::DONTWAIT);
                }
            })?;
        Ok(Decoder {
            jobs: Some(jobs),
            done,
            thread: Some(thread),
        })
    }

    /// Hands a message over; gives it back if the thread is gone (the
    /// caller then decodes it itself).
    pub fn submit(
        &self,
        peer: Vec<u8>,
        frames: Vec<zmq::Message>,
        received: Instant,
    ) -> Result<(), (Vec<u8>, Vec<zmq::Message>)> {
        let job = (peer, frames, received);
        match &self.jobs {
            Some(tx) => tx.send(job).map_err(|e| {
                let (peer, frames, _) = e.into_inner();
                (peer, frames)
            }),
            None => Err((job.0, job.1)),
        }
    }

    /// A finished request, if one is waiting.
    pub fn try_next(&self) -> Option<Decoded> {
        self.done.try_recv().ok()
    }
}

impl Drop for Decoder {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop.
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
