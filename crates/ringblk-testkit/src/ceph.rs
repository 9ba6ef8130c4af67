//! A single-node Ceph cluster for the RBD tests, started once per test
//! binary with `scripts/ceph-cluster.sh` (one mon, one mgr, one memstore
//! OSD on 127.0.0.1, in the binary's own directory under the kit's
//! [`tmp_dir`]) and stopped when the binary exits
//! (atexit). A cluster that does not start fails every test that needs
//! it, with the script's output: it is never a skip.
//!
//! Used by `tests/rbd` (the RBD engine over the socket, real guests on RBD
//! disks, their migration) and by the RBD comparison of
//! `crates/ringblk-bench/tests/bench_rbd.rs`: one cluster per binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use crate::{tmp_dir, workspace_root};

/// The running cluster: its directory and `ceph.conf`.
pub struct Cluster {
    pub dir: PathBuf,
    pub conf: PathBuf,
}

static CLUSTER: OnceLock<Result<Cluster, String>> = OnceLock::new();
static STOP_DIR: OnceLock<PathBuf> = OnceLock::new();
static NEXT_IMAGE: AtomicU32 = AtomicU32::new(0);

/// `scripts/ceph-cluster.sh` of the workspace.
fn script() -> PathBuf {
    workspace_root().join("scripts/ceph-cluster.sh")
}

extern "C" fn stop_at_exit() {
    if let Some(dir) = STOP_DIR.get() {
        let _ = Command::new(script()).arg("stop").arg(dir).output();
    }
}

/// Starts `scripts/ceph-cluster.sh start DIR`; the error has its output.
pub fn start(dir: &Path) -> Result<Cluster, String> {
    start_with(dir, &[])
}

/// Starts a cluster with cephx authentication (`start DIR --cephx`): its
/// `ceph.conf` names `DIR/keyring`, which holds client.admin's key.
pub fn start_cephx(dir: &Path) -> Result<Cluster, String> {
    start_with(dir, &["--cephx"])
}

fn start_with(dir: &Path, flags: &[&str]) -> Result<Cluster, String> {
    let started = Instant::now();
    let out = Command::new(script())
        .arg("start")
        .arg(dir)
        .args(flags)
        .output()
        .map_err(|e| format!("running {}: {e}", script().display()))?;
    if !out.status.success() {
        return Err(format!(
            "scripts/ceph-cluster.sh start {} failed ({}):\n{}{}",
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    eprintln!(
        "ceph cluster{} in {} started in {:.1} s",
        flags.iter().map(|f| format!(" {f}")).collect::<String>(),
        dir.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(Cluster {
        dir: dir.to_path_buf(),
        conf: dir.join("ceph.conf"),
    })
}

/// Stops a cluster started with [`start`].
pub fn stop(dir: &Path) {
    let out = Command::new(script())
        .arg("stop")
        .arg(dir)
        .output()
        .expect("running ceph-cluster.sh stop");
    assert!(out.status.success(), "ceph-cluster.sh stop failed: {out:?}");
}

/// Stops the cluster in its directory when dropped: a test's own cluster
/// does not outlive a failed assertion.
pub struct StopOnDrop(pub PathBuf);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        let _ = Command::new(script()).arg("stop").arg(&self.0).output();
    }
}

/// The binary's shared cluster, started on first use. Panics (failing the
/// test) if it cannot start.
pub fn cluster() -> &'static Cluster {
    let c = CLUSTER.get_or_init(|| {
        let name = std::env::current_exe()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "tests".into());
        let dir = tmp_dir().join(format!("ceph-{name}"));
        let _ = STOP_DIR.set(dir.clone());
        // SAFETY: registers a plain function with no arguments; it only
        // runs a command.
        unsafe { libc::atexit(stop_at_exit) };
        start(&dir)
    });
    match c {
        Ok(c) => c,
        Err(e) => panic!("the test Ceph cluster did not start: {e}"),
    }
}

impl Cluster {
    /// Runs `rbd -c CONF ARGS`; panics unless it succeeds.
    pub fn rbd(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new("rbd");
        cmd.arg("-c").arg(&self.conf).args(args);
        succeeded(cmd, "rbd", args)
    }

    /// Runs `ceph -c CONF ARGS` (with a deadline); panics unless it
    /// succeeds; returns its stdout.
    pub fn ceph(&self, args: &[&str]) -> Vec<u8> {
        let mut cmd = Command::new("timeout");
        cmd.args(["60", "ceph", "--connect-timeout", "30", "-c"])
            .arg(&self.conf)
            .args(args);
        succeeded(cmd, "ceph", args).stdout
    }

    /// Creates an image of `size_mib` MiB with a name of its own; returns
    /// `pool/name`.
    pub fn create_image(&self, size_mib: u64) -> String {
        let name = format!(
            "rbd/t{}-{}",
            std::process::id(),
            NEXT_IMAGE.fetch_add(1, Ordering::Relaxed)
        );
        self.rbd(&["create", "--size", &format!("{size_mib}M"), &name]);
        name
    }

    /// Creates an image holding `data` (`rbd import`); returns
    /// `pool/name`.
    pub fn import_image(&self, data: &[u8]) -> String {
        let name = format!(
            "rbd/t{}-{}",
            std::process::id(),
            NEXT_IMAGE.fetch_add(1, Ordering::Relaxed)
        );
        let file = tempfile::NamedTempFile::new_in(tmp_dir()).expect("a temporary file");
        std::fs::write(file.path(), data).expect("writing the image's data");
        let path = file.path().to_str().expect("UTF-8 path");
        self.rbd(&["import", "--no-progress", path, &name]);
        name
    }

    /// What `rbd status` says of the image's watchers: `None` when it has
    /// none, else the watcher lines.
    pub fn watchers(&self, image: &str) -> Option<String> {
        let out = self.rbd(&["status", image]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        (!text.contains("Watchers: none")).then_some(text)
    }

    /// The image's bytes `[off, off + len)`, read with `rbd export`: an
    /// independent check of what the daemon wrote.
    pub fn read_image(&self, image: &str, off: u64, len: usize) -> Vec<u8> {
        let out = self.rbd(&["export", "--no-progress", image, "-"]);
        let off = off as usize;
        assert!(
            out.stdout.len() >= off + len,
            "export of {image} is {} bytes",
            out.stdout.len()
        );
        out.stdout[off..off + len].to_vec()
    }
}

/// Runs `cmd` (the `tool` with `args`) to its end; panics with its stderr
/// unless it succeeded.
fn succeeded(mut cmd: Command, tool: &str, args: &[&str]) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {tool}: {e}"));
    assert!(
        out.status.success(),
        "{tool} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}
