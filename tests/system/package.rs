//! The Debian package, end to end: install it (dpkg -i), check what it put
//! where, start an instance the way its unit would (ExecStart= with the
//! instance's EnvironmentFile, as its User=, on a socket passed the way
//! ringblk@.socket passes it), serve a blkio client, stop it, and remove
//! and purge the package.
//!
//! systemd itself does not run here: the unit's command line is read from
//! the installed unit file and expanded as systemd expands it (%i,
//! `${VAR}` as one word, `$VAR` split at spaces, an empty `$VAR` as no
//! word).
//!
//! Needs root (dpkg) and the package, built by `scripts/package.sh`
//! (scripts/test.sh does it first and passes `RINGBLK_DEB`); without
//! either it skips, except where `CI` is set: there it fails.

use std::collections::HashMap;
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ringblk_testkit::{Client, MIB, assert_pattern, is_root, pattern};

const INSTANCE: &str = "pkgtest";
const UNIT_DIR: &str = "/usr/lib/systemd/system";

/// The package to test, or why the test cannot run.
fn package() -> Result<PathBuf, String> {
    if !is_root() {
        return Err("needs root (dpkg -i)".into());
    }
    if let Some(deb) = std::env::var_os("RINGBLK_DEB") {
        return Ok(deb.into());
    }
    // target/tmp -> target/debian, where scripts/package.sh leaves it.
    let tmp = ringblk_testkit::tmp_dir();
    let dir = tmp.parent().unwrap_or(tmp).join("debian");
    fs::read_dir(&dir)
        .ok()
        .and_then(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "deb"))
                .max_by_key(|p| fs::metadata(p).and_then(|m| m.modified()).ok())
        })
        .ok_or_else(|| {
            format!(
                "no package in {} (run scripts/package.sh, or set RINGBLK_DEB)",
                dir.display()
            )
        })
}

fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"))
}

fn run_ok(program: &str, args: &[&str]) -> String {
    let out = run(program, args);
    assert!(
        out.status.success(),
        "{program} {args:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `KEY=value` lines of an EnvironmentFile (systemd.exec(5)): comments and
/// blank lines skipped, one pair of surrounding quotes removed.
fn environment_file(text: &str) -> HashMap<String, String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#') && !l.starts_with(';'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| {
            let v = v.trim();
            let v = v
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .unwrap_or(v);
            (k.trim().to_string(), v.to_string())
        })
        .collect()
}

/// The value of `key=` in a unit file (continuation lines joined).
fn unit_setting(unit: &str, key: &str) -> String {
    let joined = unit.replace("\\\n", " ");
    joined
        .lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in the unit:\n{unit}"))
        .to_string()
}

/// ExecStart= as systemd expands it (systemd.service(5), "Command
/// lines"): `%i` is the instance, `${VAR}` one word, `$VAR` the value
/// split at whitespace.
fn expand_exec(line: &str, instance: &str, env: &HashMap<String, String>) -> Vec<String> {
    let line = line.replace("%i", instance);
    let mut words = Vec::new();
    for word in line.split_whitespace() {
        if let Some(name) = word.strip_prefix("${").and_then(|w| w.strip_suffix('}')) {
            words.push(env.get(name).cloned().unwrap_or_default());
        } else if let Some(name) = word.strip_prefix('$') {
            if let Some(v) = env.get(name) {
                words.extend(v.split_whitespace().map(str::to_string));
            }
        } else {
            words.push(word.to_string());
        }
    }
    words
}

fn uid_gid(user: &str) -> (u32, u32) {
    let line = run_ok("getent", &["passwd", user]);
    let f: Vec<&str> = line.trim().split(':').collect();
    (f[2].parse().unwrap(), f[3].parse().unwrap())
}

fn purge() {
    let _ = run("dpkg", &["--purge", "ringblk"]);
}

#[test]
fn the_package_installs_serves_and_uninstalls() {
    let deb = match package() {
        Ok(deb) => deb,
        Err(why) if std::env::var_os("CI").is_some() => {
            panic!("CI is set but the package test cannot run: {why}")
        }
        Err(why) => {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
    purge();
    run_ok("dpkg", &["-i", deb.to_str().unwrap()]);

    // What it installed.
    for path in [
        "/usr/bin/ringblk",
        "/usr/bin/ringblk-bench",
        "/usr/lib/systemd/system/ringblk@.service",
        "/usr/lib/systemd/system/ringblk@.socket",
        "/usr/lib/tmpfiles.d/ringblk.conf",
        "/usr/share/man/man1/ringblk.1.gz",
        "/usr/share/man/man1/ringblk-serve.1.gz",
        "/usr/share/man/man1/ringblk-ctl.1.gz",
        "/usr/share/man/man1/ringblk-backup.1.gz",
        "/usr/share/man/man1/ringblk-backup-restore.1.gz",
        "/usr/share/bash-completion/completions/ringblk",
        "/usr/share/zsh/vendor-completions/_ringblk",
        "/usr/share/fish/vendor_completions.d/ringblk.fish",
        "/usr/share/doc/ringblk/copyright",
        "/usr/share/doc/ringblk/examples/instance.conf",
    ] {
        assert!(Path::new(path).exists(), "{path} not installed");
    }
    let copyright = fs::read_to_string("/usr/share/doc/ringblk/copyright").unwrap();
    assert!(copyright.contains("Apache License"), "{copyright}");
    let man = run_ok("sh", &["-c", "zcat /usr/share/man/man1/ringblk-serve.1.gz"]);
    assert!(
        man.starts_with(".ie"),
        "not roff: {}",
        &man[..80.min(man.len())]
    );
    assert!(man.contains("queue\\-size"), "--queue-size not in the page");
    // ringblk-bench's page is its own (its options), not the pass-through's.
    let bench = run_ok("sh", &["-c", "zcat /usr/share/man/man1/ringblk-bench.1.gz"]);
    assert!(bench.contains("\\-\\-compare"), "ringblk-bench.1:\n{bench}");
    let bash = fs::read_to_string("/usr/share/bash-completion/completions/ringblk").unwrap();
    assert!(bash.contains("--queue-size"), "bash completion");
    // `man ringblk-backup` says what its flags do.
    let backup = run_ok(
        "sh",
        &["-c", "zcat /usr/share/man/man1/ringblk-backup.1.gz"],
    );
    assert!(backup.contains("\\-\\-full"), "ringblk-backup.1:\n{backup}");
    assert!(bash.contains("prune"), "bash completion of backup prune");
    // The dedicated user, and the directories it owns.
    let (uid, gid) = uid_gid("ringblk");
    for (dir, mode) in [("/var/lib/ringblk", 0o750), ("/run/ringblk", 0o750)] {
        let m = fs::metadata(dir).unwrap_or_else(|e| panic!("{dir}: {e}"));
        assert_eq!((m.uid(), m.gid()), (uid, gid), "{dir}'s owner");
        assert_eq!(m.mode() & 0o7777, mode, "{dir}'s mode");
    }
    // `ringblk bench` finds the packaged ringblk-bench; `help bench` is its help.
    for args in [&["bench", "--help"][..], &["help", "bench"]] {
        let out = run_ok("/usr/bin/ringblk", args);
        assert!(
            out.contains("Usage: ringblk-bench"),
            "ringblk {args:?}:\n{out}"
        );
    }

    // An instance: its configuration, its image, as the unit has them.
    let image = format!("/var/lib/ringblk/{INSTANCE}.img");
    let conf = format!("/etc/ringblk/{INSTANCE}.conf");
    fs::write(&image, b"").unwrap();
    fs::File::options()
        .write(true)
        .open(&image)
        .and_then(|f| f.set_len(64 * MIB))
        .unwrap();
    std::os::unix::fs::chown(&image, Some(uid), Some(gid)).unwrap();
    fs::set_permissions(&image, fs::Permissions::from_mode(0o600)).unwrap();
    fs::write(
        &conf,
        format!(
            "# test instance\nIMAGE={image}\nQUEUES=2\nOPTIONS=--writethrough --serial pkg-test\n"
        ),
    )
    .unwrap();
    let service = fs::read_to_string(format!("{UNIT_DIR}/ringblk@.service")).unwrap();
    let socket_unit = fs::read_to_string(format!("{UNIT_DIR}/ringblk@.socket")).unwrap();
    assert_eq!(
        unit_setting(&service, "EnvironmentFile"),
        "/etc/ringblk/%i.conf"
    );
    let user = unit_setting(&service, "User");
    assert_eq!(user, "ringblk");
    let env = environment_file(&fs::read_to_string(&conf).unwrap());
    let argv = expand_exec(&unit_setting(&service, "ExecStart"), INSTANCE, &env);
    assert_eq!(argv[0], "/usr/bin/ringblk", "{argv:?}");
    assert!(
        argv.windows(2).any(|w| w == ["--image", image.as_str()]),
        "{argv:?}"
    );
    // The socket, as ringblk@.socket makes it, passed as fd 3 (LISTEN_FDS).
    let socket = PathBuf::from(unit_setting(&socket_unit, "ListenStream").replace("%i", INSTANCE));
    let _ = fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket).unwrap();
    std::os::unix::fs::chown(&socket, Some(uid), Some(gid)).unwrap();
    let mode = u32::from_str_radix(&unit_setting(&socket_unit, "SocketMode"), 8).unwrap();
    fs::set_permissions(&socket, fs::Permissions::from_mode(mode)).unwrap();
    let fd = listener.as_raw_fd();
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid", &user, "--regid", &user, "--init-groups", "--"])
        .args([
            "sh",
            "-c",
            "export LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=vhost; exec \"$@\"",
            "sh",
        ])
        .args(&argv)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: dup2 and fcntl are async-signal-safe; `fd` stays open in
    // the parent until the child has exec'd. dup2 onto itself would leave
    // close-on-exec set, so then the flag is cleared instead.
    unsafe {
        cmd.pre_exec(move || {
            let r = if fd == 3 {
                libc::fcntl(3, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, 3)
            };
            if r < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut daemon = cmd.spawn().expect("starting the instance");
    drop(listener);
    let api = PathBuf::from(format!("/run/ringblk/{INSTANCE}.api"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !api.exists() {
        if let Some(st) = daemon.try_wait().unwrap() {
            let out = daemon.wait_with_output().unwrap();
            panic!(
                "the instance exited ({st}):\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(Instant::now() < deadline, "no API socket within 20 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    // It runs as the unit's user.
    let status = fs::read_to_string(format!("/proc/{}/status", daemon.id())).unwrap();
    let real_uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next())
        .unwrap();
    assert_eq!(real_uid, uid.to_string(), "{status}");

    // A client, through the socket the unit's socket made.
    let seed = 0x9ac0_0000;
    {
        let mut c = Client::connect(&socket, 256 * 1024);
        assert_eq!(c.capacity, 64 * MIB);
        let data = pattern(seed, MIB, 256 * 1024);
        assert_eq!(c.write(MIB, &data), 0, "write");
        assert_eq!(c.read(MIB, data.len()), data, "read back");
    }
    let status = run_ok(
        "/usr/bin/ringblk",
        &["ctl", "--api", api.to_str().unwrap(), "status"],
    );
    assert!(status.contains(&image), "{status}");
    assert!(
        status.contains("\"queues\": 2") || status.contains("\"queues\":2"),
        "{status}"
    );

    // systemctl stop: SIGTERM, exit 0, the API socket removed; the
    // acknowledged write is in the image (--writethrough, from OPTIONS).
    // SAFETY: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    let out = daemon.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{log}");
    assert!(
        log.contains("serial pkg-test"),
        "OPTIONS not passed:\n{log}"
    );
    assert!(!api.exists(), "API socket left behind");
    assert_pattern(
        "image",
        seed,
        MIB,
        &ringblk_testkit::read_file(Path::new(&image), MIB, 256 * 1024),
    );

    // Remove: the package's files go; purge: /etc/ringblk too once empty.
    fs::remove_file(&conf).unwrap();
    fs::remove_file(&image).unwrap();
    let _ = fs::remove_file(&socket);
    run_ok("dpkg", &["-r", "ringblk"]);
    for path in [
        "/usr/bin/ringblk",
        "/usr/bin/ringblk-bench",
        "/usr/lib/systemd/system/ringblk@.service",
        "/usr/lib/systemd/system/ringblk@.socket",
        "/usr/share/man/man1/ringblk-serve.1.gz",
        "/usr/share/bash-completion/completions/ringblk",
    ] {
        assert!(!Path::new(path).exists(), "{path} left after dpkg -r");
    }
    run_ok("dpkg", &["--purge", "ringblk"]);
    assert!(
        !Path::new("/etc/ringblk").exists(),
        "/etc/ringblk left after purge"
    );
    let listed = run("dpkg", &["-s", "ringblk"]);
    assert!(!listed.status.success(), "still known to dpkg after purge");
}
