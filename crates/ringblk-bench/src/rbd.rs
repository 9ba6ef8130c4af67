//! `--compare` on a Ceph RBD image instead of a file (`--image
//! rbd:POOL/IMAGE`): the image and the `rbd` CLI calls about it, the
//! throw-away cluster of `--ceph-cluster DIR` (`scripts/ceph-cluster.sh`),
//! and the check that the daemon was built with the RBD engine.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use super::BenchError;
use super::proc;

/// What `--image` names.
pub const RBD_PREFIX: &str = "rbd:";

/// An RBD image and how to reach its cluster.
#[derive(Clone, Debug)]
pub struct RbdImage {
    pub pool: String,
    pub image: String,
    /// ceph.conf (`--ceph-conf`, or the one of `--ceph-cluster`).
    pub conf: PathBuf,
    /// Ceph user, `client.ID` (`--ceph-id`).
    pub id: String,
}

impl RbdImage {
    /// `rbd:POOL/IMAGE` → pool and image; `None` if `spec` is not `rbd:`.
    /// Only the plain form: no namespace, no snapshot (as `ringblk serve`).
    pub fn parse(spec: &str) -> Option<Result<(String, String), BenchError>> {
        let rest = spec.strip_prefix(RBD_PREFIX)?;
        Some(match rest.split_once('/') {
            Some((p, i)) if !p.is_empty() && !i.is_empty() && !i.contains(['/', '@']) => {
                Ok((p.to_string(), i.to_string()))
            }
            _ => Err(BenchError::Usage(format!(
                "--image {spec}: expected rbd:POOL/IMAGE"
            ))),
        })
    }

    /// `rbd:POOL/IMAGE`, as `ringblk serve --image` takes it.
    pub fn spec(&self) -> String {
        format!("{RBD_PREFIX}{}/{}", self.pool, self.image)
    }

    /// `POOL/IMAGE`, as the `rbd` CLI takes it.
    fn name(&self) -> String {
        format!("{}/{}", self.pool, self.image)
    }

    /// Runs `rbd -c CONF --id ID ARGS` (killed after two minutes);
    /// the error has its standard error.
    fn rbd(&self, args: &[&str]) -> Result<Output, BenchError> {
        let mut cmd = Command::new("rbd");
        cmd.arg("-c")
            .arg(&self.conf)
            .args(["--id", &self.id])
            .args(args);
        let what = format!("rbd {}", args.join(" "));
        let out = output_timeout(&mut cmd, Duration::from_secs(120))?;
        if !out.status.success() {
            return Err(BenchError::Usage(format!(
                "{what} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(out)
    }

    /// Size in bytes and whether the exclusive-lock feature is on
    /// (`rbd info --format json`).
    pub fn info(&self) -> Result<(u64, bool), BenchError> {
        #[derive(serde::Deserialize)]
        struct Info {
            size: u64,
            #[serde(default)]
            features: Vec<String>,
        }
        let out = self.rbd(&["info", "--format", "json", &self.name()])?;
        let info: Info = serde_json::from_slice(&out.stdout).map_err(|e| BenchError::Parse {
            who: "rbd info",
            msg: e.to_string(),
        })?;
        Ok((
            info.size,
            info.features.iter().any(|f| f == "exclusive-lock"),
        ))
    }

    /// Creates the image with `size` bytes, without exclusive-lock (see
    /// [`LOCK_WARNING`]), and writes all of it once: reads of objects never
    /// written are answered by the OSD without touching data.
    pub fn create_filled(&self, size: u64) -> Result<(), BenchError> {
        let name = self.name();
        let bytes = format!("{size}");
        self.rbd(&[
            "create",
            "--size",
            &format!("{}M", size.div_ceil(1 << 20)),
            "--image-feature",
            "layering",
            &name,
        ])?;
        self.rbd(&[
            "bench",
            "--io-type",
            "write",
            "--io-pattern",
            "seq",
            "--io-size",
            "4M",
            "--io-total",
            &bytes,
            &name,
        ])?;
        Ok(())
    }
}

/// Why a given image with exclusive-lock is a problem for the comparison.
pub const LOCK_WARNING: &str = "has the exclusive-lock feature: ringblk exits without releasing the lock, so the next backend's first write waits about 30 s for the OSD to drop it; create bench images with `--image-feature layering`";

/// A cluster started by `--ceph-cluster DIR`, stopped on drop.
pub struct Cluster {
    dir: PathBuf,
    pub conf: PathBuf,
}

/// `scripts/ceph-cluster.sh` of the source tree this binary was built from.
fn cluster_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/ceph-cluster.sh")
}

impl Cluster {
    /// `scripts/ceph-cluster.sh start DIR`: wipes DIR, starts one mon, one
    /// mgr and one memstore OSD, and creates pool `rbd`.
    pub fn start(dir: &Path) -> Result<Cluster, BenchError> {
        let script = cluster_script();
        if !script.is_file() {
            return Err(BenchError::Usage(format!(
                "--ceph-cluster needs {} (the source tree this ringblk-bench was built from)",
                script.display()
            )));
        }
        std::fs::create_dir_all(dir)
            .map_err(BenchError::io(format!("creating {}", dir.display())))?;
        let dir =
            std::fs::canonicalize(dir).map_err(BenchError::io(format!("{}", dir.display())))?;
        eprintln!("starting a Ceph cluster in {}...", dir.display());
        let out = output_timeout(
            Command::new(&script).arg("start").arg(&dir),
            Duration::from_secs(180),
        )?;
        // Stop whatever did start, even if not all of it.
        let cluster = Cluster {
            conf: dir.join("ceph.conf"),
            dir,
        };
        if !out.status.success() {
            return Err(BenchError::Usage(format!(
                "{} start failed ({}): {}",
                script.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(cluster)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = output_timeout(
            Command::new(cluster_script()).arg("stop").arg(&self.dir),
            Duration::from_secs(60),
        );
    }
}

/// Fails with the daemon's own line if `bin` was built without the RBD
/// engine. The probe cannot touch a cluster: a daemon with the engine
/// rejects `--direct` for an `rbd:` image before connecting, one without
/// it rejects the `rbd:` image itself.
pub fn check_daemon(bin: &Path, run_dir: &Path) -> Result<(), BenchError> {
    let out = output_timeout(
        Command::new(bin)
            .arg("serve")
            .arg("--socket")
            .arg(run_dir.join("probe.sock"))
            .args(["--image", "rbd:probe/probe", "--direct"])
            .env("RUST_LOG", "error"),
        Duration::from_secs(30),
    )?;
    let err = String::from_utf8_lossy(&out.stderr);
    match err.lines().find(|l| l.contains("without Ceph RBD support")) {
        Some(line) => Err(BenchError::Usage(format!(
            "{}: {}",
            bin.display(),
            line.trim().trim_start_matches("ringblk: ")
        ))),
        None => Ok(()),
    }
}

/// Runs `cmd` to the end with its output collected, killing it after
/// `timeout`.
fn output_timeout(cmd: &mut Command, timeout: Duration) -> Result<Output, BenchError> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| BenchError::Spawn {
            program: program.clone(),
            source,
        })?;
    let mut child = proc::Guard(child);
    // Read both pipes while waiting: a full pipe would block the child.
    let mut stdout = child.0.stdout.take();
    let mut stderr = child.0.stderr.take();
    let out_t = std::thread::spawn(move || read_all(stdout.as_mut()));
    let err_t = std::thread::spawn(move || read_all(stderr.as_mut()));
    let status = proc::wait_timeout(&mut child.0, timeout)
        .map_err(BenchError::io(format!("waiting for {program}")))?;
    let Some(status) = status else {
        return Err(BenchError::Timeout {
            who: "rbd/ceph command",
            timeout,
            log: program,
        });
    };
    Ok(Output {
        status,
        stdout: out_t.join().unwrap_or_default(),
        stderr: err_t.join().unwrap_or_default(),
    })
}

fn read_all(r: Option<&mut impl std::io::Read>) -> Vec<u8> {
    let mut v = Vec::new();
    if let Some(r) = r {
        let _ = r.read_to_end(&mut v);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs() {
        assert!(RbdImage::parse("/tmp/x.img").is_none());
        let (p, i) = RbdImage::parse("rbd:rbd/bench")
            .expect("an rbd: spec")
            .expect("valid");
        assert_eq!((p.as_str(), i.as_str()), ("rbd", "bench"));
        for bad in [
            "rbd:",
            "rbd:pool",
            "rbd:/i",
            "rbd:p/",
            "rbd:p/n/i",
            "rbd:p/i@s",
        ] {
            assert!(
                matches!(RbdImage::parse(bad), Some(Err(_))),
                "{bad} accepted"
            );
        }
    }
}
