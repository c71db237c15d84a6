//! Who may connect at all, when the service authenticates its peers
//! (`--auth-key-file`): the ROUTER socket is a ZeroMQ PLAIN server, and
//! libzmq asks this ZAP handler (RFC 27, `inproc://zeromq.zap.01`) about
//! every connection's handshake before it accepts a single message from
//! it. A connection is admitted only with a connection token made with the
//! key (`wire::auth`, [`Gate::admit`]); any other is closed by libzmq after
//! its handshake. So a peer without the key never gets a message to the
//! service, and the frames of the handshake itself are capped, as every
//! frame, by the socket's `ZMQ_MAXMSGSIZE` (`wire::CHUNK_BYTES`; see
//! docs/protocol.md, *Memory before authentication*).

use lanes_adaptor::wire::auth;

use super::auth::Gate;

/// Where libzmq looks for the ZAP handler of its context.
pub(super) const ZAP_ENDPOINT: &str = "inproc://zeromq.zap.01";
/// The ZAP domain the ROUTER names (any non-empty one turns ZAP on).
pub(super) const ZAP_DOMAIN: &str = "lanes";

/// The ZAP handler's socket (a REP bound in the ROUTER's context).
pub(super) struct Zap {
    socket: zmq::Socket,
    /// Refusals, for a throttled warning.
    pub(super) refused: u64,
}

impl Zap {
    /// Binds the handler; must come before the ROUTER accepts connections.
    pub(super) fn bind(ctx: &zmq::Context) -> Result<Zap, zmq::Error> {
        let socket = ctx.socket(zmq::REP)?;
        socket.set_linger(0)?;
        socket.bind(ZAP_ENDPOINT)?;
        Ok(Zap { socket, refused: 0 })
    }

    pub(super) fn socket(&self) -> &zmq::Socket {
        &self.socket
    }

    /// Answers every ZAP request waiting; the reasons of the refusals.
    pub(super) fn serve(&mut self, gate: &mut Gate) -> Result<Vec<String>, zmq::Error> {
        let mut refusals = Vec::new();
        loop {
            let frames = match self.socket.recv_multipart(zmq::DONTWAIT) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) => return Ok(refusals),
                Err(e) => return Err(e),
            };
            let (request_id, verdict) = judge(&frames, gate, auth::unix_now());
            let (code, text) = match &verdict {
                Ok(()) => ("200", "OK".to_string()),
                Err(reason) => {
                    self.refused += 1;
                    refusals.push(reason.clone());
                    ("400", reason.clone())
                }
            };
            let reply: Vec<Vec<u8>> = vec![
                b"1.0".to_vec(),
                request_id,
                code.as_bytes().to_vec(),
                text.into_bytes(),
                Vec::new(), // user id
                Vec::new(), // metadata
            ];
            self.socket.send_multipart(reply, 0)?;
        }
    }
}

/// The request id of a ZAP request and whether its connection may in.
/// Frames: version, request id, domain, address, routing id, mechanism,
/// then the mechanism's credentials (PLAIN: user, password).
fn judge(frames: &[Vec<u8>], gate: &mut Gate, now: u64) -> (Vec<u8>, Result<(), String>) {
    let request_id = frames.get(1).cloned().unwrap_or_default();
    let verdict = match frames {
        [version, _, _, _, _, mechanism, user, password] if version.as_slice() == b"1.0" => {
            if mechanism.as_slice() == b"PLAIN" {
                gate.admit(user, password, now).map_err(|e| e.to_string())
            } else {
                Err("only PLAIN with a connection token".to_string())
            }
        }
        _ => Err("not a ZAP 1.0 PLAIN request".to_string()),
    };
    (request_id, verdict)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use lanes_adaptor::AuthKey;

    #[test]
    fn only_plain_requests_with_a_good_token_are_admitted() {
        let key = AuthKey::new(*b"a key of the service, 32 bytes..").unwrap();
        let mut gate = Gate::new(key.clone());
        let now = auth::unix_now();
        let req = |mech: &[u8], user: &[u8], pass: &[u8]| -> Vec<Vec<u8>> {
            [
                &b"1.0"[..],
                b"7",
                b"lanes",
                b"127.0.0.1",
                b"",
                mech,
                user,
                pass,
            ]
            .iter()
            .map(|f| f.to_vec())
            .collect()
        };
        let token = key.connection_token(now);
        let (id, v) = judge(&req(b"PLAIN", b"lanes", token.as_bytes()), &mut gate, now);
        assert_eq!((id, v), (b"7".to_vec(), Ok(())));
        assert!(
            judge(&req(b"PLAIN", b"lanes", token.as_bytes()), &mut gate, now)
                .1
                .is_err()
        );
        assert!(judge(&req(b"NULL", b"lanes", b""), &mut gate, now)
            .1
            .is_err());
        assert!(judge(&[b"1.0".to_vec()], &mut gate, now).1.is_err());
        assert!(judge(&[], &mut gate, now).1.is_err());
    }
}
