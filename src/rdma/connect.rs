//! Out-of-band exchange of [`ConnectionRecord`]s over TCP, as perftest and NCCL's bootstrap do.
//!
//! One side [`listen`](Exchange::listen)s where it is told and [`serve`](Exchange::serve)s;
//! the other [`connect`](Exchange::connect)s. Both present a shared token and refuse a peer
//! whose token differs; then each sends its record and receives the peer's.
//!
//! # Exposure
//!
//! A record carries an **rkey**: whoever holds it can RDMA-write (and read) the exposed memory,
//! GPU memory included, for as long as it stays registered. So:
//! - bind the listener to the interface meant for it (a private network), never `0.0.0.0`
//!   by habit;
//! - use a token that only the two peers know (e.g. from the job launcher);
//! - know the limits: the token keeps strangers and stray jobs out, but travels in clear, as the
//!   records do; it is not protection against someone who can watch or hijack the TCP stream.
//!   Use a trusted network (or a tunnel) for that.
//!
//! Wire format (version 1): the client sends `"GDRX"`, version (u16 BE), token length (u16 BE),
//! token; the server answers `"OK"`, its token, its record ([`ConnectionRecord::WIRE_LEN`]
//! bytes) or `"NO"`, reason length (u16 BE), reason; the client then checks the server's token
//! and sends its record.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::qp::ConnectionRecord;
use crate::error::{Error, Result};

const MAGIC: &[u8; 4] = b"GDRX";
const VERSION: u16 = 1;
const MAX_TOKEN: usize = 1024;

/// A token-checked TCP exchange of connection records.
#[derive(Clone)]
pub struct Exchange {
    token: Vec<u8>,
    timeout: Duration,
}

impl std::fmt::Debug for Exchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exchange")
            .field("token", &"<hidden>")
            .field("timeout", &self.timeout)
            .finish()
    }
}

fn io_err(op: &'static str, e: io::Error) -> Error {
    Error::io(op, None, e)
}

fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Exchange {
    /// An exchange checked with `token` (1 to 1024 bytes), with a 30 s timeout.
    pub fn new(token: impl Into<Vec<u8>>) -> Result<Exchange> {
        let token = token.into();
        if token.is_empty() || token.len() > MAX_TOKEN {
            return Err(Error::InvalidArgument(format!(
                "the exchange token must be 1 to {MAX_TOKEN} bytes, got {}: share a secret between the two peers",
                token.len()
            )));
        }
        Ok(Exchange {
            token,
            timeout: Duration::from_secs(30),
        })
    }

    /// How long [`serve`](Self::serve) waits for a matching peer, the handshakes with the peers
    /// it meets meanwhile included, and how long [`connect`](Self::connect) retries, and then
    /// how long its handshake may take. Any duration works (`Duration::MAX`: no limit).
    pub fn with_timeout(mut self, timeout: Duration) -> Exchange {
        self.timeout = timeout;
        self
    }

    /// Binds a listener at `addr` (e.g. `"10.0.0.1:18515"`; port 0 picks one).
    pub fn listen(&self, addr: impl ToSocketAddrs) -> Result<TcpListener> {
        TcpListener::bind(addr).map_err(|e| io_err("bind", e))
    }

    /// Waits on `listener` for a peer presenting the same token, sends it `local` and returns
    /// its record with its address. Peers with another token or protocol are answered `"NO"`,
    /// logged and dropped, and the wait goes on until the timeout, which also ends a handshake
    /// in progress (a peer sending a byte now and then cannot hold `serve` past it).
    pub fn serve(
        &self,
        listener: &TcpListener,
        local: &ConnectionRecord,
    ) -> Result<(ConnectionRecord, SocketAddr)> {
        let deadline = deadline(self.timeout);
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err("set_nonblocking", e))?;
        loop {
            match listener.accept() {
                Ok((stream, peer)) => match self.serve_one(stream, local, deadline) {
                    Ok(r) => return Ok((r, peer)),
                    Err(e) => tracing::warn!(%peer, error = %e, "refused a connection exchange"),
                },
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(io_err(
                            "accept",
                            io::Error::new(
                                io::ErrorKind::TimedOut,
                                format!(
                                    "no peer with the right token connected within {:?}",
                                    self.timeout
                                ),
                            ),
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(io_err("accept", e)),
            }
        }
    }

    fn serve_one(
        &self,
        mut s: TcpStream,
        local: &ConnectionRecord,
        deadline: Instant,
    ) -> Result<ConnectionRecord> {
        let peer = s
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        prepare(&s)?;
        let mut head = [0u8; 8];
        read_exact_by(&mut s, &mut head, deadline)?;
        let refuse = |s: &mut TcpStream, reason: &str| -> Error {
            let r = reason.as_bytes();
            let mut msg = b"NO".to_vec();
            msg.extend_from_slice(&(r.len() as u16).to_be_bytes());
            msg.extend_from_slice(r);
            let _ = write_all_by(s, &msg, deadline);
            Error::ExchangeRefused {
                peer: peer.clone(),
                reason: reason.to_string(),
            }
        };
        if &head[..4] != MAGIC {
            return Err(refuse(&mut s, "not a gpudirect connection exchange"));
        }
        let version = u16::from_be_bytes([head[4], head[5]]);
        if version != VERSION {
            return Err(refuse(
                &mut s,
                &format!("protocol version {version}, this side speaks {VERSION}: use the same gpudirect version on both sides"),
            ));
        }
        let n = u16::from_be_bytes([head[6], head[7]]) as usize;
        if n > MAX_TOKEN {
            return Err(refuse(&mut s, "token too long"));
        }
        let mut token = vec![0u8; n];
        read_exact_by(&mut s, &mut token, deadline)?;
        if !same(&token, &self.token) {
            return Err(refuse(
                &mut s,
                "token mismatch: give both sides the same exchange token",
            ));
        }
        let mut msg = b"OK".to_vec();
        msg.extend_from_slice(&self.token);
        msg.extend_from_slice(&local.to_bytes());
        write_all_by(&mut s, &msg, deadline)?;
        let mut rec = [0u8; ConnectionRecord::WIRE_LEN];
        read_exact_by(&mut s, &mut rec, deadline)?;
        ConnectionRecord::from_bytes(&rec)
    }

    /// Connects to a serving peer at `addr` (retrying while it does not listen yet, until the
    /// timeout), checks its token, sends `local` and returns the peer's record.
    pub fn connect(
        &self,
        addr: impl ToSocketAddrs,
        local: &ConnectionRecord,
    ) -> Result<ConnectionRecord> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| io_err("resolve", e))?
            .collect();
        let retry_until = deadline(self.timeout);
        let mut s = 'outer: loop {
            let mut last = None;
            for a in &addrs {
                let left = retry_until
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1));
                match TcpStream::connect_timeout(a, left) {
                    Ok(s) => break 'outer s,
                    Err(e) => last = Some(e),
                }
            }
            let e = last.unwrap_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "the address resolved to nothing",
                )
            });
            let retry = matches!(
                e.kind(),
                io::ErrorKind::ConnectionRefused | io::ErrorKind::TimedOut
            );
            if !retry || Instant::now() >= retry_until {
                return Err(io_err("connect", e));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let peer = s
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        prepare(&s)?;
        // The handshake gets the timeout again, from now: a server sending a byte now and then
        // cannot hold it past that.
        let deadline = deadline(self.timeout);
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&VERSION.to_be_bytes());
        hello.extend_from_slice(&(self.token.len() as u16).to_be_bytes());
        hello.extend_from_slice(&self.token);
        write_all_by(&mut s, &hello, deadline)?;
        let mut status = [0u8; 2];
        read_exact_by(&mut s, &mut status, deadline)?;
        match &status {
            b"OK" => {}
            b"NO" => {
                let mut n = [0u8; 2];
                read_exact_by(&mut s, &mut n, deadline)?;
                let mut reason = vec![0u8; u16::from_be_bytes(n) as usize];
                read_exact_by(&mut s, &mut reason, deadline)?;
                return Err(Error::ExchangeRefused {
                    peer,
                    reason: String::from_utf8_lossy(&reason).into_owned(),
                });
            }
            _ => {
                return Err(Error::ExchangeRefused {
                    peer,
                    reason: "the peer is not a gpudirect connection exchange".into(),
                })
            }
        }
        let mut token = vec![0u8; self.token.len()];
        read_exact_by(&mut s, &mut token, deadline)?;
        if !same(&token, &self.token) {
            return Err(Error::ExchangeRefused {
                peer,
                reason: "the server answered with another token: give both sides the same exchange token".into(),
            });
        }
        let mut rec = [0u8; ConnectionRecord::WIRE_LEN];
        read_exact_by(&mut s, &mut rec, deadline)?;
        let remote = ConnectionRecord::from_bytes(&rec)?;
        write_all_by(&mut s, &local.to_bytes(), deadline)?;
        Ok(remote)
    }
}

/// `now + wait`, or (for a wait too long to represent, e.g. `Duration::MAX`) a century from now.
fn deadline(wait: Duration) -> Instant {
    super::qp::deadline(wait)
}

/// Blocking mode with no delay; the timeouts are set per call (`read_exact_by`, `write_all_by`).
fn prepare(s: &TcpStream) -> Result<()> {
    s.set_nonblocking(false)
        .map_err(|e| io_err("set_nonblocking", e))?;
    let _ = s.set_nodelay(true);
    Ok(())
}

/// The time left until `deadline`, or a `TimedOut` error naming `op`.
fn left(deadline: Instant, op: &'static str) -> Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io_err(
            op,
            io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer did not finish the exchange within the timeout",
            ),
        ));
    }
    Ok(left)
}

/// `read_exact` that ends at `deadline` however the peer paces its bytes.
fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<()> {
    let mut off = 0;
    while off < buf.len() {
        s.set_read_timeout(Some(left(deadline, "read")?))
            .map_err(|e| io_err("set_read_timeout", e))?;
        match s.read(&mut buf[off..]) {
            Ok(0) => {
                return Err(io_err(
                    "read",
                    io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed the connection during the exchange",
                    ),
                ))
            }
            Ok(n) => off += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(io_err("read", e)),
        }
    }
    Ok(())
}

/// `write_all` that ends at `deadline` however slowly the peer reads.
fn write_all_by(s: &mut TcpStream, buf: &[u8], deadline: Instant) -> Result<()> {
    let mut off = 0;
    while off < buf.len() {
        s.set_write_timeout(Some(left(deadline, "write")?))
            .map_err(|e| io_err("set_write_timeout", e))?;
        match s.write(&buf[off..]) {
            Ok(0) => {
                return Err(io_err(
                    "write",
                    io::Error::new(io::ErrorKind::WriteZero, "the peer stopped reading"),
                ))
            }
            Ok(n) => off += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(io_err("write", e)),
        }
    }
    Ok(())
}
