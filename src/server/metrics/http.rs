//! The HTTP side of `--metrics`: one thread, a bounded number of
//! connections, each answered once and closed.
//!
//! The listener and every connection are non-blocking; the thread looks at
//! them in turns (every [`TICK`] while a connection is open, every
//! [`IDLE_TICK`] otherwise). At most [`MAX_CONNECTIONS`] are held: a new
//! one beyond that closes the one that has been waiting longest for its
//! request, so idle connections cannot lock a scraper out, and none is
//! held past [`REQUEST_WITHIN`]. A request is one `GET /metrics` head of at
//! most [`MAX_HEAD_BYTES`]; the reply says `Connection: close`. Nothing
//! here grows with the number of connections a peer opens.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::Metrics;

/// Most connections held at once.
pub const MAX_CONNECTIONS: usize = 64;
/// How long a connection may take to send its request.
pub const REQUEST_WITHIN: Duration = Duration::from_secs(5);
/// Largest request head read.
const MAX_HEAD_BYTES: usize = 8 << 10;
/// How long writing one reply may take.
const WRITE_WITHIN: Duration = Duration::from_secs(5);
/// Pause between two looks while connections are open.
const TICK: Duration = Duration::from_millis(5);
/// Pause between two looks while none is (how soon a new one is seen,
/// and how soon the thread stops).
const IDLE_TICK: Duration = Duration::from_millis(25);

/// Why the metrics endpoint could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot serve metrics on {addr}: {reason} (give HOST:PORT, e.g. 127.0.0.1:9400)")]
pub struct MetricsError {
    pub addr: String,
    pub reason: String,
}

/// The HTTP thread of `--metrics`; stops when dropped.
#[derive(Debug)]
pub struct MetricsServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// The address it listens on (the port chosen when `:0` was given).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves `metrics` at `http://ADDR/metrics` on a thread of its own.
pub fn serve_http(addr: &str, metrics: Arc<Metrics>) -> Result<MetricsServer, MetricsError> {
    let fail = |reason: String| MetricsError {
        addr: addr.to_string(),
        reason,
    };
    let sock: SocketAddr = addr
        .parse()
        .map_err(|e: std::net::AddrParseError| fail(e.to_string()))?;
    let listener = TcpListener::bind(sock).map_err(|e| fail(e.to_string()))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| fail(e.to_string()))?;
    let bound = listener.local_addr().map_err(|e| fail(e.to_string()))?;
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    let thread = std::thread::Builder::new()
        .name("lanes-metrics".into())
        .spawn(move || Endpoint::new(listener, metrics).run(&flag))
        .map_err(|e| fail(e.to_string()))?;
    tracing::info!(%bound, "metrics at http://{bound}/metrics");
    Ok(MetricsServer {
        addr: bound,
        stop,
        thread: Some(thread),
    })
}

/// A connection waiting for its request.
struct Conn {
    stream: TcpStream,
    head: Vec<u8>,
    since: Instant,
}

struct Endpoint {
    listener: TcpListener,
    metrics: Arc<Metrics>,
    conns: Vec<Conn>,
}

/// What a connection's bytes so far amount to.
enum Head {
    /// Not a whole head yet.
    Partial,
    /// `(method, path)` of a whole head.
    Request(String, String),
    /// Too long or not HTTP.
    Bad,
}

fn parse_head(bytes: &[u8]) -> Head {
    let Some(end) = bytes.windows(4).position(|w| w == b"\r\n\r\n") else {
        return if bytes.len() > MAX_HEAD_BYTES {
            Head::Bad
        } else {
            Head::Partial
        };
    };
    let Ok(text) = std::str::from_utf8(&bytes[..end]) else {
        return Head::Bad;
    };
    let mut parts = text.lines().next().unwrap_or("").split_whitespace();
    match (parts.next(), parts.next(), parts.next()) {
        (Some(method), Some(target), Some(v)) if v.starts_with("HTTP/") => Head::Request(
            method.to_string(),
            target.split('?').next().unwrap_or("").to_string(),
        ),
        _ => Head::Bad,
    }
}

/// A whole reply with `Connection: close`.
fn response(status: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

impl Endpoint {
    fn new(listener: TcpListener, metrics: Arc<Metrics>) -> Self {
        Endpoint {
            listener,
            metrics,
            conns: Vec::new(),
        }
    }

    fn run(mut self, stop: &AtomicBool) {
        while !stop.load(Ordering::SeqCst) {
            self.accept();
            self.serve();
            std::thread::sleep(if self.conns.is_empty() {
                IDLE_TICK
            } else {
                TICK
            });
        }
    }

    /// Takes every connection waiting; beyond [`MAX_CONNECTIONS`] the one
    /// waiting longest is closed.
    fn accept(&mut self) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    if self.conns.len() >= MAX_CONNECTIONS {
                        // The oldest is first: connections are pushed in
                        // arrival order.
                        self.conns.remove(0);
                        tracing::debug!("metrics: connection limit reached, the oldest closed");
                    }
                    self.conns.push(Conn {
                        stream,
                        head: Vec::new(),
                        since: Instant::now(),
                    });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    // Out of descriptors and the like: the connections held
                    // still go on; accepting is tried again next turn.
                    tracing::debug!(error = %e, "metrics: accept failed");
                    return;
                }
            }
        }
    }

    /// Reads what each connection sent; answers whole requests, drops
    /// closed, bad and timed-out connections.
    fn serve(&mut self) {
        let mut i = 0;
        while i < self.conns.len() {
            let keep = self.step(i);
            if keep {
                i += 1;
            } else {
                self.conns.remove(i);
            }
        }
    }

    /// One look at connection `i`; whether it stays.
    fn step(&mut self, i: usize) -> bool {
        let c = &mut self.conns[i];
        let mut buf = [0u8; 2048];
        loop {
            match c.stream.read(&mut buf) {
                Ok(0) => return false,
                Ok(n) => {
                    c.head.extend_from_slice(&buf[..n]);
                    if c.head.len() > MAX_HEAD_BYTES {
                        break;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
        let reply = match parse_head(&c.head) {
            Head::Partial if c.since.elapsed() < REQUEST_WITHIN => return true,
            Head::Partial => return false,
            Head::Bad => response("400 Bad Request", "text/plain", b"bad request\n"),
            Head::Request(method, _) if method != "GET" => {
                response("405 Method Not Allowed", "text/plain", b"only GET\n")
            }
            Head::Request(_, path) if path != "/metrics" => {
                response("404 Not Found", "text/plain", b"see /metrics\n")
            }
            Head::Request(..) => match self.metrics.encode() {
                Ok(text) => response("200 OK", OPENMETRICS, text.as_bytes()),
                Err(_) => response(
                    "500 Internal Server Error",
                    "text/plain",
                    b"encoding failed\n",
                ),
            },
        };
        let c = &mut self.conns[i];
        // The reply is written blocking, bounded in time.
        let written = c
            .stream
            .set_nonblocking(false)
            .and_then(|()| c.stream.set_write_timeout(Some(WRITE_WITHIN)))
            .and_then(|()| c.stream.write_all(&reply))
            .and_then(|()| c.stream.flush());
        if let Err(e) = written {
            tracing::debug!(error = %e, "metrics reply not delivered");
        }
        let _ = c.stream.shutdown(std::net::Shutdown::Write);
        false
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn heads_are_parsed_and_bounded() {
        assert!(matches!(
            parse_head(b"GET /metrics HTTP/1.1\r\nHost"),
            Head::Partial
        ));
        match parse_head(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n") {
            Head::Request(m, p) => assert_eq!((m.as_str(), p.as_str()), ("GET", "/metrics")),
            _ => panic!("a request"),
        }
        assert!(matches!(parse_head(b"hello\r\n\r\n"), Head::Bad));
        assert!(matches!(
            parse_head(&vec![b'a'; MAX_HEAD_BYTES + 1]),
            Head::Bad
        ));
    }

    fn get(addr: SocketAddr, path: &str) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    #[test]
    fn many_idle_connections_do_not_lock_out_a_scrape() {
        let m = Arc::new(Metrics::new());
        let server = serve_http("127.0.0.1:0", m).unwrap();
        let addr = server.addr();
        // Three times the limit, none sending anything.
        let idle: Vec<TcpStream> = (0..3 * MAX_CONNECTIONS)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        let text = get(addr, "/metrics");
        assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
        assert!(text.contains("lanes_sessions_open"), "{text}");
        assert!(get(addr, "/other").starts_with("HTTP/1.1 404"));
        // The server closed the excess idle connections: reading one of the
        // oldest ends (EOF or reset) instead of waiting.
        let mut first = idle.into_iter().next().unwrap();
        first.set_read_timeout(Some(REQUEST_WITHIN * 3)).unwrap();
        let mut b = [0u8; 1];
        match first.read(&mut b) {
            Ok(n) => assert_eq!(n, 0),
            Err(e) => assert!(
                !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
                "the oldest idle connection is still open"
            ),
        }
    }
}
