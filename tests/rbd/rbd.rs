//! The Ceph RBD engine (`--features rbd`, `serve --image rbd:POOL/IMAGE`)
//! against a real single-node cluster that this binary starts itself
//! (the kit's `ceph`), driven over the socket by libblkio:
//! - data: writes (single and batched), read-back through the daemon and
//!   through `rbd export` on the host, discard, write-zeroes and flush,
//!   all under the default seccomp filter (enforce), on every thread
//!   librbd started, then a clean SIGTERM;
//! - reconnects: the messenger drops connections at random and the daemon
//!   opens new ones under the filter;
//! - bad input: a missing image or pool, a bad `rbd:` spec, a cluster that
//!   does not answer (the daemon fails at start, in one line, within the
//!   timeout instead of hanging);
//! - `--readonly`: the image opened read-only (no watch), VIRTIO_BLK_F_RO,
//!   reads served, a write refused with IOERR and the image unchanged;
//! - SIGTERM closes the image: no watcher is left, and a daemon started
//!   on an exclusive-lock image at once writes without waiting for the
//!   OSD to time the old watch out;
//! - cephx (a cluster of its own with authentication on): a user without
//!   caps on the image's pool, and a wrong key, fail at start in one line
//!   that says permission denied; the admin serves the image.
//!
//! `RINGBLK_RBD_STRACE=FILE` runs the data tests with `--seccomp off` and
//! `strace -f` attached to the daemon after start-up, writing FILE: how the
//! RBD seccomp profile (`daemon::seccomp`) was found, and how to redo it.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use ringblk_testkit::ceph;
use ringblk_testkit::frontend;
use ringblk_testkit::vm;
use ringblk_testkit::{
    Client, Daemon, DaemonOptions, KIB, MIB, Op, assert_pattern, chunked, pattern, ringblk_bin,
};

const CHUNK: usize = 64 * 1024;

/// `serve` of an RBD image, with the shared cluster's configuration.
fn start_rbd(image: &str, extra: &[&str]) -> Daemon {
    start_rbd_with(&ceph::cluster().conf, image, extra)
}

/// `serve` of an RBD image with the configuration at `conf`.
fn start_rbd_with(conf: &Path, image: &str, extra: &[&str]) -> Daemon {
    let spec = format!("rbd:{image}");
    let conf = conf.to_str().expect("UTF-8 path");
    let mut args = vec!["--ceph-conf", conf];
    args.extend_from_slice(extra);
    let trace = std::env::var("RINGBLK_RBD_STRACE").ok();
    if trace.is_some() {
        args.extend_from_slice(&["--seccomp", "off"]);
    }
    let d = Daemon::start_with(DaemonOptions {
        image: Some(spec.into()),
        args: &args,
        ..DaemonOptions::default()
    });
    if let Some(f) = trace {
        let mut strace = Command::new("strace")
            .args(["-f", "-qq", "-o", &f, "-p", &d.pid().to_string()])
            .spawn()
            .expect("strace");
        // It ends with the daemon.
        std::thread::spawn(move || strace.wait());
        std::thread::sleep(Duration::from_secs(1));
    }
    d
}

/// Runs `ringblk serve ARGS`, which must fail with a runtime error (exit
/// status 1); returns its stderr and how long it took.
fn serve_fails(args: &[&str]) -> (String, Duration) {
    serve_exits(args, 1)
}

/// Runs `ringblk serve ARGS`, a wrong command line (exit status 2);
/// returns the first line of its error, `error: ...`.
fn serve_refuses(args: &[&str]) -> String {
    let (stderr, _) = serve_exits(args, 2);
    let first = stderr.lines().next().unwrap_or_default().to_string();
    assert!(first.starts_with("error: "), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    first
}

fn serve_exits(args: &[&str], status: i32) -> (String, Duration) {
    let dir = ringblk_testkit::test_dir();
    let sock = dir.path().join("vhost.sock");
    let started = Instant::now();
    let out = Command::new(ringblk_bin())
        .arg("serve")
        .arg("--socket")
        .arg(&sock)
        .args(args)
        .env("TMPDIR", dir.path())
        .env("RUST_LOG", "warn")
        .output()
        .expect("running ringblk serve");
    let elapsed = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(status),
        "serve {args:?} should fail with status {status}:\n{stderr}"
    );
    assert!(!sock.exists(), "a failed start left its socket behind");
    (stderr, elapsed)
}

/// The daemon's stderr, which must be one line, its error.
fn only_line(stderr: &str) -> &str {
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "not one line:\n{stderr}");
    error_line(stderr)
}

/// The one line the daemon printed as its error.
fn error_line(stderr: &str) -> &str {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("ringblk: "))
        .unwrap_or_else(|| panic!("no `ringblk:` error line in:\n{stderr}"));
    assert!(!stderr.contains("panicked"), "{stderr}");
    line
}

#[test]
fn data_discard_write_zeroes_and_flush_under_seccomp() {
    let _no_guest = vm::no_guest();
    let c = ceph::cluster();
    let image = c.create_image(32);
    let mut d = start_rbd(&image, &[]);
    let tracing = std::env::var_os("RINGBLK_RBD_STRACE").is_some();
    if !tracing {
        d.wait_for_log("seccomp filter installed");
        assert!(d.log().contains("others fatal"), "enforcing by default");
    }
    let seed = 0x0cef_0000;
    {
        let mut cl = Client::connect(&d.socket, 8 * CHUNK);
        assert_eq!(cl.capacity, 32 * MIB, "capacity from the image");
        // Every thread, librbd's included, runs under the filter.
        for t in d.threads().into_iter().filter(|_| !tracing) {
            assert_eq!(
                d.proc_status(Some(t), "Seccomp").as_deref(),
                Some("2"),
                "thread {t} is not filtered"
            );
        }
        // Single requests of several sizes, some across object boundaries
        // (4 MiB objects).
        for (off, len) in [
            (0, 4 * KIB as usize),
            (4 * MIB - 8 * KIB, 64 * KIB as usize),
            (9 * MIB + 512, 512),
            (31 * MIB, MIB as usize / 2),
        ] {
            let data = pattern(seed, off, len);
            assert_eq!(cl.write(off, &data), 0, "write of {len} at {off}");
            assert_pattern("read back", seed, off, &cl.read(off, len));
        }
        // A batch of eight writes in flight at once, then eight reads.
        let base = 12 * MIB;
        let data = pattern(seed, base, 8 * CHUNK);
        cl.buf()[..data.len()].copy_from_slice(&data);
        let writes = chunked(true, base, 8, CHUNK);
        assert_eq!(cl.batch(&writes), vec![0; 8], "batched writes");
        cl.buf()[..8 * CHUNK].fill(0xee);
        let reads = chunked(false, base, 8, CHUNK);
        assert_eq!(cl.batch(&reads), vec![0; 8], "batched reads");
        assert_pattern("batched read", seed, base, &cl.buf()[..8 * CHUNK]);
        assert_eq!(cl.flush(), 0, "flush");

        // Discard and write-zeroes read back as zeroes, and leave their
        // neighbours alone.
        assert_eq!(cl.discard(base, CHUNK as u64), 0, "discard");
        assert_eq!(
            cl.write_zeroes(base + 2 * CHUNK as u64, CHUNK as u64),
            0,
            "write-zeroes"
        );
        let got = cl.read(base, 4 * CHUNK);
        assert!(got[..CHUNK].iter().all(|b| *b == 0), "discarded range");
        assert_pattern(
            "after discard",
            seed,
            base + CHUNK as u64,
            &got[CHUNK..2 * CHUNK],
        );
        assert!(
            got[2 * CHUNK..3 * CHUNK].iter().all(|b| *b == 0),
            "zeroed range"
        );
        assert_pattern(
            "after zeroes",
            seed,
            base + 3 * CHUNK as u64,
            &got[3 * CHUNK..],
        );
        assert_eq!(cl.flush(), 0, "flush");
    }
    d.assert_running();
    // What the daemon wrote is in the image, as another client sees it.
    assert_pattern(
        "rbd export",
        seed,
        4 * MIB - 8 * KIB,
        &c.read_image(&image, 4 * MIB - 8 * KIB, 64 * KIB as usize),
    );
    let exported = c.read_image(&image, 12 * MIB, 4 * CHUNK);
    assert!(exported[..CHUNK].iter().all(|b| *b == 0), "export: discard");
    assert_pattern(
        "export",
        seed,
        12 * MIB + CHUNK as u64,
        &exported[CHUNK..2 * CHUNK],
    );

    // A second connection reuses the engines.
    {
        let mut cl = Client::connect(&d.socket, CHUNK);
        assert_pattern("second connection", seed, 0, &cl.read(0, 4 * KIB as usize));
    }
    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(30));
    assert_eq!(st.code(), Some(0), "exit after SIGTERM: {st}\n{}", d.log());
    assert!(!d.log().contains("not allowed"), "trapped:\n{}", d.log());
}

/// The messenger drops its connections at random (`ms inject socket
/// failures`) and reconnects to the monitor and the OSD while I/O runs:
/// new TCP sockets after start-up, under the filter, and no request fails.
#[test]
fn reconnects_under_seccomp() {
    let _no_guest = vm::no_guest();
    let c = ceph::cluster();
    let image = c.create_image(16);
    let dir = ringblk_testkit::test_dir();
    let conf = dir.path().join("ceph.conf");
    let shared = std::fs::read_to_string(&c.conf).expect("reading ceph.conf");
    std::fs::write(
        &conf,
        format!(
            "{shared}\n[client]\nms inject socket failures = 40\nlog file = {}\ndebug ms = 1\n",
            dir.path().join("client.log").display()
        ),
    )
    .expect("writing ceph.conf");
    let mut d = start_rbd_with(&conf, &image, &[]);
    let seed = 0x4ec0;
    let mut cl = Client::connect(&d.socket, CHUNK);
    for round in 0..3u64 {
        for i in 0..16u64 {
            let off = i * MIB + round * CHUNK as u64;
            assert_eq!(
                cl.write(off, &pattern(seed, off, CHUNK)),
                0,
                "write at {off}"
            );
        }
        for i in 0..16u64 {
            let off = i * MIB + round * CHUNK as u64;
            assert_pattern("read back", seed, off, &cl.read(off, CHUNK));
        }
    }
    assert_eq!(cl.flush(), 0);
    drop(cl);
    d.assert_running();
    let log = std::fs::read_to_string(dir.path().join("client.log")).unwrap_or_default();
    let injected = log.matches("injecting socket failure").count();
    assert!(
        injected > 0,
        "no socket failure was injected: the test tests nothing"
    );
    eprintln!("{injected} socket failures injected");
}

/// Four queues write at once to an image with exclusive-lock (Ceph's
/// default): the daemon's one image handle serves them all, so the
/// cluster sees one watcher and one lock holder (a handle per queue made
/// four watchers, passing the lock between them), every write lands, and
/// each queue gets its own completions back.
#[test]
fn queues_share_one_image_handle_and_one_lock_owner() {
    let _no_guest = vm::no_guest();
    let c = ceph::cluster();
    let image = c.create_image(16);
    let info = String::from_utf8_lossy(&c.rbd(&["info", &image]).stdout).into_owned();
    assert!(info.contains("exclusive-lock"), "rbd info:\n{info}");
    const QUEUES: usize = 4;
    const PER_QUEUE: usize = 8;
    let mut d = start_rbd(&image, &["--queues", &QUEUES.to_string()]);
    let mut cl = Client::connect_queues(&d.socket, QUEUES * PER_QUEUE * CHUNK, QUEUES);
    let seed = 0x4444;
    for round in 0..4u64 {
        // Every queue's writes in flight together; queue q writes the
        // chunks q, q + 4, q + 8, ... so the queues interleave on objects.
        let mut ops = Vec::new();
        for k in 0..QUEUES * PER_QUEUE {
            let off = round * 4 * MIB + (k * CHUNK) as u64;
            cl.buf()[k * CHUNK..(k + 1) * CHUNK].copy_from_slice(&pattern(seed, off, CHUNK));
            let write = Op::Write {
                offset: off,
                buf_off: k * CHUNK,
                len: CHUNK,
            };
            ops.push((k % QUEUES, write));
        }
        assert_eq!(
            cl.batch_queues(&ops),
            vec![0; ops.len()],
            "writes of round {round}"
        );
    }
    let status = c.rbd(&["status", "--format", "json", &image]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).expect("rbd status");
    let watchers = status["watchers"].as_array().expect("watchers");
    assert_eq!(watchers.len(), 1, "one client of the image: {status}");
    let locks = c.rbd(&["lock", "ls", "--format", "json", &image]);
    let locks: serde_json::Value = serde_json::from_slice(&locks.stdout).expect("rbd lock ls");
    assert_eq!(
        // An array since Ceph 13, an object keyed by lock id before.
        locks
            .as_array()
            .map(Vec::len)
            .or_else(|| locks.as_object().map(serde_json::Map::len)),
        Some(1),
        "one holder of the exclusive lock: {locks}"
    );
    for round in 0..4u64 {
        let off = round * 4 * MIB;
        let len = QUEUES * PER_QUEUE * CHUNK;
        let reads = chunked(false, off, QUEUES * PER_QUEUE, CHUNK);
        assert_eq!(cl.batch(&reads), vec![0; reads.len()], "reads");
        assert_pattern("read back", seed, off, &cl.buf()[..len]);
        assert_pattern("rbd export", seed, off, &c.read_image(&image, off, len));
    }
    drop(cl);
    d.assert_running();
}

/// Dirty bitmaps and backups on an RBD image (issue 23): refused, each
/// with one line that says what to use instead, and the guest's I/O is
/// not disturbed by the refusals.
#[test]
fn bitmaps_and_backups_are_refused_with_a_reason() {
    let _no_guest = vm::no_guest();
    let c = ceph::cluster();
    let image = c.create_image(16);
    let dir = ringblk_testkit::test_dir();
    let api = dir.path().join("api.sock");
    let backups = dir.path().join("backups");
    std::fs::create_dir(&backups).expect("the backup directory");
    let mut d = start_rbd(
        &image,
        &[
            "--api",
            api.to_str().expect("UTF-8 path"),
            "--backup-dir",
            backups.to_str().expect("UTF-8 path"),
        ],
    );
    let mut cl = Client::connect(&d.socket, CHUNK);
    use ringblk_testkit::{ctl_fails, ctl_ok};
    ctl_fails(
        &api,
        &["bitmap", "add", "nightly"],
        "dirty bitmaps are not supported on RBD images",
    );
    ctl_fails(
        &api,
        &["backup", "start", "--nbd", "b.sock"],
        "backups of RBD images are not supported",
    );
    let list: serde_json::Value =
        serde_json::from_str(&ctl_ok(&api, &["bitmap", "list", "--json"])).expect("JSON");
    assert_eq!(list, serde_json::json!([]));
    let data = pattern(0x23, 0, CHUNK);
    assert_eq!(cl.write(0, &data), 0);
    assert_pattern("read back", 0x23, 0, &cl.read(0, CHUNK));
    assert!(std::fs::read_dir(&backups).unwrap().next().is_none());
    drop(cl);
    d.assert_running();
}

/// `PUT /api/v1/resize` on an RBD image: growing through the shared
/// handle lets the same connection write past the old end at once;
/// shrinking needs force; with no size, a size changed by `rbd resize`
/// is re-read. All under the seccomp filter, on the API's thread.
#[test]
fn resize_through_the_api() {
    let _no_guest = vm::no_guest();
    let c = ceph::cluster();
    let image = c.create_image(16);
    let dir = ringblk_testkit::test_dir();
    let api = dir.path().join("api.sock");
    let api_str = api.to_str().expect("UTF-8 path");
    let mut d = start_rbd(&image, &["--api", api_str]);
    let resize = |body: &str| {
        let (status, _, answer) =
            ringblk_metrics::request(api_str, "PUT", "/api/v1/resize", body.as_bytes())
                .expect("PUT /api/v1/resize");
        let json = serde_json::from_str(&answer).unwrap_or(serde_json::Value::Null);
        (status, json)
    };
    let mut cl = Client::connect(&d.socket, CHUNK);
    assert_eq!(cl.capacity, 16 * MIB);
    let seed = 0x5151;
    let data = pattern(seed, 16 * MIB, CHUNK);
    assert_ne!(
        cl.write(16 * MIB, &data),
        0,
        "a write past the end must fail"
    );

    let (status, answer) = resize(r#"{"size": 33554432}"#);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["size"], 32 * MIB, "{answer}");
    let info = c.rbd(&["info", "--format", "json", &image]);
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).expect("rbd info");
    assert_eq!(info["size"], 32 * MIB, "rbd info: {info}");
    // The same connection, past the old end: the queues' handle grew.
    assert_eq!(cl.write(16 * MIB, &data), 0, "write past the old end");
    assert_pattern("read back", seed, 16 * MIB, &cl.read(16 * MIB, CHUNK));
    assert_pattern(
        "rbd export",
        seed,
        16 * MIB,
        &c.read_image(&image, 16 * MIB, CHUNK),
    );

    let (status, answer) = resize(r#"{"size": 8388608}"#);
    assert_eq!(status, 409, "a shrink without force: {answer}");

    // Grown by someone else; re-read.
    c.rbd(&["resize", "--size", "48M", &image]);
    let (status, answer) = resize("{}");
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["size"], 48 * MIB, "{answer}");
    drop(cl);
    let mut cl = Client::connect(&d.socket, CHUNK);
    assert_eq!(cl.capacity, 48 * MIB);
    assert_eq!(
        cl.write(48 * MIB - CHUNK as u64, &data),
        0,
        "write at the new end"
    );
    drop(cl);
    d.assert_running();
}

#[test]
fn missing_image_or_pool_and_bad_specs_fail_at_start() {
    let _no_guest = vm::no_guest();
    let c = ceph::cluster();
    let conf = c.conf.to_str().expect("UTF-8 path");
    let (err, _) = serve_fails(&["--image", "rbd:rbd/no-such-image", "--ceph-conf", conf]);
    assert_eq!(
        error_line(&err),
        "ringblk: rbd:rbd/no-such-image: no image 'no-such-image' in pool 'rbd'"
    );
    let (err, _) = serve_fails(&["--image", "rbd:nopool/x", "--ceph-conf", conf]);
    assert_eq!(
        error_line(&err),
        "ringblk: rbd:nopool/x: no pool 'nopool' in the cluster"
    );
    // A malformed spec is a wrong command line (exit status 2).
    for bad in ["rbd:", "rbd:pool", "rbd:/img", "rbd:pool/", "rbd:p/i@snap"] {
        let line = serve_refuses(&["--image", bad, "--ceph-conf", conf]);
        assert!(
            line.contains(bad) && line.contains("expected rbd:POOL/IMAGE"),
            "{line}"
        );
    }
    let (err, _) = serve_fails(&["--image", "rbd:rbd/x", "--ceph-conf", "/nonexistent.conf"]);
    assert!(
        error_line(&err).contains("reading /nonexistent.conf"),
        "{err}"
    );
    let image = c.create_image(4);
    let line = serve_refuses(&[
        "--image",
        &format!("rbd:{image}"),
        "--ceph-conf",
        conf,
        "--direct",
    ]);
    assert!(line.contains("--direct"), "{line}");
}

#[test]
fn an_unreachable_cluster_fails_within_the_timeout() {
    let _no_guest = vm::no_guest();
    // A configuration whose monitor port nothing listens on.
    let dir = ringblk_testkit::test_dir();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().expect("address").port()
    };
    let conf = dir.path().join("ceph.conf");
    std::fs::write(
        &conf,
        format!(
            "[global]\nmon host = v2:127.0.0.1:{port}\nauth client required = none\nlog file = {}\n",
            dir.path().join("client.log").display()
        ),
    )
    .expect("writing ceph.conf");
    let (err, took) = serve_fails(&["--image", "rbd:rbd/img", "--ceph-conf", conf_str(&conf)]);
    assert!(
        error_line(&err).contains("no Ceph cluster answered within 10 s"),
        "{err}"
    );
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

fn conf_str(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// The cluster goes away under a running daemon: requests fail with IOERR
/// within the operation timeout instead of hanging, and the daemon goes on
/// serving (and stops cleanly on SIGTERM).
#[test]
fn a_cluster_that_goes_away_fails_requests_and_the_daemon_goes_on() {
    let _no_guest = vm::no_guest();
    let dir = ringblk_testkit::test_dir();
    let cdir = dir.path().join("cluster");
    let own = ceph::start(&cdir).unwrap_or_else(|e| panic!("{e}"));
    let image = own.create_image(8);
    let mut d = start_rbd_with(&own.conf, &image, &[]);
    let seed = 0x90e5;
    let mut cl = Client::connect(&d.socket, CHUNK);
    assert_eq!(cl.write(0, &pattern(seed, 0, CHUNK)), 0, "write while up");
    ceph::stop(&cdir);
    let started = Instant::now();
    let ret = cl.write(MIB, &pattern(seed, MIB, CHUNK));
    let took = started.elapsed();
    assert_eq!(ret, -libc::EIO, "a write with the cluster gone");
    assert!(took < Duration::from_secs(20), "took {took:?}");
    d.assert_running();
    // The daemon logs the failure before it completes the request, but its
    // output reaches the test through a reader thread: wait for it.
    d.wait_for_log("RBD Write at offset");
    drop(cl);
    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(40));
    assert_eq!(st.code(), Some(0), "exit after SIGTERM: {st}\n{}", d.log());
}

/// With cephx on: a user whose caps cover another pool only is refused
/// the image, and a user with a wrong key is refused at connect; each gets
/// one line saying permission denied, at once. The admin's key (the
/// keyring `ceph.conf` names) serves the image, under the filter.
#[test]
fn permission_denied_and_a_wrong_key_fail_at_start_in_one_line() {
    let _no_guest = vm::no_guest();
    let dir = ringblk_testkit::test_dir();
    let cdir = dir.path().join("cluster");
    let _stop = ceph::StopOnDrop(cdir.clone());
    let own = ceph::start_cephx(&cdir).unwrap_or_else(|e| panic!("{e}"));
    let image = own.create_image(8);
    let spec = format!("rbd:{image}");
    own.ceph(&["osd", "pool", "create", "otherpool", "8", "8"]);
    let key = own.ceph(&[
        "auth",
        "get-or-create",
        "client.limited",
        "mon",
        "profile rbd",
        "osd",
        "profile rbd pool=otherpool",
    ]);
    // A configuration for client.limited: the cluster's, with a keyring
    // of its own.
    let shared = std::fs::read_to_string(&own.conf).expect("reading ceph.conf");
    let conf_with = |name: &str, keyring: &[u8]| {
        let path = dir.path().join(format!("{name}.keyring"));
        std::fs::write(&path, keyring).expect("writing a keyring");
        let conf = dir.path().join(format!("{name}.conf"));
        std::fs::write(
            &conf,
            format!("{shared}\n[client]\nkeyring = {}\n", path.display()),
        )
        .expect("writing ceph.conf");
        conf
    };

    let limited = conf_with("limited", &key);
    let (err, took) = serve_fails(&[
        "--image",
        &spec,
        "--ceph-conf",
        conf_str(&limited),
        "--ceph-id",
        "limited",
    ]);
    assert_eq!(
        only_line(&err),
        format!(
            "ringblk: {spec}: permission denied by the cluster for client.limited (opening image '{image}'); check its key and caps"
        )
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");

    let wrong = Command::new("ceph-authtool")
        .arg("--gen-print-key")
        .output()
        .expect("ceph-authtool");
    assert!(wrong.status.success(), "{wrong:?}");
    let wrong = String::from_utf8_lossy(&wrong.stdout);
    let wrong_key = conf_with(
        "wrong",
        format!("[client.limited]\n\tkey = {}\n", wrong.trim()).as_bytes(),
    );
    let (err, took) = serve_fails(&[
        "--image",
        &spec,
        "--ceph-conf",
        conf_str(&wrong_key),
        "--ceph-id",
        "limited",
    ]);
    let line = only_line(&err);
    assert!(
        line.starts_with(&format!(
            "ringblk: {spec}: permission denied by the cluster for client.limited: authentication failed"
        )),
        "{line}"
    );
    assert!(took < Duration::from_secs(10), "took {took:?}");

    // The admin may: cephx itself works for the daemon, under the filter.
    let d = start_rbd_with(&own.conf, &image, &[]);
    let mut cl = Client::connect(&d.socket, CHUNK);
    let seed = 0xce9f;
    assert_eq!(cl.write(MIB, &pattern(seed, MIB, CHUNK)), 0, "write");
    assert_pattern("read back", seed, MIB, &cl.read(MIB, CHUNK));
}

/// `--readonly` opens the image with rbd_open_read_only (no watch on its
/// header, unlike a read-write open), offers VIRTIO_BLK_F_RO, serves
/// reads, and answers a write with IOERR, leaving the image as it was.
/// libblkio refuses writes on a read-only device itself (EBADF), so the
/// write comes from the hand-written front-end (`frontend`).
#[test]
fn readonly_opens_the_image_read_only_and_refuses_writes() {
    let _no_guest = vm::no_guest();
    use ringblk::virtio::chain_writer::{readable as r, writable as w};
    const F_RO: u64 = 1 << 5;
    const T_OUT: u32 = 1;
    const S_IOERR: u8 = 1;
    let (ring, hdr, buf, status) = (0x10_0000, 0x20_0000, 0x20_1000, 0x20_3000);

    let c = ceph::cluster();
    let seed = 0x0440_0000;
    let size = 8 * MIB as usize;
    let data = pattern(seed, 0, size);
    let image = c.import_image(&data);
    let mut d = start_rbd(&image, &["--readonly"]);
    assert_eq!(c.watchers(&image), None, "a read-only open watches nothing");
    {
        let mut cl = Client::connect_read_only(&d.socket, CHUNK);
        assert_eq!(cl.capacity, size as u64);
        assert_pattern("read", seed, MIB, &cl.read(MIB, CHUNK));
        assert_eq!(cl.flush(), 0, "flush");
    }
    {
        let g = frontend::Guest::new();
        let conn = frontend::Conn::connect(&d.socket);
        let features = conn.handshake(0);
        assert_ne!(features & F_RO, 0, "VIRTIO_BLK_F_RO in {features:#x}");
        g.share(&conn);
        let mut vq = frontend::Vq::new(0, 64, ring);
        vq.setup(&conn, &g);
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&T_OUT.to_le_bytes());
        h[8..16].copy_from_slice(&(MIB >> 9).to_le_bytes());
        g.write(hdr, &h);
        g.write(buf, &pattern(!seed, MIB, 4096));
        g.write(status, &[0xff]);
        vq.post(&g, &[r(hdr, 16), r(buf, 4096), w(status, 1)]);
        vq.one_used(&g);
        assert_eq!(g.byte(status), S_IOERR, "a write to a read-only export");
    }
    let mut cl = Client::connect_read_only(&d.socket, CHUNK);
    assert_pattern("read after the write", seed, MIB, &cl.read(MIB, CHUNK));
    drop(cl);
    d.assert_running();
    assert!(c.read_image(&image, 0, size) == data, "the image changed");
}

/// SIGTERM closes the image handle and the cluster connection, while a
/// front-end is connected and as one goes away: `rbd status` shows no
/// watcher right after the exit, and a daemon started at once on the
/// exclusive-lock image writes in well under the test cluster's `osd
/// client watch timeout` (8 s), which a handle left open would cost it.
/// The second daemon has a control API, which must not keep the image
/// open either; its SIGTERM comes as its client leaves, so the engines
/// may be on their way back from the connection (that once left the
/// watch behind).
#[test]
fn sigterm_closes_the_image_so_a_restarted_daemon_writes_at_once() {
    let _no_guest = vm::no_guest();
    let c = ceph::cluster();
    let image = c.create_image(8);
    let seed = 0x51e7;
    let mut d = start_rbd(&image, &[]);
    let mut cl = Client::connect(&d.socket, CHUNK);
    assert_eq!(cl.write(0, &pattern(seed, 0, CHUNK)), 0, "write");
    assert!(c.watchers(&image).is_some(), "a read-write open watches");
    // Stopped while the front-end is connected.
    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(30));
    drop(cl);
    assert_eq!(st.code(), Some(0), "exit after SIGTERM: {st}\n{}", d.log());
    assert!(!d.log().contains("not allowed"), "trapped:\n{}", d.log());
    let left = c.watchers(&image);

    // The next daemon's first write: it takes the exclusive lock.
    let api = tempfile::tempdir().expect("temporary directory");
    let api_sock = api.path().join("api.sock");
    let mut d = start_rbd(&image, &["--api", api_sock.to_str().expect("UTF-8 path")]);
    let mut cl = Client::connect(&d.socket, 2 * CHUNK);
    let started = Instant::now();
    assert_eq!(
        cl.write(CHUNK as u64, &pattern(seed, CHUNK as u64, CHUNK)),
        0
    );
    let first = started.elapsed();
    eprintln!("restarted daemon's first write took {first:?}; watchers left: {left:?}");
    assert_eq!(left, None, "the stopped daemon left its watch");
    assert!(first < Duration::from_secs(2), "first write took {first:?}");
    assert_pattern("read back", seed, 0, &cl.read(0, 2 * CHUNK));
    // Stopped as the client goes away.
    drop(cl);
    let st = d.signal_and_wait(libc::SIGTERM, Duration::from_secs(30));
    assert_eq!(st.code(), Some(0), "exit after SIGTERM: {st}\n{}", d.log());
    assert!(d.log().contains("image closed"), "{}", d.log());
    assert_eq!(c.watchers(&image), None, "the watch after an idle SIGTERM");
}
