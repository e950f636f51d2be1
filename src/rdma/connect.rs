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

    /// How long [`serve`](Self::serve) waits for a matching peer and [`connect`](Self::connect)
    /// retries; also the read/write timeout of each step.
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
    /// logged and dropped, and the wait goes on until the timeout.
    pub fn serve(
        &self,
        listener: &TcpListener,
        local: &ConnectionRecord,
    ) -> Result<(ConnectionRecord, SocketAddr)> {
        let deadline = Instant::now() + self.timeout;
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err("set_nonblocking", e))?;
        loop {
            match listener.accept() {
                Ok((stream, peer)) => match self.serve_one(stream, local) {
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

    fn serve_one(&self, mut s: TcpStream, local: &ConnectionRecord) -> Result<ConnectionRecord> {
        let peer = s
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        self.prepare(&s)?;
        let mut head = [0u8; 8];
        s.read_exact(&mut head).map_err(|e| io_err("read", e))?;
        let refuse = |mut s: &TcpStream, reason: &str| -> Error {
            let r = reason.as_bytes();
            let mut msg = b"NO".to_vec();
            msg.extend_from_slice(&(r.len() as u16).to_be_bytes());
            msg.extend_from_slice(r);
            let _ = s.write_all(&msg);
            Error::ExchangeRefused {
                peer: peer.clone(),
                reason: reason.to_string(),
            }
        };
        if &head[..4] != MAGIC {
            return Err(refuse(&s, "not a gpudirect connection exchange"));
        }
        let version = u16::from_be_bytes([head[4], head[5]]);
        if version != VERSION {
            return Err(refuse(
                &s,
                &format!("protocol version {version}, this side speaks {VERSION}: use the same gpudirect version on both sides"),
            ));
        }
        let n = u16::from_be_bytes([head[6], head[7]]) as usize;
        if n > MAX_TOKEN {
            return Err(refuse(&s, "token too long"));
        }
        let mut token = vec![0u8; n];
        s.read_exact(&mut token).map_err(|e| io_err("read", e))?;
        if !same(&token, &self.token) {
            return Err(refuse(
                &s,
                "token mismatch: give both sides the same exchange token",
            ));
        }
        let mut msg = b"OK".to_vec();
        msg.extend_from_slice(&self.token);
        msg.extend_from_slice(&local.to_bytes());
        s.write_all(&msg).map_err(|e| io_err("write", e))?;
        let mut rec = [0u8; ConnectionRecord::WIRE_LEN];
        s.read_exact(&mut rec).map_err(|e| io_err("read", e))?;
        ConnectionRecord::from_bytes(&rec)
    }

    fn prepare(&self, s: &TcpStream) -> Result<()> {
        s.set_nonblocking(false)
            .map_err(|e| io_err("set_nonblocking", e))?;
        s.set_read_timeout(Some(self.timeout))
            .map_err(|e| io_err("set_read_timeout", e))?;
        s.set_write_timeout(Some(self.timeout))
            .map_err(|e| io_err("set_write_timeout", e))?;
        let _ = s.set_nodelay(true);
        Ok(())
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
        let deadline = Instant::now() + self.timeout;
        let mut s = 'outer: loop {
            let mut last = None;
            for a in &addrs {
                match TcpStream::connect_timeout(a, self.timeout) {
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
            if !retry || Instant::now() >= deadline {
                return Err(io_err("connect", e));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let peer = s
            .peer_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into());
        self.prepare(&s)?;
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&VERSION.to_be_bytes());
        hello.extend_from_slice(&(self.token.len() as u16).to_be_bytes());
        hello.extend_from_slice(&self.token);
        s.write_all(&hello).map_err(|e| io_err("write", e))?;
        let mut status = [0u8; 2];
        s.read_exact(&mut status).map_err(|e| io_err("read", e))?;
        match &status {
            b"OK" => {}
            b"NO" => {
                let mut n = [0u8; 2];
                s.read_exact(&mut n).map_err(|e| io_err("read", e))?;
                let mut reason = vec![0u8; u16::from_be_bytes(n) as usize];
                s.read_exact(&mut reason).map_err(|e| io_err("read", e))?;
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
        s.read_exact(&mut token).map_err(|e| io_err("read", e))?;
        if !same(&token, &self.token) {
            return Err(Error::ExchangeRefused {
                peer,
                reason: "the server answered with another token: give both sides the same exchange token".into(),
            });
        }
        let mut rec = [0u8; ConnectionRecord::WIRE_LEN];
        s.read_exact(&mut rec).map_err(|e| io_err("read", e))?;
        let remote = ConnectionRecord::from_bytes(&rec)?;
        s.write_all(&local.to_bytes())
            .map_err(|e| io_err("write", e))?;
        Ok(remote)
    }
}
