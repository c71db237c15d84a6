//! Pre-shared-key authentication of a connection, by challenge and
//! response at Hello (HMAC-SHA-256, `hmac` and `sha2` crates).
//!
//! The service's Hello reply carries a fresh random 32-byte challenge
//! (per Hello, per connection). The client answers with
//! `Authenticate { nonce, proof }`: its own random nonce, and
//! `HMAC(key, "lanes-auth client" ‖ challenge ‖ nonce)`. The service checks
//! the proof in constant time (one try per challenge) and answers
//! `Authenticated { proof: HMAC(key, "lanes-auth service" ‖ challenge ‖
//! nonce) }`, which the client checks in turn: each side shows the other it
//! holds the key, the key never crosses the wire, and a proof is good for
//! one challenge only. Nothing is encrypted (see docs/protocol.md).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a challenge, a nonce and a proof.
pub const AUTH_BYTES: usize = 32;

/// Fewest bytes a key may have.
pub const MIN_KEY_BYTES: usize = 16;

/// Why a key could not be read.
#[derive(Debug, thiserror::Error)]
pub enum AuthKeyError {
    #[error("cannot read the key file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("the key in {path} has {bytes} bytes, fewer than {MIN_KEY_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > {path}`)")]
    Short { path: String, bytes: usize },
}

/// A pre-shared key. Its bytes are never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct AuthKey(Vec<u8>);

impl std::fmt::Debug for AuthKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AuthKey({} bytes)", self.0.len())
    }
}

impl AuthKey {
    /// The key from bytes (at least [`MIN_KEY_BYTES`]).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Option<AuthKey> {
        let bytes = bytes.into();
        (bytes.len() >= MIN_KEY_BYTES).then_some(AuthKey(bytes))
    }

    /// The key in a file: its contents with surrounding whitespace trimmed
    /// (so `base64` output with its newline works), at least
    /// [`MIN_KEY_BYTES`] bytes.
    pub fn from_file(path: &std::path::Path) -> Result<AuthKey, AuthKeyError> {
        let shown = path.display().to_string();
        let raw = std::fs::read(path).map_err(|source| AuthKeyError::Read {
            path: shown.clone(),
            source,
        })?;
        let start = raw
            .iter()
            .position(|b| !b.is_ascii_whitespace())
            .unwrap_or(raw.len());
        let end = raw
            .iter()
            .rposition(|b| !b.is_ascii_whitespace())
            .map_or(start, |e| e + 1);
        let bytes = raw.get(start..end).unwrap_or_default().to_vec();
        let len = bytes.len();
        AuthKey::new(bytes).ok_or(AuthKeyError::Short {
            path: shown,
            bytes: len,
        })
    }

    fn mac(
        &self,
        role: &[u8],
        challenge: &[u8; AUTH_BYTES],
        nonce: &[u8; AUTH_BYTES],
    ) -> Hmac<Sha256> {
        let mut mac = self.mac_of(role);
        mac.update(challenge);
        mac.update(nonce);
        mac
    }

    /// The client's proof for a challenge and its nonce.
    pub fn client_proof(
        &self,
        challenge: &[u8; AUTH_BYTES],
        nonce: &[u8; AUTH_BYTES],
    ) -> [u8; AUTH_BYTES] {
        self.mac(b"client", challenge, nonce)
            .finalize()
            .into_bytes()
            .into()
    }

    /// The service's proof for a challenge and the client's nonce.
    pub fn service_proof(
        &self,
        challenge: &[u8; AUTH_BYTES],
        nonce: &[u8; AUTH_BYTES],
    ) -> [u8; AUTH_BYTES] {
        self.mac(b"service", challenge, nonce)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is the client's proof (compared in constant time).
    pub fn check_client(
        &self,
        challenge: &[u8; AUTH_BYTES],
        nonce: &[u8; AUTH_BYTES],
        proof: &[u8; AUTH_BYTES],
    ) -> bool {
        self.mac(b"client", challenge, nonce)
            .verify_slice(proof)
            .is_ok()
    }

    /// Whether `proof` is the service's proof (compared in constant time).
    pub fn check_service(
        &self,
        challenge: &[u8; AUTH_BYTES],
        nonce: &[u8; AUTH_BYTES],
        proof: &[u8; AUTH_BYTES],
    ) -> bool {
        self.mac(b"service", challenge, nonce)
            .verify_slice(proof)
            .is_ok()
    }
}

/// Bytes of a connection token's nonce.
pub const TOKEN_NONCE_BYTES: usize = 16;
/// Bytes of a connection token: seconds since the Unix epoch (u64 LE), a
/// random nonce, and `HMAC(key, "lanes-auth connect" ‖ seconds ‖ nonce)`.
pub const TOKEN_BYTES: usize = 8 + TOKEN_NONCE_BYTES + AUTH_BYTES;
/// How far a connection token's time may be from the service's clock.
pub const TOKEN_SKEW_SECS: u64 = 300;
/// The PLAIN user name of a connection token.
pub const TOKEN_USER: &str = "lanes";

/// Why a connection token was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("not a connection token")]
    Malformed,
    #[error("the token's time is more than {TOKEN_SKEW_SECS} s from the service's clock")]
    Stale,
    #[error("wrong proof: the peer does not hold the service's key")]
    WrongProof,
}

/// Seconds since the Unix epoch (0 for a clock before it).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl AuthKey {
    /// A fresh connection token for the time `now` (seconds since the Unix
    /// epoch), hex-encoded: the password a client presents in its ZeroMQ
    /// handshake (PLAIN, user [`TOKEN_USER`]) before the service accepts a
    /// single message from it.
    pub fn connection_token(&self, now: u64) -> String {
        let mut nonce = [0u8; TOKEN_NONCE_BYTES];
        nonce.copy_from_slice(&random_bytes()[..TOKEN_NONCE_BYTES]);
        let mac = self.token_mac(now, &nonce);
        let mut bytes = Vec::with_capacity(TOKEN_BYTES);
        bytes.extend_from_slice(&now.to_le_bytes());
        bytes.extend_from_slice(&nonce);
        bytes.extend_from_slice(&mac);
        hex(&bytes)
    }

    /// Checks a connection token against the time `now`: its nonce (which
    /// the caller must not accept twice) and time when it is good.
    pub fn check_connection_token(
        &self,
        token: &[u8],
        now: u64,
    ) -> Result<([u8; TOKEN_NONCE_BYTES], u64), TokenError> {
        if token.len() != 2 * TOKEN_BYTES {
            return Err(TokenError::Malformed);
        }
        let mut bytes = [0u8; TOKEN_BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            let hex =
                std::str::from_utf8(&token[2 * i..2 * i + 2]).map_err(|_| TokenError::Malformed)?;
            *b = u8::from_str_radix(hex, 16).map_err(|_| TokenError::Malformed)?;
        }
        let (time, rest) = bytes.split_at(8);
        let (nonce, proof) = rest.split_at(TOKEN_NONCE_BYTES);
        let mut t = [0u8; 8];
        t.copy_from_slice(time);
        let time = u64::from_le_bytes(t);
        if time.abs_diff(now) > TOKEN_SKEW_SECS {
            return Err(TokenError::Stale);
        }
        let mut n = [0u8; TOKEN_NONCE_BYTES];
        n.copy_from_slice(nonce);
        let mut mac = self.mac_of(b"connect");
        mac.update(&time.to_le_bytes());
        mac.update(&n);
        mac.verify_slice(proof)
            .map_err(|_| TokenError::WrongProof)?;
        Ok((n, time))
    }

    fn token_mac(&self, time: u64, nonce: &[u8; TOKEN_NONCE_BYTES]) -> [u8; AUTH_BYTES] {
        let mut mac = self.mac_of(b"connect");
        mac.update(&time.to_le_bytes());
        mac.update(nonce);
        mac.finalize().into_bytes().into()
    }

    fn mac_of(&self, role: &[u8]) -> Hmac<Sha256> {
        // HMAC takes keys of any length: this cannot fail.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
        mac.update(b"lanes-auth ");
        mac.update(role);
        mac
    }
}

/// Fewest bytes of a connection's routing id that the service accepts as
/// the owner of sessions. A connection is its ZeroMQ routing id, so the id
/// is what keeps one connection's sessions from another's: Lanes clients
/// choose [`connection_id`], 128 random bits that no other peer can guess;
/// ids that ZeroMQ hands out itself (a zero byte and a 32-bit counter) are
/// refused (docs/protocol.md, *Identity*).
pub const MIN_CONNECTION_ID_BYTES: usize = 16;

/// The first byte of the ids [`connection_id`] makes (ZeroMQ reserves ids
/// that start with a zero byte for the ones it assigns).
const CONNECTION_ID_MARK: u8 = b'L';

/// A fresh routing id for a client's connection: a mark byte and 16 bytes
/// from a cryptographically secure generator.
pub fn connection_id() -> [u8; MIN_CONNECTION_ID_BYTES + 1] {
    use rand::RngCore;
    let mut out = [0u8; MIN_CONNECTION_ID_BYTES + 1];
    out[0] = CONNECTION_ID_MARK;
    rand::thread_rng().fill_bytes(&mut out[1..]);
    out
}

/// Whether a routing id may own sessions: chosen by its peer (not one of
/// ZeroMQ's own, which start with a zero byte) and long enough to hold the
/// 128 random bits of [`connection_id`].
pub fn is_chosen_id(id: &[u8]) -> bool {
    id.len() >= MIN_CONNECTION_ID_BYTES && id.first().is_some_and(|&b| b != 0)
}

/// A short name for a routing id that does not give it away: the first 4
/// bytes of its SHA-256, in hex (for logs).
pub fn fingerprint(id: &[u8]) -> String {
    use sha2::Digest;
    hex(&Sha256::digest(id)[..4])
}

/// Bytes as lower-case hex, two digits each (tokens, names, logs).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// 32 bytes from a cryptographically secure generator (a challenge or a
/// nonce).
pub fn random_bytes() -> [u8; AUTH_BYTES] {
    use rand::RngCore;
    let mut out = [0u8; AUTH_BYTES];
    rand::thread_rng().fill_bytes(&mut out);
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn connection_ids_are_chosen_and_differ() {
        let a = connection_id();
        let b = connection_id();
        assert!(is_chosen_id(&a) && is_chosen_id(&b));
        assert_ne!(a, b);
        // ZeroMQ's own ids (a zero byte and a counter) and short ids are not.
        assert!(!is_chosen_id(&[0, 0x6b, 0x8b, 0x45, 0x67]));
        assert!(!is_chosen_id(b"short-id"));
        let mut zero_led = a;
        zero_led[0] = 0;
        assert!(!is_chosen_id(&zero_led));
    }

    #[test]
    fn proofs_check_only_with_the_same_key_challenge_nonce_and_role() {
        let key = AuthKey::new(*b"0123456789abcdef0123").unwrap();
        let other = AuthKey::new(*b"0123456789abcdef0124").unwrap();
        let (c, n) = (random_bytes(), random_bytes());
        let p = key.client_proof(&c, &n);
        assert!(key.check_client(&c, &n, &p));
        assert!(!other.check_client(&c, &n, &p));
        assert!(!key.check_client(&random_bytes(), &n, &p));
        assert!(!key.check_client(&c, &random_bytes(), &p));
        // A client proof is not a service proof (no reflection).
        assert!(!key.check_service(&c, &n, &p));
        assert!(key.check_service(&c, &n, &key.service_proof(&c, &n)));
        let mut bad = p;
        bad[31] ^= 1;
        assert!(!key.check_client(&c, &n, &bad));
        assert_ne!(random_bytes(), random_bytes());
    }

    #[test]
    fn connection_tokens_check_only_with_the_key_and_near_the_time() {
        let key = AuthKey::new(*b"0123456789abcdef0123").unwrap();
        let other = AuthKey::new(*b"0123456789abcdef0124").unwrap();
        let now = 1_800_000_000;
        let t = key.connection_token(now);
        assert_eq!(t.len(), 2 * TOKEN_BYTES);
        assert!(t.len() <= 255, "a PLAIN password");
        let (nonce, time) = key.check_connection_token(t.as_bytes(), now + 10).unwrap();
        assert_eq!(time, now);
        let t2 = key.connection_token(now);
        assert_ne!(t, t2);
        assert_ne!(
            key.check_connection_token(t2.as_bytes(), now).unwrap().0,
            nonce
        );
        assert_eq!(
            other.check_connection_token(t.as_bytes(), now),
            Err(TokenError::WrongProof)
        );
        assert_eq!(
            key.check_connection_token(t.as_bytes(), now + TOKEN_SKEW_SECS + 1),
            Err(TokenError::Stale)
        );
        let mut forged = t.clone().into_bytes();
        forged[0] = if forged[0] == b'0' { b'1' } else { b'0' };
        assert_eq!(
            key.check_connection_token(&forged, now),
            Err(TokenError::WrongProof)
        );
        for bad in [&b""[..], b"zz", &[b'g'; 2 * TOKEN_BYTES][..]] {
            assert_eq!(
                key.check_connection_token(bad, now),
                Err(TokenError::Malformed)
            );
        }
    }

    #[test]
    fn keys_are_read_trimmed_and_short_ones_refused() {
        let dir = std::env::temp_dir().join(format!("lanes-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("key");
        std::fs::write(&path, b"  c2VjcmV0IGtleSBvZiB0aGUgdGVzdA==\n").unwrap();
        let key = AuthKey::from_file(&path).unwrap();
        assert_eq!(
            key,
            AuthKey::new(*b"c2VjcmV0IGtleSBvZiB0aGUgdGVzdA==").unwrap()
        );
        assert_eq!(format!("{key:?}"), "AuthKey(32 bytes)");
        std::fs::write(&path, b"short\n").unwrap();
        assert!(matches!(
            AuthKey::from_file(&path),
            Err(AuthKeyError::Short { bytes: 5, .. })
        ));
        assert!(matches!(
            AuthKey::from_file(&dir.join("missing")),
            Err(AuthKeyError::Read { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
