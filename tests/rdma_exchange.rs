//! Tier-1 tests of the out-of-band connection exchange (no RDMA device needed): records travel
//! over loopback TCP between two threads, and mismatched tokens are refused on both sides.

use std::io::{Read, Write};
use std::time::Duration;

use gpudirect::rdma::{ConnectionRecord, Exchange, Gid};
use gpudirect::Error;
use rand::Rng;

fn random_record(rng: &mut impl Rng) -> ConnectionRecord {
    ConnectionRecord {
        qpn: rng.random_range(0..=0xff_ffff),
        psn: rng.random_range(0..=0xff_ffff),
        lid: rng.random(),
        gid: Gid(rng.random()),
        rkey: rng.random(),
        addr: rng.random(),
        len: rng.random(),
    }
}

#[test]
fn verbs_connection_record_serde_roundtrip() {
    let mut rng = rand::rng();
    for _ in 0..100 {
        let r = random_record(&mut rng);
        let json = serde_json::to_string(&r).unwrap();
        let back: ConnectionRecord = serde_json::from_str(&json).unwrap();
        assert_eq!(back, r);
        assert_eq!(ConnectionRecord::from_bytes(&r.to_bytes()).unwrap(), r);
    }
    let json = serde_json::to_value(ConnectionRecord::default()).unwrap();
    for k in ["qpn", "psn", "lid", "gid", "rkey", "addr", "len"] {
        assert!(json.get(k).is_some(), "missing {k} in {json}");
    }
}

fn exchange(token: &str) -> Exchange {
    Exchange::new(token)
        .unwrap()
        .with_timeout(Duration::from_secs(10))
}

#[test]
fn verbs_exchange_over_loopback_swaps_records() {
    let mut rng = rand::rng();
    let (a, b) = (random_record(&mut rng), random_record(&mut rng));
    let server = exchange("s3cret-job-42");
    let listener = server.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t = std::thread::spawn(move || server.serve(&listener, &a));
    let got_a = exchange("s3cret-job-42").connect(addr, &b).unwrap();
    let (got_b, peer) = t.join().unwrap().unwrap();
    assert_eq!(got_a, a);
    assert_eq!(got_b, b);
    assert!(peer.ip().is_loopback());
}

#[test]
fn verbs_exchange_refuses_a_token_mismatch_and_keeps_serving() {
    let mut rng = rand::rng();
    let (a, b) = (random_record(&mut rng), random_record(&mut rng));
    let server = exchange("right-token");
    let listener = server.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t = std::thread::spawn(move || server.serve(&listener, &a));

    let e = exchange("wrong-token").connect(addr, &b).unwrap_err();
    match &e {
        Error::ExchangeRefused { reason, .. } => {
            assert!(reason.contains("token mismatch"), "{reason}")
        }
        other => panic!("expected ExchangeRefused, got {other:?}"),
    }
    assert!(e.to_string().contains("same exchange token"), "{e}");

    // Something that is not a gpudirect peer at all.
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let mut answer = Vec::new();
    let _ = s.read_to_end(&mut answer);
    assert!(answer.starts_with(b"NO"), "{answer:?}");
    drop(s);

    // The right peer still gets through, and nothing leaked to the refused ones.
    let got_a = exchange("right-token").connect(addr, &b).unwrap();
    let (got_b, _) = t.join().unwrap().unwrap();
    assert_eq!((got_a, got_b), (a, b));
}

#[test]
fn verbs_exchange_client_refuses_a_server_with_another_token() {
    // A fake server that accepts anything and answers with its own token.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut head = [0u8; 8];
        s.read_exact(&mut head).unwrap();
        let mut tok = vec![0u8; u16::from_be_bytes([head[6], head[7]]) as usize];
        s.read_exact(&mut tok).unwrap();
        let mut msg = b"OK".to_vec();
        msg.extend(std::iter::repeat_n(b'x', tok.len()));
        msg.extend_from_slice(&ConnectionRecord::default().to_bytes());
        s.write_all(&msg).unwrap();
    });
    let e = exchange("mine")
        .connect(addr, &ConnectionRecord::default())
        .unwrap_err();
    assert!(
        matches!(&e, Error::ExchangeRefused { reason, .. } if reason.contains("another token")),
        "{e:?}"
    );
    t.join().unwrap();
}

#[test]
fn verbs_exchange_needs_a_token_and_times_out() {
    assert!(matches!(Exchange::new(""), Err(Error::InvalidArgument(_))));
    assert!(matches!(
        Exchange::new(vec![1u8; 2000]),
        Err(Error::InvalidArgument(_))
    ));
    let server = Exchange::new("t")
        .unwrap()
        .with_timeout(Duration::from_millis(200));
    let listener = server.listen("127.0.0.1:0").unwrap();
    let e = server
        .serve(&listener, &ConnectionRecord::default())
        .unwrap_err();
    assert!(matches!(e, Error::Io { op: "accept", .. }), "{e:?}");
}

/// Review of 2026-12-02 (minor): any timeout works, `Duration::MAX` included (on the code
/// before the fix `Instant::now() + timeout` panicked in both `serve` and `connect`).
#[test]
fn verbs_exchange_accepts_any_timeout() {
    let mut rng = rand::rng();
    let (a, b) = (random_record(&mut rng), random_record(&mut rng));
    let server = Exchange::new("t0k").unwrap().with_timeout(Duration::MAX);
    let listener = server.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t = std::thread::spawn(move || server.serve(&listener, &a));
    let got_a = Exchange::new("t0k")
        .unwrap()
        .with_timeout(Duration::MAX)
        .connect(addr, &b)
        .unwrap();
    let (got_b, _) = t.join().unwrap().unwrap();
    assert_eq!((got_a, got_b), (a, b));
}

/// Review of 2026-12-02 (minor): `serve`'s timeout bounds the whole wait, a peer's handshake
/// included. A peer that sends one byte every 300 ms (each read well within the 1 s timeout)
/// for 8 s held the code before the fix for those 8 s (until it gave up); now `serve` times
/// out after about 1 s.
#[test]
fn verbs_exchange_serve_is_not_held_past_its_timeout_by_a_trickling_peer() {
    let server = Exchange::new("t0k")
        .unwrap()
        .with_timeout(Duration::from_secs(1));
    let listener = server.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let t0 = std::time::Instant::now();
    let t = std::thread::spawn(move || server.serve(&listener, &ConnectionRecord::default()));
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let trickle = std::thread::spawn(move || {
        for b in b"GDRX\x00\x01\x00\x03t0k".iter().cycle().take(27) {
            if s.write_all(&[*b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    });
    let r = t.join().unwrap();
    let took = t0.elapsed();
    trickle.join().unwrap();
    assert!(r.is_err(), "served a trickling peer: {r:?}");
    assert!(
        took < Duration::from_secs(3),
        "serve with a 1 s timeout returned after {took:?}"
    );
}
