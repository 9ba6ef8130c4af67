//! `ringblk ctl`, as the tests run it against a daemon's control API.

use std::path::Path;
use std::process::{Command, Output};

use crate::ringblk_bin;

/// `ringblk ctl --api API ARGS`.
pub fn ctl(api: &Path, args: &[&str]) -> Output {
    Command::new(ringblk_bin())
        .arg("ctl")
        .arg("--api")
        .arg(api)
        .args(args)
        .output()
        .expect("running ringblk ctl")
}

/// `ctl`, which must succeed; its standard output.
#[track_caller]
pub fn ctl_ok(api: &Path, args: &[&str]) -> String {
    let o = ctl(api, args);
    assert!(
        o.status.success(),
        "ringblk ctl {args:?}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `ctl`, which must fail with one line containing `what`.
#[track_caller]
pub fn ctl_fails(api: &Path, args: &[&str], what: &str) {
    let o = ctl(api, args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "ringblk ctl {args:?}: {err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains(what), "'{what}' not in: {err}");
}
