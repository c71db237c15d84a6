//! [`Session`]: a job's open session on a client, its calls and the
//! close sent when it is dropped.

use super::*;

/// An open session of a job. Closed by [`Session::close`]; dropping it sends
/// a close without waiting (the service also reclaims silent sessions).
#[derive(Debug)]
pub struct Session<'c> {
    pub(super) client: &'c mut Client,
    pub(super) id: SessionId,
    pub(super) closed: bool,
}

impl Session<'_> {
    pub fn id(&self) -> SessionId {
        self.id
    }

    fn live(&self) -> Result<SessionId, ClientError> {
        if self.closed {
            Err(ClientError::Closed)
        } else {
            Ok(self.id)
        }
    }

    /// Sends the graph and the initial values of all its variables.
    pub fn load(&mut self, graph: &Graph, variables: VarValues) -> Result<(), ClientError> {
        let id = self.live()?;
        self.client.load_in(id, graph, variables)
    }

    /// Runs one iteration: feeds by placeholder name, fetches as `node` or
    /// `node:slot`; returns the fetched tensors in order.
    pub fn run<N: Into<String>>(
        &mut self,
        feeds: Vec<(N, Tensor)>,
        fetches: &[&str],
    ) -> Result<Vec<Tensor>, ClientError> {
        let id = self.live()?;
        self.client.run_in(id, feeds, fetches)
    }

    /// Sends one iteration without waiting (see [`Client::submit_run_in`]).
    pub fn submit_run<N: Into<String>>(
        &mut self,
        feeds: Vec<(N, Tensor)>,
        fetches: &[&str],
    ) -> Result<PendingRun, ClientError> {
        let id = self.live()?;
        self.client.submit_run_in(id, feeds, fetches)
    }

    /// The result of an iteration sent with [`Session::submit_run`].
    pub fn wait_run(&mut self, run: PendingRun) -> Result<Vec<Tensor>, ClientError> {
        self.client.wait_run(run)
    }

    /// Buffers for this session's feeds in a segment shared with the
    /// service (see [`FeedBuffers`]); `feeds` names each placeholder and its
    /// type. Only for a service on this host that attaches shared memory
    /// ([`ClientError::NoSharedMemory`] otherwise).
    pub fn feed_buffers(
        &mut self,
        feeds: &[(&str, TensorType)],
    ) -> Result<FeedBuffers, ClientError> {
        let id = self.live()?;
        self.client.feed_buffers_in(id, feeds)
    }

    /// [`Session::feed_buffers`] with a reply slot of `reply_bytes` bytes
    /// (see [`Client::feed_buffers_with_reply_in`]).
    pub fn feed_buffers_with_reply(
        &mut self,
        feeds: &[(&str, TensorType)],
        reply_bytes: usize,
    ) -> Result<FeedBuffers, ClientError> {
        let id = self.live()?;
        self.client
            .feed_buffers_with_reply_in(id, feeds, reply_bytes)
    }

    /// Runs one iteration on the values written into `buffers`.
    pub fn run_buffers(
        &mut self,
        buffers: &mut FeedBuffers,
        fetches: &[&str],
    ) -> Result<Vec<Tensor>, ClientError> {
        self.own(buffers)?;
        self.client.run_buffers_in(buffers, fetches)
    }

    /// [`Session::run_buffers`] without waiting; the buffers stay borrowed
    /// until [`Session::wait_buffer_run`].
    pub fn submit_run_buffers<'b>(
        &mut self,
        buffers: &'b mut FeedBuffers,
        fetches: &[&str],
    ) -> Result<PendingBufferRun<'b>, ClientError> {
        self.own(buffers)?;
        self.client.submit_run_buffers_in(buffers, fetches)
    }

    /// The result of a Run sent with [`Session::submit_run_buffers`].
    pub fn wait_buffer_run(
        &mut self,
        run: PendingBufferRun<'_>,
    ) -> Result<Vec<Tensor>, ClientError> {
        self.client.wait_buffer_run(run)
    }

    /// Buffers made for this session (a segment is attached to one).
    fn own(&self, buffers: &FeedBuffers) -> Result<(), ClientError> {
        let id = self.live()?;
        if buffers.session != id {
            return Err(ClientError::FeedBuffer {
                reason: format!(
                    "these buffers belong to session {}, not {id}",
                    buffers.session
                ),
            });
        }
        Ok(())
    }

    /// Current values of variables; all of them when `names` is empty.
    pub fn read_variables(&mut self, names: &[&str]) -> Result<VarValues, ClientError> {
        let id = self.live()?;
        self.client.read_variables_in(id, names)
    }

    /// Overwrites variables (each must exist and keep its type).
    pub fn write_variables(&mut self, values: VarValues) -> Result<(), ClientError> {
        let id = self.live()?;
        self.client.write_variables_in(id, values)
    }

    /// Closes the session; its memory is released on the service.
    pub fn close(mut self) -> Result<(), ClientError> {
        let id = self.live()?;
        self.closed = true;
        self.client.close_in(id)
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        let id = self.client.next_id;
        self.client.next_id = self.client.next_id.wrapping_add(1);
        self.client.shared.by_session.remove(&self.id);
        if let Ok(frames) = wire::encode_request(id, &Request::CloseSession { session: self.id }) {
            // Best effort: the reply is skipped by the next request's id check.
            let _ = self
                .client
                .conn
                .socket
                .send_multipart(frames, zmq::DONTWAIT);
        }
    }
}
