//! The resize notification at the protocol level, from a hand-written
//! front-end: it negotiates BACKEND_REQ and hands over a back-end channel
//! (SET_BACKEND_REQ_FD, through the daemon's relay); a resize through the
//! control API then sends VHOST_USER_BACKEND_CONFIG_CHANGE_MSG on it, and
//! GET_CONFIG answers the new capacity. A front-end that never answers
//! delays the resize by the ack timeout only, and one without a channel
//! is reported as not told.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ringblk_testkit::frontend::*;
use ringblk_testkit::{Daemon, DaemonOptions, MIB, test_dir};

const SIZE: u64 = 64 * MIB;
const SET_BACKEND_REQ_FD: u32 = 21;
const P_BACKEND_REQ: u64 = 1 << 5;
const CONFIG_CHANGE_MSG: u32 = 2;

fn start(dir: &Path) -> (Daemon, PathBuf) {
    let api = dir.join("api.sock");
    let d = Daemon::start_in(
        dir,
        DaemonOptions {
            size: SIZE,
            args: &["--api", api.to_str().unwrap()],
            ..DaemonOptions::default()
        },
    );
    (d, api)
}

fn capacity(c: &Conn) -> u64 {
    u64::from_le_bytes(c.config(0, 8).try_into().unwrap())
}

/// PUT /api/v1/resize on a thread: the answer waits for the front-end.
fn resize_async(api: &Path, size: u64) -> std::thread::JoinHandle<(u16, serde_json::Value)> {
    let api = api.to_str().unwrap().to_string();
    std::thread::spawn(move || {
        let body = format!("{{\"size\": {size}}}");
        let (status, _, body) =
            ringblk_metrics::request(&api, "PUT", "/api/v1/resize", body.as_bytes()).unwrap();
        (status, serde_json::from_str(&body).unwrap())
    })
}

/// A front-end with REPLY_ACK and BACKEND_REQ, and its end of the channel.
fn connect_with_channel(d: &Daemon) -> (Conn, UnixStream) {
    let c = Conn::connect(&d.socket);
    c.handshake_with(0, P_BACKEND_REQ);
    let (ours, theirs) = UnixStream::pair().unwrap();
    c.ok(SET_BACKEND_REQ_FD, &[], &[theirs.as_raw_fd()]);
    drop(theirs);
    ours.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    (c, ours)
}

#[test]
fn a_resize_is_announced_on_the_backend_channel() {
    let dir = test_dir();
    let (mut d, api) = start(dir.path());
    let (c, mut channel) = connect_with_channel(&d);
    assert_eq!(capacity(&c), SIZE / 512);

    let resize = resize_async(&api, 2 * SIZE);
    let mut hdr = [0u8; 12];
    channel.read_exact(&mut hdr).expect("CONFIG_CHANGE_MSG");
    let word = |i: usize| u32::from_le_bytes(hdr[i..i + 4].try_into().unwrap());
    assert_eq!(word(0), CONFIG_CHANGE_MSG);
    assert_ne!(word(4) & FLAG_NEED_REPLY, 0, "REPLY_ACK was negotiated");
    assert_eq!(word(8), 0, "no payload");
    // What QEMU does before it answers: read the configuration again.
    assert_eq!(capacity(&c), 2 * SIZE / 512);
    let mut reply = header(CONFIG_CHANGE_MSG, FLAG_VERSION | FLAG_REPLY, 8).to_vec();
    reply.extend_from_slice(&0u64.to_le_bytes());
    channel.write_all(&reply).unwrap();
    let (status, answer) = resize.join().unwrap();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["guest_notified"], true, "{answer}");
    assert_eq!(answer["size"], 2 * SIZE);

    // A front-end that never answers holds the resize for the ack timeout
    // only, and the API says the guest may not know.
    let started = Instant::now();
    let resize = resize_async(&api, 3 * SIZE);
    channel
        .read_exact(&mut hdr)
        .expect("second CONFIG_CHANGE_MSG");
    assert_not_told(resize.join().unwrap(), "no answer");
    assert!(started.elapsed() < Duration::from_secs(15));
    assert_eq!(capacity(&c), 3 * SIZE / 512);
    d.assert_running();
}

/// A resize that succeeded, and says the guest was not told, and why.
fn assert_not_told((status, answer): (u16, serde_json::Value), why: &str) {
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["guest_notified"], false, "{answer}");
    let error = answer["notify_error"].as_str().unwrap_or_default();
    assert!(error.contains(why), "'{why}' not in {answer}");
}

#[test]
fn without_a_channel_the_resize_says_the_guest_was_not_told() {
    let dir = test_dir();
    let (mut d, api) = start(dir.path());
    let c = Conn::connect(&d.socket);
    c.handshake(0);
    assert_not_told(resize_async(&api, 2 * SIZE).join().unwrap(), "BACKEND_REQ");
    // GET_CONFIG has the new capacity all the same.
    assert_eq!(capacity(&c), 2 * SIZE / 512);
    d.assert_running();
}
