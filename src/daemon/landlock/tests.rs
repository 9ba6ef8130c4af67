//! The daemon's ruleset, enforced in a forked child: what it allows works,
//! and an open outside it is denied.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::FromRawFd;

use super::*;

/// Landlock must be there in CI (the daemon's default turns it on); on a
/// developer's machine without it the tests say so and pass.
fn need_landlock() -> bool {
    if kernel_abi() > 0 {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "this kernel has no Landlock (before 5.13, or not in lsm=): the daemon's default runs without it"
    );
    eprintln!("skipped: the kernel has no Landlock");
    false
}

/// Runs `f` in a forked child that enforces the daemon's ruleset for
/// `profile` and `allowed` first; `f`'s error, or why the child failed.
fn in_child(
    profile: Profile,
    allowed: &Allowed,
    f: impl FnOnce() -> Result<(), String>,
) -> Result<(), String> {
    let mut fds = [0; 2];
    // SAFETY: fds has room for the two descriptors pipe(2) returns.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the child builds and enforces the ruleset (glibc's fork
    // leaves malloc usable), runs `f` and leaves with _exit; it never
    // returns into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: fds[1] is the pipe's write end, which the child owns.
        let mut out = unsafe { File::from_raw_fd(fds[1]) };
        let result = ruleset(profile, allowed)
            .and_then(RulesetCreated::restrict_self)
            .map_err(|e| format!("enforcing: {e}"))
            .and_then(|s| match s.ruleset {
                RulesetStatus::NotEnforced => Err("not enforced".into()),
                _ => f(),
            });
        let _ = out.write_all(result.err().unwrap_or_default().as_bytes());
        // SAFETY: _exit never returns.
        unsafe { libc::_exit(0) };
    }
    // SAFETY: closing our copy of the write end.
    unsafe { libc::close(fds[1]) };
    // SAFETY: fds[0] is the read end, which we own.
    let mut r = unsafe { File::from_raw_fd(fds[0]) };
    let mut err = String::new();
    r.read_to_string(&mut err).unwrap();
    let mut status = 0;
    // SAFETY: pid is our child; status is a valid out-pointer.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "child status {status:#x}: {err}"
    );
    if err.is_empty() { Ok(()) } else { Err(err) }
}

/// `what` must fail with EACCES (Landlock's denial of an access right).
fn denied<T>(what: &str, r: std::io::Result<T>) -> Result<(), String> {
    denied_with(libc::EACCES, what, r)
}

/// `what` must fail with `errno` (EPERM: a scope's denial).
fn denied_with<T>(errno: i32, what: &str, r: std::io::Result<T>) -> Result<(), String> {
    match r {
        Err(e) if e.raw_os_error() == Some(errno) => Ok(()),
        Err(e) => Err(format!("{what}: {e}, not errno {errno}")),
        Ok(_) => Err(format!("{what}: allowed")),
    }
}

fn ok<T>(what: &str, r: std::io::Result<T>) -> Result<(), String> {
    r.map(drop).map_err(|e| format!("{what}: {e}"))
}

/// The layout of a daemon: an image, a socket directory, a private
/// directory in $TMPDIR; and files it has no business with.
struct Layout {
    _dir: tempfile::TempDir,
    image: std::path::PathBuf,
    other: std::path::PathBuf,
    run: std::path::PathBuf,
    tmp: std::path::PathBuf,
}

fn layout() -> Layout {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let (image, other, run, tmp) = (p("disk.img"), p("other.img"), p("run"), p("tmp"));
    fs::write(&image, vec![0u8; 4096]).unwrap();
    fs::write(&other, b"not yours").unwrap();
    fs::create_dir_all(tmp.join("ringblk-x")).unwrap();
    fs::create_dir(&run).unwrap();
    for f in ["vm.sock", "api.sock", "unrelated"] {
        fs::write(run.join(f), b"").unwrap();
    }
    Layout {
        _dir: dir,
        image,
        other,
        run,
        tmp,
    }
}

fn allowed(l: &Layout, writable: bool) -> Allowed {
    let file = OpenOptions::new()
        .read(true)
        .write(writable)
        .open(&l.image)
        .unwrap();
    Allowed {
        image: Some((file, writable)),
        backing: Vec::new(),
        bitmap_dir: None,
        backup_dir: None,
        snapshot_dir: None,
        removals: vec![
            Removal::file(&l.run.join("vm.sock")).unwrap(),
            Removal::dir(&l.tmp.join("ringblk-x")).unwrap(),
        ],
    }
}

/// The finding: after start-up the daemon could open any file its user
/// may (the seccomp filter alone stood in the way). Under the ruleset an
/// open outside the allowed paths is denied, as are creating, listing and
/// running anything; what the daemon does (its image, removing its
/// sockets and its private directory at exit, memfds for the inflight
/// region) still works.
#[test]
fn denies_what_the_daemon_does_not_need() {
    if !need_landlock() {
        return;
    }
    let l = layout();
    let rw = || OpenOptions::new().read(true).write(true).clone();
    let result = in_child(Profile::File, &allowed(&l, true), || {
        denied("open another image", File::open(&l.other))?;
        denied("open /etc/passwd", File::open("/etc/passwd"))?;
        denied("list the socket directory", fs::read_dir(&l.run))?;
        denied("create a file", File::create(l.run.join("new")))?;
        denied("make a directory", fs::create_dir(l.tmp.join("new")))?;
        denied("remove another file", fs::remove_file(&l.other))?;
        denied(
            "run a program",
            std::process::Command::new("/bin/true").status(),
        )?;
        ok("open the image", rw().open(&l.image))?;
        ok("remove a socket", fs::remove_file(l.run.join("vm.sock")))?;
        ok(
            "remove the private directory",
            fs::remove_dir(l.tmp.join("ringblk-x")),
        )?;
        let memfd = memfd()?;
        ok("grow a memfd", memfd.set_len(1 << 20))
    });
    assert_eq!(result, Ok(()));
    assert!(l.other.exists() && !l.run.join("vm.sock").exists());
}

/// A read-only image cannot be opened for writing.
#[test]
fn a_read_only_image_stays_read_only() {
    if !need_landlock() {
        return;
    }
    let l = layout();
    let result = in_child(Profile::File, &allowed(&l, false), || {
        ok("read the image", File::open(&l.image))?;
        denied(
            "write the image",
            OpenOptions::new().write(true).open(&l.image),
        )
    });
    assert_eq!(result, Ok(()));
}

/// TCP (ABI 4): the file profile connects nowhere; the RBD profile may
/// reach its cluster on any port. Neither binds.
#[test]
fn tcp_connect_only_for_rbd() {
    if !need_landlock() || kernel_abi() < 4 {
        return;
    }
    let l = layout();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let connect = || std::net::TcpStream::connect(addr);
    let bind = || std::net::TcpListener::bind("127.0.0.1:0");
    let file = in_child(Profile::File, &allowed(&l, true), || {
        denied("TCP connect", connect())?;
        denied("TCP bind", bind())
    });
    assert_eq!(file, Ok(()));
    let rbd = in_child(Profile::Rbd, &Allowed::default(), || {
        ok("TCP connect", connect())?;
        denied("TCP bind", bind())
    });
    assert_eq!(rbd, Ok(()));
}

/// Scopes (ABI 6): no abstract Unix socket made outside the sandbox can be
/// reached; one connected before still sends (sd_notify's may be
/// abstract, `@name`).
#[test]
fn abstract_sockets_are_scoped() {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram, UnixListener, UnixStream};
    if !need_landlock() || kernel_abi() < 6 {
        return;
    }
    let name = format!("ringblk-test-{}", std::process::id());
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let _outside = UnixListener::bind_addr(&addr).unwrap();
    let notify_name = format!("ringblk-notify-{}", std::process::id());
    let notify_addr = SocketAddr::from_abstract_name(notify_name.as_bytes()).unwrap();
    let notify = UnixDatagram::bind_addr(&notify_addr).unwrap();
    let sock = UnixDatagram::unbound().unwrap();
    sock.connect_addr(&notify_addr).unwrap();
    let result = in_child(Profile::File, &Allowed::default(), || {
        denied_with(
            libc::EPERM,
            "connect to an outside abstract socket",
            UnixStream::connect_addr(&addr),
        )?;
        ok(
            "sd_notify on a socket connected before",
            sock.send(b"READY=1"),
        )
    });
    assert_eq!(result, Ok(()));
    let mut buf = [0u8; 16];
    assert_eq!(notify.recv(&mut buf).unwrap(), 7);
}

fn memfd() -> Result<File, String> {
    // SAFETY: a NUL-terminated name; the new fd is owned by the File.
    let fd = unsafe { libc::memfd_create(c"inflight".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: fd was just made and nothing else owns it.
    Ok(unsafe { File::from_raw_fd(fd) })
}
