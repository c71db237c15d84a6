//! Workers: take a [`WorkItem`], run it on its session, send the reply back
//! to the socket thread.
//!
//! Reply path: each worker has its own PUSH socket connected to the socket
//! thread's PULL (`inproc://`, same context). A reply travels as
//! `[session id (u64 LE), peer routing id, header, tensor frames…]`; the
//! socket thread strips the first frame (it refreshes the session's
//! activity time) and forwards the rest on the ROUTER.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, PoisonError};

use lanes_adaptor::wire::shm::{AttachedSegment, ReplySlot};
use lanes_adaptor::wire::{self, ErrorCode, Reply};
use lanes_adaptor::{GraphLimits, TensorType};

use super::dispatch::{Dispatcher, Work, WorkItem};
use crate::exec::{ExecError, FetchInto, Fetched, FillOutputs};
use crate::session::Session;

/// Address of the socket thread's PULL socket for replies.
pub(crate) const REPLIES: &str = "inproc://lanes-replies";

/// Runs one item on its (locked) session and makes the reply. A Run's
/// outputs written into the client's reply slot are left out of the reply.
fn execute(session: &mut Session, work: Work, limits: &GraphLimits, request_id: u64) -> Reply {
    let id = session.id();
    let res = match work {
        Work::Load {
            graph,
            variables,
            decoded,
        } => {
            let loaded = session.load(graph, variables, limits);
            if let (Ok(_), Some(t)) = (&loaded, session.load_times()) {
                tracing::info!(
                    session = %id,
                    decode_ms = ms(decoded),
                    validate_ms = ms(t.validate),
                    variables_ms = ms(t.variables),
                    plan_ms = ms(t.plan),
                    admit_ms = ms(t.admit),
                    build_ms = ms(t.build),
                    warm_ms = ms(t.warm),
                    cached = t.cached,
                    "graph loaded"
                );
            }
            loaded.map(|(nodes, variables)| {
                let (persistent_bytes, ephemeral_bytes) = session.memory().unwrap_or((0, 0));
                Reply::GraphLoaded {
                    session: id,
                    nodes,
                    variables,
                    persistent_bytes,
                    ephemeral_bytes,
                    waiting: session.waiting(),
                }
            })
        }
        Work::Run {
            feeds,
            fetches,
            reply,
        } => {
            let mut answer = reply.as_ref().map(|slot| SlotAnswer {
                slot,
                seq: request_id,
            });
            let into = answer.as_mut().map(|a| a as &mut dyn FetchInto);
            session.run_to(feeds, &fetches, into).map(|fetched| {
                // Written into the slot, they need not travel again.
                match (fetched, &reply) {
                    (Fetched::Written, _) => Reply::RunDone { outputs: vec![] },
                    (Fetched::Tensors(outputs), Some(slot))
                        if wire::post_outputs(slot, request_id, &outputs) =>
                    {
                        Reply::RunDone { outputs: vec![] }
                    }
                    // Too large for the slot (it says so), or no slot.
                    (Fetched::Tensors(outputs), _) => Reply::RunDone { outputs },
                }
            })
        }
        Work::ReadVariables { names } => session
            .read_variables(&names)
            .map(|variables| Reply::Variables { variables }),
        Work::WriteVariables { variables } => session
            .write_variables(variables)
            .map(|count| Reply::VariablesWritten { count }),
    };
    res.unwrap_or_else(|e| {
        tracing::debug!(session = %id, error = %e, "request failed");
        Reply::error(e.code(), e.to_string())
    })
}

/// A Run's reply slot as the place its outputs are written: the executor
/// fills the values (the CUDA one straight from the device), then the
/// slot is posted as Run `seq`'s answer.
struct SlotAnswer<'a> {
    slot: &'a ReplySlot,
    seq: u64,
}

impl FetchInto for SlotAnswer<'_> {
    fn segment(&self) -> Option<&Arc<AttachedSegment>> {
        Some(self.slot.segment())
    }

    fn write(
        &mut self,
        types: &[TensorType],
        write: &mut FillOutputs<'_>,
    ) -> Result<bool, ExecError> {
        wire::post_outputs_with(self.slot, self.seq, types, write)
    }
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A reply's frames and what the metrics learn from it.
pub(crate) struct Answered {
    pub frames: Vec<Vec<u8>>,
    /// The code of an error reply.
    pub error: Option<ErrorCode>,
    /// A Run that began with the job's weights on the host.
    pub switched_in: bool,
    /// A LoadGraph that succeeded: its decode time and its phases.
    pub loaded: Option<(std::time::Duration, crate::session::LoadTimes)>,
    /// Whether the item counts as one of the job's iterations for the
    /// scheduler: not an evaluation Run (it updates nothing), nor a Run
    /// answered with an error (a panic included).
    pub iteration: bool,
}

/// Runs one item, turning a panic in the executor into an Internal error.
pub(crate) fn handle(item: WorkItem, limits: &GraphLimits) -> Answered {
    let WorkItem {
        session,
        request_id,
        work,
        state,
        ..
    } = item;
    let what = work.name();
    let t0 = std::time::Instant::now();
    let mut switched_in = false;
    let mut loaded = None;
    // A Run is an iteration once it succeeded and was the job's step (a
    // panic leaves it none); other items are not Runs and count as before.
    let run = matches!(work, Work::Run { .. });
    let mut iteration = !run;
    let reply = catch_unwind(AssertUnwindSafe(|| {
        let mut s = state.lock().unwrap_or_else(PoisonError::into_inner);
        switched_in = run && s.is_loaded() && !s.is_resident();
        let decoded = match &work {
            Work::Load { decoded, .. } => Some(*decoded),
            _ => None,
        };
        let reply = execute(&mut s, work, limits, request_id);
        // A refused or failed Run is no progress either.
        iteration = !run || (s.last_run_was_iteration() && !matches!(reply, Reply::Error(_)));
        if matches!(reply, Reply::GraphLoaded { .. }) {
            loaded = decoded.zip(s.load_times());
        }
        reply
    }))
    .unwrap_or_else(|_| {
        tracing::error!(%session, request = what, "executor panicked");
        Reply::error(
            ErrorCode::Internal,
            format!("the executor panicked while running {what}"),
        )
    });
    let t_ran = std::time::Instant::now();
    let error = match &reply {
        Reply::Error(e) => Some(e.code),
        _ => None,
    };
    let frames = wire::encode_reply(request_id, &reply).unwrap_or_else(|e| {
        wire::encode_error(
            request_id,
            ErrorCode::Internal,
            &format!("reply could not be encoded: {e}"),
        )
    });
    drop(reply);
    tracing::trace!(
        %session,
        request = what,
        run_us = t_ran.duration_since(t0).as_micros() as u64,
        encode_us = t_ran.elapsed().as_micros() as u64,
        "executed"
    );
    Answered {
        frames,
        error,
        switched_in,
        loaded,
        iteration,
    }
}

/// A worker's loop: until the dispatcher shuts down.
pub(crate) fn run(
    ctx: zmq::Context,
    dispatcher: Arc<Dispatcher>,
    limits: GraphLimits,
    metrics: Option<Arc<super::metrics::Metrics>>,
) -> Result<(), zmq::Error> {
    let push = ctx.socket(zmq::PUSH)?;
    push.set_linger(1000)?;
    push.connect(REPLIES)?;
    while let Some(item) = dispatcher.next() {
        let session = item.session;
        let peer = item.peer.clone();
        let started = std::time::Instant::now();
        let queued = started.saturating_duration_since(item.enqueued);
        let what = item.work.name();
        let state = Arc::clone(&item.state);
        let Answered {
            frames,
            error,
            switched_in,
            loaded,
            iteration,
        } = handle(item, &limits);
        let took = started.elapsed();
        if let Some(m) = &metrics {
            m.answered(session, what, queued, took, error, switched_in);
            if let Some((decoded, times)) = &loaded {
                m.loaded(*decoded, times);
            }
        }
        tracing::trace!(%session, request = what, micros = took.as_micros() as u64, "done");
        let mut out: Vec<Vec<u8>> = Vec::with_capacity(frames.len() + 2);
        out.push(session.0.to_le_bytes().to_vec());
        out.push(peer);
        out.extend(frames);
        // The reply is on its way before the session's next request can
        // start on another worker, so its replies mostly keep their order
        // (clients must not rely on it: workers answer through separate
        // sockets).
        let sent = push.send_multipart(out, 0);
        if what == "run" {
            yield_if_asked(&dispatcher, session, &state);
        }
        dispatcher.done(session, took, iteration);
        sent?;
        // Something waits for memory: the socket thread looks again now
        // that this session may be idle (an empty message, which it drops),
        // rather than at its next poll timeout.
        if dispatcher.memory_wanted() {
            push.send(zmq::Message::new(), 0)?;
        }
    }
    Ok(())
}

/// After a Run's reply: a training job the socket thread asked to give its
/// memory up does so now, at its iteration boundary (`session/preempt.rs`);
/// its later Runs, when it has any queued, wait for its memory to come back.
fn yield_if_asked(
    dispatcher: &Dispatcher,
    session: lanes_adaptor::wire::SessionId,
    state: &std::sync::Mutex<Session>,
) {
    let mut s = state.lock().unwrap_or_else(PoisonError::into_inner);
    if !s.is_asked_to_yield() {
        return;
    }
    // Taking the dispatcher's lock while holding a session's is safe: no
    // one holding the dispatcher's locks a session (the socket thread only
    // tries to).
    if let Err(e) = s.yield_at_boundary(|| dispatcher.session_load(session).0 > 0) {
        tracing::warn!(%session, error = %e, "yielding at the iteration boundary failed");
    }
}
