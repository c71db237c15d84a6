//! Which connections have authenticated (`lanes serve --auth-key-file`):
//! the challenge each Hello got, and whether its answer was good. The
//! proofs themselves are `lanes_adaptor::wire::auth`'s.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use lanes_adaptor::wire::auth::{
    self, AuthKey, TokenError, AUTH_BYTES, TOKEN_NONCE_BYTES, TOKEN_SKEW_SECS, TOKEN_USER,
};

/// Most connections with a challenge outstanding; a Hello from another
/// connection beyond it is refused (never an outstanding challenge
/// evicted: a flood of Hellos cannot take a well-behaved client's).
pub(super) const MAX_PENDING: usize = 1024;
/// Most of them from one peer address (ZeroMQ's `Peer-Address`: a TCP
/// client's IP, an `ipc://` client's process), so that one peer's flood
/// cannot fill the table for the others.
pub(super) const MAX_PENDING_PER_PEER: usize = 64;
/// How long a challenge stays good (a client answers at once; a
/// connection that never answers holds its slot this long).
pub(super) const CHALLENGE_TTL: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct PeerAuth {
    /// The challenge of its last Hello, until answered (one try).
    challenge: Option<([u8; AUTH_BYTES], Instant)>,
    /// The address the connection is from.
    origin: String,
    authenticated: bool,
}

/// Most connection tokens remembered (each is good once, for twice
/// [`TOKEN_SKEW_SECS`]): beyond, new connections are refused until old
/// tokens expire.
pub(super) const MAX_TOKENS: usize = 1 << 16;

/// The authentication state of the service's connections, by routing id.
/// Bounded: at most [`MAX_PENDING`] unanswered challenges; an
/// authenticated connection is forgotten when it is gone.
#[derive(Debug)]
pub(super) struct Gate {
    key: AuthKey,
    peers: HashMap<Vec<u8>, PeerAuth>,
    /// Nonces of the connection tokens accepted, with their time.
    tokens: HashMap<[u8; TOKEN_NONCE_BYTES], u64>,
}

/// Why a connection's ZeroMQ handshake was refused (see [`Gate::admit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(super) enum Turned {
    #[error("no connection token (PLAIN, user `{TOKEN_USER}`)")]
    NoToken,
    #[error("{0}")]
    Token(#[from] TokenError),
    #[error("this connection token was used already")]
    Replayed,
    #[error("too many connections in the last {TOKEN_SKEW_SECS} s")]
    Full,
}

/// Why an Authenticate was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(super) enum Refused {
    #[error("no challenge outstanding on this connection: send Hello first")]
    NoChallenge,
    #[error("the challenge expired: send Hello again")]
    Expired,
    #[error("wrong proof: this connection does not hold the service's key")]
    WrongProof,
}

/// Too many connections are authenticating at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "too many connections are authenticating at once ({MAX_PENDING} in all or {MAX_PENDING_PER_PEER} from one address, the service's limits): try again in a few seconds"
)]
pub(super) struct Busy;

impl Gate {
    pub(super) fn new(key: AuthKey) -> Self {
        Gate {
            key,
            peers: HashMap::new(),
            tokens: HashMap::new(),
        }
    }

    /// Whether a connection's ZeroMQ handshake (PLAIN `user` and
    /// `password`) shows the key: a connection token for about now, never
    /// seen before. Checked before the connection may send a single
    /// message.
    pub(super) fn admit(&mut self, user: &[u8], password: &[u8], now: u64) -> Result<(), Turned> {
        if user != TOKEN_USER.as_bytes() {
            return Err(Turned::NoToken);
        }
        let (nonce, time) = self.key.check_connection_token(password, now)?;
        // Tokens past the window are refused by their time: forgotten.
        self.tokens
            .retain(|_, t| t.abs_diff(now) <= 2 * TOKEN_SKEW_SECS);
        if self.tokens.contains_key(&nonce) {
            return Err(Turned::Replayed);
        }
        if self.tokens.len() >= MAX_TOKENS {
            return Err(Turned::Full);
        }
        self.tokens.insert(nonce, time);
        Ok(())
    }

    pub(super) fn is_authenticated(&self, peer: &[u8]) -> bool {
        self.peers.get(peer).is_some_and(|p| p.authenticated)
    }

    /// A fresh challenge for `peer`'s Hello (replacing its own earlier
    /// one); the connection is not authenticated until it answers it.
    /// Refused while [`MAX_PENDING`] other connections, or
    /// [`MAX_PENDING_PER_PEER`] other connections from `origin`, have
    /// challenges outstanding (they expire after [`CHALLENGE_TTL`]).
    pub(super) fn challenge(
        &mut self,
        peer: &[u8],
        origin: &str,
    ) -> Result<[u8; AUTH_BYTES], Busy> {
        let now = Instant::now();
        self.peers.retain(|_, p| {
            if p.challenge
                .is_some_and(|(_, t)| now.duration_since(t) > CHALLENGE_TTL)
            {
                p.challenge = None;
            }
            p.authenticated || p.challenge.is_some()
        });
        let own = self.peers.get(peer).is_some_and(|p| p.challenge.is_some());
        let (mut pending, mut from_origin) = (0, 0);
        for p in self.peers.values().filter(|p| p.challenge.is_some()) {
            pending += 1;
            from_origin += usize::from(p.origin == origin);
        }
        if !own && (pending >= MAX_PENDING || from_origin >= MAX_PENDING_PER_PEER) {
            return Err(Busy);
        }
        let challenge = auth::random_bytes();
        self.peers.insert(
            peer.to_vec(),
            PeerAuth {
                challenge: Some((challenge, now)),
                origin: origin.to_string(),
                authenticated: false,
            },
        );
        Ok(challenge)
    }

    /// Checks `peer`'s answer to its challenge (which it uses up): the
    /// service's proof when it holds the key.
    pub(super) fn authenticate(
        &mut self,
        peer: &[u8],
        nonce: &[u8; AUTH_BYTES],
        proof: &[u8; AUTH_BYTES],
    ) -> Result<[u8; AUTH_BYTES], Refused> {
        let p = self.peers.get_mut(peer).ok_or(Refused::NoChallenge)?;
        let (challenge, at) = p.challenge.take().ok_or(Refused::NoChallenge)?;
        if at.elapsed() > CHALLENGE_TTL {
            return Err(Refused::Expired);
        }
        if !self.key.check_client(&challenge, nonce, proof) {
            if !p.authenticated {
                self.peers.remove(peer);
            }
            return Err(Refused::WrongProof);
        }
        p.authenticated = true;
        Ok(self.key.service_proof(&challenge, nonce))
    }

    /// Forgets a connection that is gone.
    pub(super) fn forget(&mut self, peer: &[u8]) {
        self.peers.remove(peer);
    }

    /// Authenticated connections (pinged while quiet, so that one that is
    /// gone is forgotten).
    pub(super) fn authenticated(&self) -> impl Iterator<Item = &Vec<u8>> {
        self.peers
            .iter()
            .filter(|(_, p)| p.authenticated)
            .map(|(id, _)| id)
    }

    /// Connections known (authenticated or with a challenge outstanding).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.peers.len()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn key() -> AuthKey {
        AuthKey::new(*b"a key of the service, 32 bytes..").unwrap()
    }

    #[test]
    fn a_good_answer_authenticates_once_and_a_bad_one_never() {
        let mut gate = Gate::new(key());
        let nonce = auth::random_bytes();
        assert_eq!(
            gate.authenticate(b"p", &nonce, &[0; AUTH_BYTES]),
            Err(Refused::NoChallenge)
        );
        let c = gate.challenge(b"p", "").unwrap();
        let proof = key().client_proof(&c, &nonce);
        let theirs = gate.authenticate(b"p", &nonce, &proof).unwrap();
        assert!(key().check_service(&c, &nonce, &theirs));
        assert!(gate.is_authenticated(b"p"));
        assert!(!gate.is_authenticated(b"q"));
        // The challenge is used up: the same answer again is refused.
        assert_eq!(
            gate.authenticate(b"p", &nonce, &proof),
            Err(Refused::NoChallenge)
        );
        // Another connection cannot use that answer, nor a wrong key's.
        let c2 = gate.challenge(b"q", "").unwrap();
        assert_eq!(
            gate.authenticate(b"q", &nonce, &proof),
            Err(Refused::WrongProof)
        );
        assert!(!gate.is_authenticated(b"q"));
        let wrong = AuthKey::new(*b"not the key of the service......").unwrap();
        gate.challenge(b"q", "").unwrap();
        assert_ne!(c2, [0; AUTH_BYTES]);
        assert_eq!(
            gate.authenticate(b"q", &nonce, &wrong.client_proof(&c2, &nonce)),
            Err(Refused::WrongProof)
        );
        // A new Hello starts over.
        gate.challenge(b"p", "").unwrap();
        assert!(!gate.is_authenticated(b"p"));
        gate.forget(b"p");
        assert_eq!(gate.authenticated().count(), 0);
    }

    /// Distinct addresses, as from many hosts.
    fn addr(i: u32) -> String {
        format!("10.0.{}.{}", i / 256, i % 256)
    }

    #[test]
    fn connection_tokens_admit_once_and_only_with_the_key() {
        let mut gate = Gate::new(key());
        let now = auth::unix_now();
        let t = key().connection_token(now);
        assert_eq!(gate.admit(b"lanes", t.as_bytes(), now), Ok(()));
        assert_eq!(
            gate.admit(b"lanes", t.as_bytes(), now),
            Err(Turned::Replayed)
        );
        let t2 = key().connection_token(now);
        assert_eq!(
            gate.admit(b"other", t2.as_bytes(), now),
            Err(Turned::NoToken)
        );
        assert_eq!(gate.admit(b"lanes", t2.as_bytes(), now), Ok(()));
        let wrong = AuthKey::new(*b"not the key of the service......").unwrap();
        assert_eq!(
            gate.admit(b"lanes", wrong.connection_token(now).as_bytes(), now),
            Err(Turned::Token(TokenError::WrongProof))
        );
        assert_eq!(
            gate.admit(b"lanes", b"", now),
            Err(Turned::Token(TokenError::Malformed))
        );
        let old = key().connection_token(now - 2 * TOKEN_SKEW_SECS);
        assert_eq!(
            gate.admit(b"lanes", old.as_bytes(), now),
            Err(Turned::Token(TokenError::Stale))
        );
    }

    #[test]
    fn a_flood_of_hellos_is_refused_and_evicts_no_outstanding_challenge() {
        let mut gate = Gate::new(key());
        // A well-behaved client says Hello first.
        let c = gate.challenge(b"good", "192.168.0.1").unwrap();
        let mut refused = 0;
        for i in 0..(MAX_PENDING + 100) as u32 {
            if gate.challenge(&i.to_le_bytes(), &addr(i)) == Err(Busy) {
                refused += 1;
            }
        }
        assert!(gate.len() <= MAX_PENDING, "{}", gate.len());
        assert_eq!(refused, 101, "the Hellos beyond the limit are refused");
        // A connection with a challenge may say Hello again while full.
        let mine = 7u32.to_le_bytes();
        assert!(gate.challenge(&mine, &addr(7)).is_ok());
        assert!(gate.challenge(b"late", "192.168.0.2").is_err());
        // The flood took nothing from the first client: its answer is
        // still good (and frees its slot).
        let n = auth::random_bytes();
        assert!(gate
            .authenticate(b"good", &n, &key().client_proof(&c, &n))
            .is_ok());
        assert!(gate.challenge(b"late", "192.168.0.2").is_ok());
        assert!(gate.challenge(b"later", "192.168.0.3").is_err());
        // Expired challenges free their slots.
        for p in gate.peers.values_mut() {
            if let Some((_, t)) = p.challenge.as_mut() {
                *t -= CHALLENGE_TTL + Duration::from_secs(1);
            }
        }
        assert!(gate.challenge(b"latest", "192.168.0.3").is_ok());
    }

    #[test]
    fn one_address_cannot_fill_the_table() {
        let mut gate = Gate::new(key());
        for i in 0..MAX_PENDING_PER_PEER as u32 {
            assert!(gate.challenge(&i.to_le_bytes(), "10.9.9.9").is_ok());
        }
        let e = gate.challenge(b"one more", "10.9.9.9").unwrap_err();
        assert!(e.to_string().contains("from one address"), "{e}");
        // Another address is served.
        let c = gate.challenge(b"other", "10.1.1.1").unwrap();
        let n = auth::random_bytes();
        assert!(gate
            .authenticate(b"other", &n, &key().client_proof(&c, &n))
            .is_ok());
    }
}
