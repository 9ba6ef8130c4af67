//! What a user sees when something is wrong: each message, and the exit
//! status of the convention (`ringblk::exit`, docs/operations.md): 2 for
//! a usage error (clap's format, naming the flag), 1 for a runtime error
//! (one `ringblk:` line), 0 when the reader of the output goes away.
//! And the log's format under systemd (JOURNAL_STREAM).

use std::fs;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use ringblk_testkit::{Client, Daemon, DaemonOptions, MIB, ringblk_bin, test_dir};

fn ringblk(args: &[&str]) -> Output {
    ringblk_in(None, args, &[])
}

fn ringblk_in(dir: Option<&Path>, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(ringblk_bin());
    cmd.args(args).stdin(Stdio::null());
    if let Some(dir) = dir {
        cmd.current_dir(dir).env("TMPDIR", dir);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("running ringblk")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A usage error: exit status 2, and a first line `error: ...` with
/// `what` in it.
fn assert_usage(o: &Output, what: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    let first = err.lines().next().unwrap_or_default();
    assert!(first.starts_with("error: "), "{err}");
    assert!(
        first.contains(what),
        "'{what}' not in the first line:\n{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// A runtime error: exit status 1, and one line `ringblk: ...` with
/// `what` in it.
fn assert_runtime(o: &Output, what: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(last.starts_with("ringblk: "), "{err}");
    assert!(last.contains(what), "'{what}' not in:\n{err}");
}

#[test]
fn a_mistyped_value_is_a_usage_error_naming_the_flag() {
    assert_usage(
        &ringblk(&["serve", "--queues", "abc"]),
        "invalid value 'abc' for '--queues <N>': must be a number from 1 to 64",
    );
    assert_usage(
        &ringblk(&["serve", "--queues", "65"]),
        "must be a number from 1 to 64",
    );
}

/// It used to say "65536 is not in 0..=65535" (u16's range, not ours).
#[test]
fn queue_size_out_of_range_says_what_is_allowed() {
    for v in ["65536", "100", "1", "65535"] {
        let o = ringblk(&["serve", "--queue-size", v]);
        assert_usage(
            &o,
            &format!(
                "invalid value '{v}' for '--queue-size <N>': must be a power of two from 2 to 32768"
            ),
        );
        assert!(!stderr(&o).contains("0..=65535"), "{}", stderr(&o));
    }
}

/// QoS errors name the flags, not the API's JSON fields
/// (`iops_total_max`).
#[test]
fn qos_errors_name_the_flags() {
    assert_usage(
        &ringblk(&["serve", "--iops-max", "10"]),
        "--iops-max needs --iops set too",
    );
    assert_usage(
        &ringblk(&["serve", "--read-bps", "1M", "--read-bps-max", "64K"]),
        "--read-bps-max (65536) cannot be lower than --read-bps (1048576)",
    );
    assert_usage(
        &ringblk(&["serve", "--qos-max-length", "5"]),
        "--qos-max-length needs a burst rate",
    );
}

/// `--size` with `--image` used to be ignored without a word; a size that
/// is no multiple of the block size used to create the default image
/// anyway, which then failed this start and every later plain `serve`.
#[test]
fn size_is_checked_before_anything_is_created() {
    let dir = test_dir();
    let image = ringblk_testkit::sparse_image(dir.path(), "x.img", 4 * MIB);
    let o = ringblk_in(
        Some(dir.path()),
        &["serve", "--image", image.to_str().unwrap(), "--size", "2G"],
        &[],
    );
    assert_usage(
        &o,
        &format!(
            "--size is for the default image, which serve creates; --image {} is served at its own size",
            image.display()
        ),
    );
    assert_eq!(
        fs::metadata(&image).unwrap().len(),
        4 * MIB,
        "image changed"
    );

    let xdg = dir.path().join("xdg");
    fs::create_dir(&xdg).unwrap();
    fs::set_permissions(&xdg, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let xdg_env = [("XDG_RUNTIME_DIR", xdg.to_str().unwrap())];
    let o = ringblk_in(Some(dir.path()), &["serve", "--size", "1000"], &xdg_env);
    assert_usage(
        &o,
        "--size 1000 is not a multiple of the 512-byte block size",
    );
    let default_image = xdg.join("ringblk").join("disk.img");
    assert!(
        !default_image.exists(),
        "a default image was created for a refused --size"
    );
    // An existing default image keeps its size; --size says so.
    fs::create_dir_all(default_image.parent().unwrap()).unwrap();
    ringblk_testkit::sparse_image(default_image.parent().unwrap(), "disk.img", 2 * MIB);
    let mut d = Daemon::start_with(DaemonOptions {
        size: 4 * MIB,
        default_paths: true,
        env: &[("XDG_RUNTIME_DIR", Some(xdg.as_os_str()))],
        ..DaemonOptions::default()
    });
    d.wait_for_log("exists already and is served at its own size, 2097152 bytes");
    let c = Client::connect(&d.socket, 4096);
    assert_eq!(c.capacity, 2 * MIB);
}

/// `--cpus` takes what taskset and cpusets write: it refused `0-1`.
#[test]
fn cpu_lists_take_ranges() {
    let allowed = ringblk_metrics::cpu::allowed_cpus().unwrap();
    let c = allowed[0];
    let list = format!("{c}-{c}");
    let mut d = Daemon::start(4 * MIB, &["--cpus", &list]);
    let mut client = Client::connect(&d.socket, 4096);
    assert_eq!(client.write(0, &[7u8; 4096]), 0);
    d.assert_running();
    assert_usage(
        &ringblk(&["serve", "--cpus", "3-1"]),
        "invalid value '3-1' for '--cpus <LIST>'",
    );
}

/// A --socket in a directory that does not exist used to be created with
/// mkdir -p.
#[test]
fn a_socket_in_a_missing_directory_is_refused() {
    let dir = test_dir();
    let image = ringblk_testkit::sparse_image(dir.path(), "x.img", 4 * MIB);
    let missing = dir.path().join("no").join("such");
    let socket = missing.join("v.sock");
    let o = ringblk_in(
        Some(dir.path()),
        &[
            "serve",
            "--image",
            image.to_str().unwrap(),
            "--socket",
            socket.to_str().unwrap(),
        ],
        &[],
    );
    assert_runtime(
        &o,
        &format!(
            "ringblk: socket {}: the directory {} does not exist (create it first)",
            socket.display(),
            missing.display()
        ),
    );
    assert!(!dir.path().join("no").exists(), "directory created");
}

/// The printed QEMU line is one to paste: an absolute socket path, and
/// reconnect=1 so that a daemon restart is invisible to the guest.
#[test]
fn the_connect_line_is_absolute_with_reconnect() {
    let dir = test_dir();
    let image = ringblk_testkit::sparse_image(dir.path(), "x.img", 4 * MIB);
    let mut child = Command::new(ringblk_bin())
        .args(["serve", "--socket", "v.sock", "--image"])
        .arg(&image)
        .current_dir(dir.path())
        .env("TMPDIR", dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = String::new();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    for _ in 0..2 {
        std::io::BufRead::read_line(&mut stdout, &mut out).unwrap();
    }
    let _ = child.kill();
    let _ = child.wait();
    let want = format!(
        "-chardev socket,id=rb0,path={},reconnect=1 ",
        dir.path().join("v.sock").display()
    );
    assert!(out.contains(&want), "{want:?} not in:\n{out}");
}

/// A pipe whose reader has gone: writing to it fails with EPIPE.
fn closed_pipe() -> OwnedFd {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two fds into the array.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both are ours; the read end is closed at once.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    write
}

/// `ringblk stats | head -1`, `ctl status | head -1`: the reader goes
/// away; they used to panic (exit status 101) on the closed pipe.
#[test]
fn a_closed_pipe_ends_stats_and_ctl_quietly() {
    let dir = test_dir();
    let api = dir.path().join("api.sock");
    let mut d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            args: &["--api", api.to_str().unwrap()],
            metrics: true,
            ..DaemonOptions::default()
        },
    );
    d.wait_for_log("control API on");
    let metrics = d.metrics.clone().unwrap();
    let api = api.to_str().unwrap();
    let metrics = metrics.to_str().unwrap();
    for args in [
        &["stats", "--metrics", metrics][..],
        &["stats", "--metrics", metrics, "--interval", "0.1"],
        &["stats", "--metrics", metrics, "--json", "--interval", "0.1"],
        &["stats", "--metrics", metrics, "--prometheus"],
        &["ctl", "--api", api, "status"],
        &["ctl", "--api", api, "qos"],
        &["ctl", "--api", api, "stats", "--interval", "0.1"],
    ] {
        let out = Command::new(ringblk_bin())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(closed_pipe()))
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "ringblk {args:?}: {}",
            stderr(&out)
        );
        assert!(out.stderr.is_empty(), "ringblk {args:?}: {}", stderr(&out));
    }
    d.assert_running();
}

/// `ctl` said "metrics at PATH: connect: No such file or directory".
#[test]
fn ctl_says_when_no_daemon_listens() {
    let dir = test_dir();
    let api = dir.path().join("nothing.sock");
    let want = format!(
        "ringblk: no daemon is listening on {0} (is it running? started with --api {0}?)",
        api.display()
    );
    assert_runtime(
        &ringblk(&["ctl", "--api", api.to_str().unwrap(), "status"]),
        &want,
    );
    // A socket file nobody accepts on: the same.
    drop(std::os::unix::net::UnixListener::bind(&api).unwrap());
    assert_runtime(
        &ringblk(&["ctl", "--api", api.to_str().unwrap(), "status"]),
        &want,
    );
    let metrics = dir.path().join("metrics.sock");
    assert_runtime(
        &ringblk(&["stats", "--metrics", metrics.to_str().unwrap()]),
        &format!(
            "no daemon is listening on {0} (is it running? started with --metrics {0} or --api {0}?)",
            metrics.display()
        ),
    );
}

/// `ctl resize garbage` answered "unknown size suffix 'e'"; a shrink said
/// "give force" where the flag is --force.
#[test]
fn ctl_resize_errors_say_what_to_type() {
    let dir = test_dir();
    let api = dir.path().join("api.sock");
    let mut d = Daemon::start_in(
        dir.path(),
        DaemonOptions {
            args: &["--api", api.to_str().unwrap()],
            ..DaemonOptions::default()
        },
    );
    d.wait_for_log("control API on");
    let api = api.to_str().unwrap();
    assert_usage(
        &ringblk(&["ctl", "--api", api, "resize", "garbage"]),
        "'garbage' is not a size like 4096, 64K, 512M or 1G",
    );
    assert_runtime(
        &ringblk(&["ctl", "--api", api, "resize", "1M"]),
        "to do it anyway, pass --force",
    );
    assert_usage(
        &ringblk(&["ctl", "--api", api, "qos", "--write-iops-max", "9"]),
        "--write-iops-max needs --write-iops set too",
    );
    d.assert_running();
}

/// Under systemd (JOURNAL_STREAM names stderr), each line carries its
/// syslog priority and no timestamp; elsewhere lines keep their stamp.
#[test]
fn journald_lines_carry_priorities() {
    let dir = test_dir();
    let log = dir.path().join("journal");
    let file = fs::File::create(&log).unwrap();
    let meta = file.metadata().unwrap();
    let stream = format!("{}:{}", meta.dev(), meta.ino());
    let image = ringblk_testkit::sparse_image(dir.path(), "x.img", 4 * MIB);
    // --iopoll on a file's device without poll queues: a warning.
    let socket = dir.path().join("v.sock");
    let mut child = Command::new(ringblk_bin())
        .args(["serve", "--image"])
        .arg(&image)
        .arg("--socket")
        .arg(&socket)
        .args(["--iopoll", "--direct", "--no-image-lock"])
        .env("TMPDIR", dir.path())
        .env("JOURNAL_STREAM", &stream)
        .env("RUST_LOG", "debug,virtio_queue=off")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(file.try_clone().unwrap())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !fs::read_to_string(&log)
        .unwrap()
        .contains("seccomp filter installed")
    {
        assert!(
            child.try_wait().unwrap().is_none(),
            "{}",
            fs::read_to_string(&log).unwrap()
        );
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            fs::read_to_string(&log).unwrap()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: kill(2) on our child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let text = fs::read_to_string(&log).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for line in text.lines() {
        let p = line
            .strip_prefix('<')
            .and_then(|l| l.split_once('>'))
            .map(|(p, _)| p)
            .unwrap_or_else(|| panic!("no priority prefix: {line:?}\n{text}"));
        seen.insert(p.to_string());
        assert!(
            !line.contains(" INFO ") && !line.contains("Z ") && !line.starts_with("<6>["),
            "a timestamp or level of its own: {line:?}"
        );
    }
    // --iopoll on a file: a warning; the rest INFO and DEBUG.
    for p in ["4", "6", "7"] {
        assert!(seen.contains(p), "no <{p}> line:\n{text}");
    }
    assert!(text.lines().any(|l| l.starts_with("<4>--iopoll")), "{text}");

    // A command's own error, under the journal: `<3>`, as errors are.
    let out = Command::new(ringblk_bin())
        .args(["serve", "--image", "/nonexistent.img", "--socket"])
        .arg(&socket)
        .env("JOURNAL_STREAM", &stream)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stderr(file.try_clone().unwrap())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = fs::read_to_string(&log).unwrap();
    assert!(
        text.lines()
            .any(|l| l == "<3>ringblk: image /nonexistent.img does not exist"),
        "{text}"
    );
    let out = Command::new(ringblk_bin())
        .args(["serve", "--queues", "0"])
        .env("JOURNAL_STREAM", &stream)
        .stdin(Stdio::null())
        .stderr(file.try_clone().unwrap())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let text = fs::read_to_string(&log).unwrap();
    assert!(
        text.lines().any(|l| l
            == "<3>error: invalid value '0' for '--queues <N>': must be a number from 1 to 64"),
        "{text}"
    );

    // Another stream (stderr redirected elsewhere): the usual format.
    let out = Command::new(ringblk_bin())
        .args(["serve", "--image", "/nonexistent.img", "--socket"])
        .arg(&socket)
        .env("JOURNAL_STREAM", &stream)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        !stderr(&out).starts_with('<'),
        "prefixed on a stream that is not the journal: {}",
        stderr(&out)
    );
}
