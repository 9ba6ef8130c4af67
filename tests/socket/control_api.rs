//! The control API (`serve --api`) and `ringblk ctl`, against a real daemon
//! under its seccomp filter (enforcing, the default): status, online
//! resize seen by a libblkio client, a block device's size re-read, bad
//! input answered with one clear line while the daemon goes on serving,
//! and no control verb over a TCP `--metrics`.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ringblk_testkit::{
    Client, Daemon, DaemonOptions, LoopDevice, MIB, ctl, is_root, pattern, ringblk_bin, test_dir,
};

const SIZE: u64 = 64 * MIB;

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A failed `ctl`: exit status 1 and one line on stderr containing `what`.
fn assert_fails(o: &Output, what: &str) {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(1),
        "stdout {} stderr {err}",
        stdout(o)
    );
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("ringblk: "), "{err}");
    assert!(err.contains(what), "'{what}' not in: {err}");
}

/// A usage error: exit status 2, clap's `error: ...` first line.
fn assert_usage(o: &Output, what: &str) {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(2),
        "stdout {} stderr {err}",
        stdout(o)
    );
    let first = err.lines().next().unwrap_or_default();
    assert!(first.starts_with("error: "), "{err}");
    assert!(first.contains(what), "'{what}' not in: {err}");
}

/// A raw request to the API socket: (status, body).
fn http(api: &Path, method: &str, path: &str, body: &[u8]) -> (u16, String) {
    let (status, _, body) =
        ringblk_metrics::request(api.to_str().expect("UTF-8 path"), method, path, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    (status, body)
}

fn status(api: &Path) -> serde_json::Value {
    let o = ctl(api, &["status"]);
    assert!(o.status.success(), "ctl status: {}", stderr(&o));
    serde_json::from_str(&stdout(&o)).expect("status is JSON")
}

/// A daemon with `--api DIR/api.sock` (and `extra`) in `dir`.
fn start(dir: &Path, image: Option<PathBuf>, extra: &[&str]) -> (Daemon, PathBuf) {
    let api = dir.join("api.sock");
    let mut args = vec!["--api", api.to_str().expect("UTF-8 path")];
    args.extend_from_slice(extra);
    let d = Daemon::start_in(
        dir,
        DaemonOptions {
            size: SIZE,
            image,
            args: &args,
            ..DaemonOptions::default()
        },
    );
    (d, api)
}

#[test]
fn status_describes_the_device_and_the_socket_is_private() {
    let dir = test_dir();
    let (mut d, api) = start(dir.path(), None, &["--queues", "2"]);
    let meta = std::fs::symlink_metadata(&api).expect("api socket");
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let s = status(&api);
    assert_eq!(s["size"], SIZE);
    assert_eq!(s["capacity_sectors"], SIZE / 512);
    assert_eq!(s["queues"], 2);
    assert_eq!(s["block_size"], 512);
    assert_eq!(s["readonly"], false);
    assert_eq!(s["qos"]["iops_total"], 0, "no limit was given: {s}");
    assert_eq!(s["qos"]["bps_total"], 0, "no limit was given: {s}");
    // The fixture's probe connection (it waits until the daemon accepts)
    // is connected until the daemon sees it go.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while status(&api)["connected"] != false {
        assert!(
            std::time::Instant::now() < deadline,
            "still connected 5 s after the probe left"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert_eq!(s["image"], d.image.to_str().unwrap());
    let mut c = Client::connect(&d.socket, 4096);
    assert_eq!(status(&api)["connected"], true);
    assert_eq!(c.read(0, 4096).len(), 4096);
    // The counters, on the same socket.
    let o = ctl(&api, &["stats"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("requests read"), "{}", stdout(&o));
    let o = Command::new(ringblk_bin())
        .args(["stats", "--prometheus", "--metrics"])
        .arg(&api)
        .output()
        .unwrap();
    assert!(
        stdout(&o).contains("ringblk_requests_total{queue=\"0\",type=\"read\"} 1"),
        "{}",
        stdout(&o)
    );
    d.assert_running();
}

#[test]
fn io_past_the_old_end_fails_before_a_resize_and_succeeds_after() {
    let dir = test_dir();
    let (mut d, api) = start(dir.path(), None, &[]);
    let mut c = Client::connect(&d.socket, 64 << 10);
    assert_eq!(c.capacity, SIZE);
    let data = pattern(7, SIZE, 64 << 10);
    assert_ne!(c.write(SIZE, &data), 0, "a write past the end must fail");

    let o = ctl(&api, &["resize", "128M"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains(&format!("from {SIZE} to {}", 2 * SIZE)),
        "{}",
        stdout(&o)
    );
    assert_eq!(std::fs::metadata(&d.image).unwrap().len(), 2 * SIZE);
    assert_eq!(status(&api)["size"], 2 * SIZE);
    // The same connection: the daemon checks against the new capacity.
    assert_eq!(c.write(SIZE, &data), 0, "write past the old end");
    assert_eq!(c.read(SIZE, data.len()), data);
    assert_eq!(d.read_image(SIZE, data.len()), data);
    assert_ne!(c.write(2 * SIZE, &data), 0, "past the new end");
    // A new connection sees the new capacity.
    drop(c);
    let mut c = Client::connect(&d.socket, 64 << 10);
    assert_eq!(c.capacity, 2 * SIZE);
    assert_eq!(c.read(SIZE, data.len()), data);

    // Shrinking: refused without --force, and nothing changes...
    let o = ctl(&api, &["resize", "32M"]);
    assert_fails(&o, "pass --force");
    assert_eq!(std::fs::metadata(&d.image).unwrap().len(), 2 * SIZE);
    assert_eq!(c.read(SIZE, data.len()), data);
    // ...done with it.
    let o = ctl(&api, &["resize", "32M", "--force"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(std::fs::metadata(&d.image).unwrap().len(), 32 * MIB);
    assert_ne!(c.write(32 * MIB, &data[..4096]), 0, "past the shrunk end");
    assert_eq!(c.write(32 * MIB - 4096, &data[..4096]), 0);
    d.assert_running();
}

#[test]
fn bad_input_gets_a_clear_error_and_the_daemon_goes_on() {
    let dir = test_dir();
    let (mut d, api) = start(dir.path(), None, &[]);
    let mut c = Client::connect(&d.socket, 4096);
    let cases: &[(&str, &str, &[u8], u16, &str)] = &[
        (
            "GET",
            "/api/v1/frobnicate",
            b"",
            404,
            "unknown verb /api/v1/frobnicate",
        ),
        ("DELETE", "/api/v1/status", b"", 405, "takes GET"),
        (
            "PUT",
            "/api/v1/resize",
            b"{\"size\": ",
            400,
            "malformed JSON",
        ),
        ("PUT", "/api/v1/resize", b"[1, 2]", 400, "malformed JSON"),
        (
            "PUT",
            "/api/v1/resize",
            b"{\"size\": \"lots\"}",
            400,
            "bad size",
        ),
        (
            "PUT",
            "/api/v1/resize",
            b"{\"size\": -5}",
            400,
            "malformed JSON",
        ),
        (
            "PUT",
            "/api/v1/resize",
            b"{\"size\": 1000}",
            400,
            "not a multiple of the 512-byte",
        ),
        (
            "PUT",
            "/api/v1/resize",
            b"{\"size\": 0}",
            400,
            "larger than 0",
        ),
        (
            "PUT",
            "/api/v1/resize",
            b"{\"size\": 18446744073709551104}",
            400,
            "larger than a file",
        ),
        (
            "PUT",
            "/api/v1/resize",
            b"{\"size\": 4096}",
            409,
            "\"force\": true",
        ),
        (
            "PUT",
            "/api/v1/resize",
            b"{\"sise\": 4096}",
            400,
            "unknown field",
        ),
        (
            "PUT",
            "/api/v1/qos",
            b"{\"iops\": 5}",
            400,
            "unknown QoS limit",
        ),
        (
            "PUT",
            "/api/v1/qos",
            b"{\"iops_total\": -1}",
            400,
            "bad QoS value",
        ),
        (
            "PUT",
            "/api/v1/qos",
            b"{\"iops_total\": 100, \"iops_total_max\": 50}",
            400,
            "cannot be lower",
        ),
        (
            "PUT",
            "/api/v1/qos",
            b"{\"iops_total\": ",
            400,
            "malformed JSON",
        ),
        ("DELETE", "/api/v1/qos", b"", 405, "takes GET"),
    ];
    for (method, path, body, want, what) in cases {
        let (status, answer) = http(&api, method, path, body);
        assert_eq!(status, *want, "{method} {path} {body:?}: {answer}");
        let v: serde_json::Value = serde_json::from_str(&answer).expect("JSON error");
        let msg = v["error"].as_str().expect("an error field");
        assert!(msg.contains(what), "'{what}' not in '{msg}'");
        assert!(!msg.contains('\n'), "one line: {msg}");
        d.assert_running();
    }
    // Over the size limit: refused before it is read whole.
    let big = vec![b' '; 1 << 20];
    let (status, answer) = http(&api, "PUT", "/api/v1/resize", &big);
    assert_eq!(status, 413, "{answer}");
    // Nothing changed, and the daemon serves both sides.
    assert_eq!(std::fs::metadata(&d.image).unwrap().len(), SIZE);
    assert_eq!(c.read(0, 4096).len(), 4096);
    assert_eq!(self::status(&api)["size"], SIZE);

    // The client: one line, exit status 1.
    assert_fails(&ctl(&api, &["resize", "1000"]), "not a multiple");
    assert_usage(
        &ctl(&api, &["resize", "12Q"]),
        "'12Q': unknown size suffix 'Q'",
    );
    assert_fails(&ctl(&api, &["resize", "4K"]), "pass --force");
    assert_usage(
        &ctl(&api, &["qos", "--bps", "1M", "--bps-max", "64K"]),
        "--bps-max (65536) cannot be lower than --bps (1048576)",
    );
    assert_eq!(
        self::status(&api)["qos"]["bps_total"],
        0,
        "a refused change changed something"
    );
    let nothing = dir.path().join("nothing.sock");
    assert_fails(
        &ctl(&nothing, &["status"]),
        &format!(
            "no daemon is listening on {0} (is it running? started with --api {0}?)",
            nothing.display()
        ),
    );
    d.assert_running();
}

#[test]
fn a_tcp_metrics_endpoint_has_no_control_verb() {
    let dir = test_dir();
    let (mut d, api) = start(dir.path(), None, &["--metrics", "127.0.0.1:0"]);
    d.wait_for_log("metrics on ");
    let log = d.log();
    let rest = &log[log.find("metrics on ").unwrap() + "metrics on ".len()..];
    let addr = rest.split_whitespace().next().unwrap().to_string();
    assert!(ringblk_metrics::get(&addr, "/metrics").is_ok());
    for (method, path) in [
        ("GET", "/api/v1/status"),
        ("PUT", "/api/v1/resize"),
        ("POST", "/api/v1/resize"),
    ] {
        let (status, _, body) =
            ringblk_metrics::request(&addr, method, path, b"{\"size\": 134217728}").unwrap();
        assert_eq!(status, 404, "{method} {path} over TCP: {body}");
    }
    assert_eq!(std::fs::metadata(&d.image).unwrap().len(), SIZE);
    assert_eq!(status(&api)["size"], SIZE);
    d.assert_running();
}

/// A loop device grown under the daemon: `resize` with no size re-reads
/// BLKGETSIZE64 (under the filter), and I/O past the old end then works.
/// Needs root and losetup, which CI has; fails loudly without them.
#[test]
fn a_grown_block_device_is_re_read() {
    assert!(
        is_root(),
        "this test needs root (loop devices); CI runs as root"
    );
    let dir = test_dir();
    let backing = ringblk_testkit::sparse_image(dir.path(), "backing.img", SIZE);
    let dev = LoopDevice::attach(&backing, 512)
        .unwrap_or_else(|e| panic!("attaching a loop device: {e}"));
    let (mut d, api) = start(dir.path(), Some(dev.0.clone()), &[]);
    assert_eq!(status(&api)["block_device"], true);
    let mut c = Client::connect(&d.socket, 64 << 10);
    let data = pattern(9, SIZE, 64 << 10);
    assert_ne!(c.write(SIZE, &data), 0, "past the end of the device");
    // A size is the device's own business.
    assert_fails(&ctl(&api, &["resize", "128M"]), "is a block device");
    // Grow the device, then tell the daemon.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&backing)
        .unwrap()
        .set_len(2 * SIZE)
        .unwrap();
    let st = Command::new("losetup")
        .arg("-c")
        .arg(&dev.0)
        .status()
        .unwrap();
    assert!(st.success(), "losetup -c");
    let o = ctl(&api, &["resize"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(status(&api)["size"], 2 * SIZE);
    assert_eq!(c.write(SIZE, &data), 0, "past the old end");
    assert_eq!(c.flush(), 0);
    assert_eq!(c.read(SIZE, data.len()), data);
    assert_eq!(ringblk_testkit::read_file(&backing, SIZE, data.len()), data);
    d.assert_running();
}

#[test]
fn qos_limits_are_shown_changed_and_removed() {
    let dir = test_dir();
    let (mut d, api) = start(dir.path(), None, &["--iops", "1000"]);
    let limits = |o: Output| -> serde_json::Value {
        assert!(o.status.success(), "ctl qos: {}", stderr(&o));
        serde_json::from_str(&stdout(&o)).expect("limits are JSON")
    };
    let now = limits(ctl(&api, &["qos"]));
    assert_eq!(now["iops_total"], 1000);
    assert_eq!(now["bps_read"], 0);
    // Only what is given changes.
    let now = limits(ctl(&api, &["qos", "--read-bps", "8M"]));
    assert_eq!(now["iops_total"], 1000);
    assert_eq!(now["bps_read"], 8 << 20);
    assert_eq!(status(&api)["qos"], now, "status shows the limits in force");
    // 0 removes a limit.
    let now = limits(ctl(&api, &["qos", "--iops", "0"]));
    assert_eq!(now["iops_total"], 0);
    assert_eq!(now["bps_read"], 8 << 20);
    // Over HTTP, as a JSON object of the fields.
    let (code, body) = http(&api, "PUT", "/api/v1/qos", b"{\"bps_read\": 0}");
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(v["bps_read"], 0);
    d.assert_running();
}

/// What the status says of the daemon itself: its version, an uptime
/// that grows, its socket and serial, the front-end connected (this test
/// process, from SO_PEERCRED under the seccomp filter), and the image
/// lock: held while this daemon's ring runs, waiting while another
/// daemon holds it, idle once its front-end is gone. `ctl verbs` lists
/// the daemon's table.
#[test]
fn status_names_the_daemon_its_front_end_and_the_lock() {
    let dir = test_dir();
    let (mut d, api) = start(dir.path(), None, &["--serial", "disk-42"]);
    let s = status(&api);
    assert_eq!(s["version"], env!("CARGO_PKG_VERSION"), "{s}");
    assert_eq!(s["socket"], d.socket.to_str().unwrap(), "{s}");
    assert_eq!(s["serial"], "disk-42", "{s}");
    let up = s["uptime_s"].as_f64().expect("uptime_s");
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let later = status(&api)["uptime_s"].as_f64().expect("uptime_s");
    assert!(later >= up + 1.0, "uptime went from {up} to {later}");
    wait_for(&api, "the fixture's probe to leave", |s| {
        s["connected"] == false
    });
    let s = status(&api);
    assert_eq!(s["front_end"], serde_json::Value::Null, "{s}");
    assert_eq!(s["lock"], "idle", "{s}");

    let mut c = Client::connect(&d.socket, 64 << 10);
    assert_eq!(c.write(0, &pattern(1, 0, 4096)), 0);
    let s = status(&api);
    assert_eq!(s["front_end"]["pid"], std::process::id(), "{s}");
    // SAFETY: getuid takes no arguments and cannot fail.
    assert_eq!(s["front_end"]["uid"], unsafe { libc::getuid() }, "{s}");
    assert_eq!(s["lock"], "held", "{s}");

    // A second daemon on the same image waits for the lock while the
    // first one's ring runs, and takes it once that front-end has left.
    let dir2 = test_dir();
    let (_d2, api2) = start(dir2.path(), Some(d.image.clone()), &[]);
    let mut c2 = Client::connect(&_d2.socket, 64 << 10);
    assert_eq!(c2.write(4096, &pattern(2, 4096, 4096)), -libc::EIO);
    assert_eq!(status(&api2)["lock"], "waiting");
    assert_eq!(status(&api)["lock"], "held");
    drop(c);
    wait_for(&api, "the first daemon to release the lock", |s| {
        s["lock"] == "idle" && s["front_end"].is_null()
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while c2.write(4096, &pattern(2, 4096, 4096)) != 0 {
        assert!(std::time::Instant::now() < deadline, "never got the lock");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(status(&api2)["lock"], "held");

    // The verbs, as the table lists them.
    let o = ctl(&api, &["verbs", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let listed: serde_json::Value = serde_json::from_str(&stdout(&o)).expect("JSON");
    let want: Vec<serde_json::Value> = ringblk::api::VERBS
        .iter()
        .map(|v| {
            serde_json::json!({
                "methods": v.methods(),
                "path": v.path(),
                "control": v.control(),
                "doc": v.doc(),
            })
        })
        .collect();
    assert_eq!(listed, serde_json::Value::Array(want));
    let o = ctl(&api, &["verbs"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let table = stdout(&o);
    assert_eq!(table.lines().count(), ringblk::api::VERBS.len(), "{table}");
    for v in ringblk::api::VERBS {
        let line = table
            .lines()
            .find(|l| l.contains(&format!(" {} ", v.path())));
        let line = line.unwrap_or_else(|| panic!("no {} in:\n{table}", v.path()));
        assert!(line.starts_with(&v.methods().join("|")), "{line}");
        assert!(line.ends_with(v.doc()), "{line}");
    }
    d.assert_running();
}

/// Polls the status until `ok` holds (5 s at most).
fn wait_for(api: &Path, what: &str, ok: impl Fn(&serde_json::Value) -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let s = status(api);
        if ok(&s) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "waited 5 s for {what}: {s}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
