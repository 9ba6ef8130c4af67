//! The resize notification at the protocol level, from a hand-written
//! front-end: it negotiates BACKEND_REQ and hands over a back-end channel
//! (SET_BACKEND_REQ_FD, through the daemon's relay); a resize through the
//! control API then sends VHOST_USER_BACKEND_CONFIG_CHANGE_MSG on it, and
//! GET_CONFIG answers the new capacity. A front-end that never answers
//! delays the resize by the channel's deadline only, so does one that
//! never reads the channel (its socket buffer full), and neither holds
//! up the API's other requests; one without a channel is reported as not
//! told.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ringblk_testkit::frontend::*;
use ringblk_testkit::{Daemon, DaemonOptions, MIB, ringblk_bin, test_dir};

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
    let got = ringblk::vhost::relay::wire::Header::from_bytes(&hdr);
    assert_eq!(got.request, CONFIG_CHANGE_MSG);
    assert_ne!(got.flags & FLAG_NEED_REPLY, 0, "REPLY_ACK was negotiated");
    assert_eq!(got.size, 0, "no payload");
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

/// A front-end whose back-end channel is wedged: it never reads it, and
/// the channel's socket buffer is full, so the daemon's send cannot go
/// out. Returns the connection and the front-end's end of the channel
/// (both kept open: a closed one would fail the send at once).
fn connect_wedged(d: &Daemon) -> (Conn, UnixStream) {
    let c = Conn::connect(&d.socket);
    c.handshake_with(0, P_BACKEND_REQ);
    let (ours, theirs) = UnixStream::pair().unwrap();
    c.ok(SET_BACKEND_REQ_FD, &[], &[theirs.as_raw_fd()]);
    // The daemon's end is `theirs`: what we write into it fills the
    // buffer its own sends would go to.
    let junk = [0u8; 4096];
    let mut filled = 0;
    // SAFETY: send reads at most junk.len() bytes from `junk`; the fd is
    // `theirs`, open for the call.
    while unsafe {
        libc::send(
            theirs.as_raw_fd(),
            junk.as_ptr().cast(),
            junk.len(),
            libc::MSG_DONTWAIT,
        )
    } > 0
    {
        filled += junk.len();
    }
    assert!(filled > 0, "the channel's buffer took nothing");
    drop(theirs);
    (c, ours)
}

/// `ringblk ctl --api API ARGS...` on a thread: (exit code, stdout,
/// stderr, how long it took).
fn ctl_async(
    api: &Path,
    args: &[&str],
) -> std::sync::mpsc::Receiver<(Option<i32>, String, String, Duration)> {
    let mut cmd = std::process::Command::new(ringblk_bin());
    cmd.arg("ctl").arg("--api").arg(api).args(args);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let started = Instant::now();
        let out = cmd.output().unwrap();
        let _ = tx.send((
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
            started.elapsed(),
        ));
    });
    rx
}

/// The channel's deadline (`vhost::relay::channel::DEADLINE`).
const DEADLINE: Duration = Duration::from_secs(2);

/// A wedged channel delays `ctl resize` by the deadline and no more, and
/// the resize says the guest was not told. CONFIG_CHANGE_MSG used to be
/// written with no deadline, so the resize waited until the front-end
/// closed the channel (`ctl` gave up after 3 s, the daemon's API never).
#[test]
fn a_wedged_backend_channel_delays_a_resize_by_the_deadline_only() {
    let dir = test_dir();
    let (mut d, api) = start(dir.path());
    let (c, _channel) = connect_wedged(&d);
    let resize = ctl_async(&api, &["resize", &(2 * SIZE).to_string()]);
    let (code, out, err, took) = resize
        .recv_timeout(Duration::from_secs(10))
        .expect("ctl resize never returned");
    assert_eq!(code, Some(0), "ctl resize failed after {took:?}: {err}");
    assert!(
        out.contains("could NOT be told") && out.contains("did not read"),
        "{out}"
    );
    assert!(
        took < DEADLINE + Duration::from_millis(800),
        "ctl resize took {took:?}"
    );
    assert_eq!(capacity(&c), 2 * SIZE / 512);
    // The next resize is not stuck behind the first: it waits its own
    // deadline, and the API still answers everything else.
    let (code, _, err, took) = ctl_async(&api, &["resize", &(3 * SIZE).to_string()])
        .recv_timeout(Duration::from_secs(10))
        .expect("second ctl resize never returned");
    assert_eq!(code, Some(0), "second resize: {err}");
    assert!(took < DEADLINE + Duration::from_millis(800), "{took:?}");
    let (code, out, err, _) = ctl_async(&api, &["status"])
        .recv_timeout(Duration::from_secs(10))
        .expect("ctl status");
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains(&format!("\"size\": {}", 3 * SIZE)), "{out}");
    d.assert_running();
}

/// While a resize waits on a wedged channel, `ctl status` and `ctl qos`
/// answer at once: the resize holds none of the API's locks while it
/// sends, and the API serves requests side by side. (An API that answers
/// one request at a time makes them wait for the resize's deadline.)
#[test]
fn status_and_qos_answer_at_once_while_a_resize_waits_on_a_wedged_channel() {
    let dir = test_dir();
    let (mut d, api) = start(dir.path());
    let (_c, _channel) = connect_wedged(&d);
    let resize = ctl_async(&api, &["resize", &(2 * SIZE).to_string()]);
    // Well inside the resize's wait.
    std::thread::sleep(Duration::from_millis(300));
    for args in [&["status"][..], &["qos"][..]] {
        let (code, _, err, took) = ctl_async(&api, args)
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("ctl {args:?} never returned"));
        assert_eq!(code, Some(0), "ctl {args:?}: {err}");
        assert!(
            took < Duration::from_millis(500),
            "ctl {args:?} took {took:?} while a resize waited on the front-end"
        );
    }
    let (code, _, err, _) = resize
        .recv_timeout(Duration::from_secs(10))
        .expect("ctl resize never returned");
    assert_eq!(code, Some(0), "{err}");
    d.assert_running();
}
