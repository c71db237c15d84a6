//! The desk: the service's abstract Unix socket that takes a segment's
//! descriptor from the client that made it (`SCM_RIGHTS`), keyed by the
//! segment's token until an offer claims it.

use super::*;

/// The service's end of the hand-over: an abstract Unix socket that
/// accepts a segment's token with its descriptor (`SCM_RIGHTS`), and the
/// descriptors received until an offer claims them ([`FdDesk::take`]).
/// Non-blocking throughout: the service's socket thread drives it. Bounded:
/// at most [`DESK_PENDING`] descriptors kept, each at most [`DESK_KEEP`].
#[cfg(target_os = "linux")]
pub struct FdDesk {
    name: String,
    listener: std::os::unix::net::UnixListener,
    /// Accepted connections whose message has not arrived yet.
    waiting: Vec<(std::os::unix::net::UnixStream, std::time::Instant)>,
    pending: std::collections::HashMap<[u8; TOKEN_BYTES], (std::fs::File, std::time::Instant)>,
}

#[cfg(target_os = "linux")]
impl std::fmt::Debug for FdDesk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdDesk")
            .field("name", &self.name)
            .field("pending", &self.pending.len())
            .finish()
    }
}

#[cfg(target_os = "linux")]
impl FdDesk {
    /// A desk under a fresh abstract name.
    pub fn bind() -> Result<Self, SharedMemoryError> {
        use std::os::linux::net::SocketAddrExt;
        let name = format!(
            "lanes-desk-{}-{}",
            std::process::id(),
            crate::wire::auth::hex(&token())
        );
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .map_err(io("naming the desk"))?;
        let listener = std::os::unix::net::UnixListener::bind_addr(&addr)
            .map_err(io(format!("binding the desk {name:?}")))?;
        listener
            .set_nonblocking(true)
            .map_err(io("making the desk non-blocking"))?;
        Ok(FdDesk {
            name,
            listener,
            waiting: Vec::new(),
            pending: std::collections::HashMap::new(),
        })
    }

    /// The abstract name clients connect to.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The descriptor handed over under `token`, if any (taken: a token
    /// attaches once).
    pub fn take(&mut self, token: &[u8; TOKEN_BYTES]) -> Option<std::fs::File> {
        // Behind a pile of other connections the one with this token may
        // not be accepted in one round: go on while rounds accept any.
        for _ in 0..16 {
            let accepted = self.collect();
            if let Some((f, _)) = self.pending.remove(token) {
                return Some(f);
            }
            if accepted == 0 {
                break;
            }
        }
        None
    }

    /// Descriptors kept now.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Accepts and reads what has arrived (call it often: the service's
    /// socket thread does, each time round its loop, so that connecting
    /// clients never wait on a full backlog).
    pub fn poll(&mut self) {
        self.collect();
    }

    /// Accepts what has arrived, reads the messages that are complete,
    /// forgets what is too old, and keeps within the bounds. Returns how
    /// many connections it accepted.
    fn collect(&mut self) -> usize {
        let now = std::time::Instant::now();
        let mut accepted = 0;
        for _ in 0..DESK_WAITING {
            match self.listener.accept() {
                Ok((s, _)) if s.set_nonblocking(true).is_ok() => {
                    self.waiting.push((s, now));
                    accepted += 1;
                }
                Ok(_) => accepted += 1,
                Err(_) => break, // WouldBlock, or a transient error: next time
            }
        }
        let waiting = std::mem::take(&mut self.waiting);
        for (stream, since) in waiting {
            match receive(&stream) {
                Received::Descriptor(token, file) => {
                    self.pending.insert(token, (file, now));
                }
                Received::NotYet if now.duration_since(since) < DESK_SILENT => {
                    self.waiting.push((stream, since));
                }
                Received::NotYet | Received::Refused => {}
            }
        }
        if self.waiting.len() > DESK_WAITING {
            let extra = self.waiting.len() - DESK_WAITING;
            self.waiting.drain(..extra); // the oldest connections
        }
        self.pending
            .retain(|_, (_, at)| now.duration_since(*at) < DESK_KEEP);
        while self.pending.len() > DESK_PENDING {
            let oldest = self
                .pending
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(k, _)| *k);
            match oldest {
                Some(k) => {
                    self.pending.remove(&k);
                }
                None => break,
            }
        }
        accepted
    }
}

/// Shared memory needs Linux: elsewhere no desk can be bound.
#[cfg(not(target_os = "linux"))]
#[derive(Debug)]
pub struct FdDesk;

#[cfg(not(target_os = "linux"))]
impl FdDesk {
    pub fn bind() -> Result<Self, SharedMemoryError> {
        Err(SharedMemoryError::Unsupported)
    }
    pub fn name(&self) -> &str {
        ""
    }
    pub fn take(&mut self, _token: &[u8; TOKEN_BYTES]) -> Option<std::fs::File> {
        None
    }
    pub fn pending(&self) -> usize {
        0
    }
    pub fn poll(&mut self) {}
}

#[cfg(target_os = "linux")]
enum Received {
    Descriptor([u8; TOKEN_BYTES], std::fs::File),
    NotYet,
    Refused,
}

/// One hand-over message: exactly a token and one descriptor.
#[cfg(target_os = "linux")]
fn receive(stream: &std::os::unix::net::UnixStream) -> Received {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags, UnixAddr};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let mut token = [0u8; TOKEN_BYTES];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let (bytes, mut fds) = {
        let mut iov = [std::io::IoSliceMut::new(&mut token)];
        let msg = match recvmsg::<UnixAddr>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC | MsgFlags::MSG_DONTWAIT,
        ) {
            Ok(m) => m,
            Err(nix::errno::Errno::EAGAIN) => return Received::NotYet,
            Err(_) => return Received::Refused,
        };
        let mut fds: Vec<OwnedFd> = Vec::new();
        if let Ok(cmsgs) = msg.cmsgs() {
            for c in cmsgs {
                if let ControlMessageOwned::ScmRights(raw) = c {
                    // SAFETY: the kernel installed these descriptors in this
                    // process for this message just now; nothing else owns
                    // them, and each is wrapped exactly once (closed on drop).
                    #[allow(unsafe_code)]
                    fds.extend(
                        raw.into_iter()
                            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                    );
                }
            }
        }
        let truncated = msg
            .flags
            .intersects(MsgFlags::MSG_TRUNC | MsgFlags::MSG_CTRUNC);
        (if truncated { 0 } else { msg.bytes }, fds)
    };
    if bytes != TOKEN_BYTES || fds.len() != 1 {
        return Received::Refused; // every descriptor received is closed here
    }
    match fds.pop() {
        Some(fd) => Received::Descriptor(token, std::fs::File::from(fd)),
        None => Received::Refused,
    }
}
