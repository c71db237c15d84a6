//! A client's requests on the wire: sending (the socket, or a Run's feeds
//! in a shared segment), receiving and matching replies, and the segments'
//! lifetimes.

use super::*;

impl Client {
    /// Sends one request and waits for its reply. Error replies become
    /// [`ClientError::Service`]; replies to earlier, timed-out requests are
    /// skipped.
    pub fn request(&mut self, req: &Request) -> Result<Reply, ClientError> {
        let sent = self.send(req)?;
        self.receive(&sent, None)
    }

    /// A Run: once it is sent, the storage of its feeds is where the tensors
    /// of the reply are decoded, when sizes fit (a fetch as large as a feed
    /// then writes into memory already mapped instead of fresh pages).
    pub(super) fn request_run(&mut self, req: Request) -> Result<Reply, ClientError> {
        let sent = self.send_run(&req)?;
        let pool = self.pool.clone();
        if let Request::Run { feeds, .. } = req {
            feeds.into_iter().for_each(|f| pool.give(f.tensor));
        }
        let reply = self.receive(&sent, Some(&pool));
        pool.clear();
        reply
    }

    /// Encodes and queues a request.
    pub(super) fn send(&mut self, req: &Request) -> Result<Sent, ClientError> {
        self.send_via(req, None)
    }

    /// Encodes and queues a request, a Run's feeds into `shared` when given.
    pub(super) fn send_via(
        &mut self,
        req: &Request,
        shared: Option<&mut OwnedSegment>,
    ) -> Result<Sent, ClientError> {
        self.send_encoded(req.name(), |id| wire::encode_request_into(id, req, shared))
    }

    /// Takes the next request id, encodes with it and queues the frames.
    pub(super) fn send_encoded(
        &mut self,
        request: &'static str,
        encode: impl FnOnce(u64) -> Result<Vec<Vec<u8>>, WireError>,
    ) -> Result<Sent, ClientError> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let start = Instant::now();
        let frames = encode(id).map_err(ClientError::Encode)?;
        let bytes: usize = frames.iter().map(Vec::len).sum();
        let encoded = Instant::now();
        self.conn
            .socket
            .send_multipart(frames, 0)
            .map_err(|e| match e {
                zmq::Error::EAGAIN => ClientError::Timeout {
                    request,
                    timeout: self.options.timeout,
                },
                other => ClientError::Zmq(other),
            })?;
        Ok(Sent {
            id,
            request,
            bytes,
            start,
            encoded,
            sent: Instant::now(),
        })
    }

    /// Waits for the reply to `sent`, decoding its tensors into `pool`'s
    /// storage where it fits.
    pub(super) fn receive(
        &mut self,
        sent: &Sent,
        pool: Option<&BufferPool>,
    ) -> Result<Reply, ClientError> {
        if let Some(r) = self.early.remove(&sent.id) {
            return r;
        }
        let deadline = sent.sent + self.options.timeout;
        loop {
            if self.lost_at.is_some() {
                return Err(ClientError::ServiceGone {
                    request: sent.request,
                });
            }
            if !self.options.busy_poll.is_zero() {
                let until = Instant::now() + self.options.busy_poll;
                while Instant::now() < until.min(deadline)
                    && self.conn.socket.poll(zmq::POLLIN, 0)? == 0
                {
                    std::hint::spin_loop();
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let ms = i64::try_from(left.as_millis()).unwrap_or(i64::MAX);
            let (readable, event) = if left.is_zero() {
                (false, false)
            } else {
                let mut items = [
                    self.conn.socket.as_poll_item(zmq::POLLIN),
                    self.conn.monitor.as_poll_item(zmq::POLLIN),
                ];
                zmq::poll(&mut items, ms)?;
                (items[0].is_readable(), items[1].is_readable())
            };
            if readable {
                if let Some(r) = self.take_reply(sent, pool)? {
                    return r;
                }
                continue;
            }
            if event && connection_lost(&self.conn.monitor)? {
                self.lost_at = Some(Instant::now());
            }
            if event {
                continue;
            }
            return Err(ClientError::Timeout {
                request: sent.request,
                timeout: self.options.timeout,
            });
        }
    }

    /// Takes one message from the socket, which has one: `Some` when it
    /// answers `sent`; a reply to a Run submitted ahead is kept for its
    /// wait, any other (a request that timed out, a Run whose outputs came
    /// through its reply slot) dropped.
    pub(super) fn take_reply(
        &mut self,
        sent: &Sent,
        pool: Option<&BufferPool>,
    ) -> Result<Option<Result<Reply, ClientError>>, ClientError> {
        let ready = Instant::now();
        let frames = recv_frames(&self.conn.socket)?;
        let received = Instant::now();
        let decoded = wire::decode_reply_in(&frames, &self.options.limits, pool);
        drop(frames);
        // The service has read a Run's feeds once it answers.
        let answered = match &decoded {
            Ok(env) => Some(env.request_id),
            Err(e) => e.request_id,
        };
        if let Some(id) = answered {
            self.shared.release(id);
        }
        let service = |message: Reply| match message {
            Reply::Error(e) => Err(ClientError::Service {
                code: e.code,
                message: e.message,
            }),
            r => Ok(r),
        };
        match decoded {
            Ok(env) if env.request_id != sent.id => {
                // A Run submitted ahead: keep its reply for its wait.
                if self.ahead.contains(&env.request_id) {
                    self.early.insert(env.request_id, service(env.message));
                }
                Ok(None)
            }
            Ok(env) => {
                let us = |a: Instant, b: Instant| b.duration_since(a).as_micros() as u64;
                tracing::trace!(
                    request = sent.request,
                    bytes = sent.bytes,
                    encode_us = us(sent.start, sent.encoded),
                    send_us = us(sent.encoded, sent.sent),
                    wait_us = us(sent.sent, ready),
                    recv_us = us(ready, received),
                    decode_us = received.elapsed().as_micros() as u64,
                    "round trip"
                );
                Ok(Some(service(env.message)))
            }
            Err(e) if e.request_id.is_some_and(|r| r != sent.id) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Sends a Run, its feeds through a shared segment when that is
    /// possible and worth it (see [`ClientOptions::shared_memory`]).
    pub(super) fn send_run(&mut self, req: &Request) -> Result<Sent, ClientError> {
        let Request::Run { session, feeds, .. } = req else {
            return self.send(req);
        };
        let need =
            wire::shm::layout(feeds.iter().map(|f| f.tensor.ty().bytes())).map(|(_, end)| end);
        let Some(need) = need.filter(|n| {
            self.shared.usable && n - wire::shm::SEGMENT_HEADER >= SHARED_FEEDS_MIN_BYTES
        }) else {
            return self.send(req);
        };
        let Some(at) = self.free_segment(*session, need)? else {
            return self.send(req);
        };
        // Taken out while the request borrows `self`; put back below.
        let mut seg = self
            .shared
            .by_session
            .get_mut(session)
            .map(|v| v.swap_remove(at))
            .ok_or(ClientError::Closed)?;
        let sent = self.send_via(req, Some(&mut seg.seg));
        if let Ok(s) = &sent {
            seg.busy = Some(s.id);
        }
        self.shared
            .by_session
            .entry(*session)
            .or_default()
            .push(seg);
        sent
    }

    /// Index of a free segment of `session` with at least `need` bytes,
    /// making and attaching one if none is free; `None` when shared memory
    /// is not to be had (the Run then goes through the socket).
    pub(super) fn free_segment(
        &mut self,
        session: SessionId,
        need: usize,
    ) -> Result<Option<usize>, ClientError> {
        let segs = self.shared.by_session.entry(session).or_default();
        if let Some(i) = segs
            .iter()
            .position(|s| s.busy.is_none() && s.seg.len() >= need)
        {
            return Ok(Some(i));
        }
        // A free segment that is too small is replaced under its id (the
        // service then drops its mapping of the old one).
        let id = match segs.iter().position(|s| s.busy.is_none()) {
            Some(i) => segs.swap_remove(i).seg.id(),
            None if segs.len() >= MAX_SEGMENTS_PER_SESSION => return Ok(None),
            None => {
                let id = self.shared.next_id;
                self.shared.next_id = self.shared.next_id.wrapping_add(1);
                id
            }
        };
        let bytes = need.next_multiple_of(SEGMENT_GRANULE);
        let seg = match self.share_segment(session, id, bytes)? {
            Ok(seg) => seg,
            Err(reason) => {
                tracing::debug!(%reason, "no shared-memory segment; feeds go through the socket");
                self.shared.usable = false;
                return Ok(None);
            }
        };
        let segs = self.shared.by_session.entry(session).or_default();
        segs.push(ClientSegment { seg, busy: None });
        Ok(Some(segs.len() - 1))
    }

    /// Makes segment `id` of `bytes` bytes, hands its descriptor to the
    /// service's desk and attaches it to `session`. The inner error says
    /// why shared memory cannot be had here (no desk, a segment the OS or
    /// the service refused); the outer one is any other failure.
    pub(super) fn share_segment(
        &mut self,
        session: SessionId,
        id: u32,
        bytes: usize,
    ) -> Result<Result<OwnedSegment, String>, ClientError> {
        let made = OwnedSegment::create(id, bytes).and_then(|seg| {
            match &self.shared.desk {
                Some(desk) => seg.hand_over(desk)?,
                None => return Err(SharedMemoryError::NotHandedOver),
            }
            Ok(seg)
        });
        let seg = match made {
            Ok(s) => s,
            Err(e) => return Ok(Err(e.to_string())),
        };
        let req = Request::ShareMemory {
            session,
            offer: seg.offer(),
        };
        match self.request(&req) {
            Ok(Reply::MemoryShared { .. }) => Ok(Ok(seg)),
            Ok(other) => Err(unexpected(req.name(), &other)),
            Err(ClientError::Service { code, message })
                if code == ErrorCode::SharedMemory || code == ErrorCode::BadRequest =>
            {
                Ok(Err(format!(
                    "the service cannot attach shared memory: {message}"
                )))
            }
            Err(e) => Err(e),
        }
    }
}
