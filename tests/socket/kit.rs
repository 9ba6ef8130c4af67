//! What the tests rely on the test kit (`crates/ringblk-testkit`) for,
//! now that it is a library and the tests of many files share a process.

use std::ffi::CStr;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;

use ringblk_testkit::{Daemon, MIB};

/// The kit runs the daemon that Cargo built for these tests: it finds it
/// from the test binary's own place, since a library is not told
/// `CARGO_BIN_EXE_ringblk`.
#[test]
fn runs_the_daemon_cargo_built() {
    let canonical = |p: &Path| {
        p.canonicalize()
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    assert_eq!(
        canonical(&ringblk_testkit::ringblk_bin()),
        canonical(Path::new(env!("CARGO_BIN_EXE_ringblk")))
    );
}

/// A daemon gets no descriptor the test process had open without
/// close-on-exec (as libblkio's memfds are, and eventfds made without
/// EFD_CLOEXEC): in one binary, another test's thread may hold such a
/// descriptor while this one starts its daemon.
#[test]
fn daemons_inherit_no_descriptors() {
    let name = format!("ringblk-kit-probe-{}", std::process::id());
    let cname = std::ffi::CString::new(name.clone()).expect("no NUL");
    let cname: &CStr = &cname;
    // SAFETY: a NUL-terminated name and no flags: an inheritable memfd.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), 0) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor nobody else owns.
    let probe = unsafe { File::from_raw_fd(fd) };
    let d = Daemon::start(16 * MIB, &[]);
    let inherited: Vec<String> = std::fs::read_dir(format!("/proc/{}/fd", d.pid()))
        .expect("the daemon's fds")
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|target| target.display().to_string())
        .filter(|target| target.contains(&name))
        .collect();
    assert!(
        inherited.is_empty(),
        "the daemon holds the test's fd {} as {inherited:?}",
        probe.as_raw_fd()
    );
}
