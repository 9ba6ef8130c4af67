//! The directory that holds the default socket and image: private to the
//! daemon's user, and checked before anything is put in it.
//!
//! A fixed name in a shared directory belongs to whoever creates it first:
//! a local user who makes `/tmp/ringblk` before the daemon does can put a
//! symlink where the image goes (served read-write to the guest) or replace
//! the socket (and receive QEMU's guest-memory fds). So the directory is,
//! in this order:
//!
//! 1. `$XDG_RUNTIME_DIR/ringblk`, when XDG_RUNTIME_DIR is set, absolute,
//!    and itself passes [`check_private`];
//! 2. `/run/ringblk`, when running as root and `/run` passes it;
//! 3. `ringblk-$EUID` in the temporary directory (`$TMPDIR`, else `/tmp`),
//!    which may be shared but then must be sticky, like `/tmp`.
//!
//! The one chosen is created 0700 if it is missing, by a single mkdir (a
//! link or anything else already there is not replaced, and no parent is
//! created on the way), and is then checked: a directory, not a symlink,
//! owned by our effective uid, writable by nobody else. If it is not, the
//! daemon refuses to start rather than pick another one.

use std::fs::{self, DirBuilder};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};

/// The name of the directory under the runtime directories.
const DIR_NAME: &str = "ringblk";

/// Why a directory is not safe to keep the daemon's files in. One line each.
#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error("{}: a symbolic link; refusing to use it", .0.display())]
    Symlink(PathBuf),
    #[error("{}: not a directory; refusing to use it", .0.display())]
    NotADirectory(PathBuf),
    #[error("{}: owned by uid {owner}, not by us (uid {us}); refusing to use it", .path.display())]
    NotOurs { path: PathBuf, owner: u32, us: u32 },
    #[error(
        "{}: owned by uid {owner}, neither by us (uid {us}) nor by root; refusing to use it",
        .path.display()
    )]
    NotOursNorRoot { path: PathBuf, owner: u32, us: u32 },
    #[error("{}: writable by {who} (mode {mode:04o}); refusing to use it", .path.display())]
    Writable {
        path: PathBuf,
        who: &'static str,
        mode: u32,
    },
    #[error(
        "{}: writable by others without the sticky bit (mode {mode:04o}); refusing to use it",
        .path.display()
    )]
    NotSticky { path: PathBuf, mode: u32 },
    #[error("{}: {what}: {source}", .path.display())]
    Io {
        path: PathBuf,
        what: &'static str,
        source: io::Error,
    },
}

/// What the choice depends on. [`Env::from_process`] reads it; tests
/// build their own.
#[derive(Clone, Debug)]
pub struct Env {
    pub euid: u32,
    /// `XDG_RUNTIME_DIR`, when set and not empty.
    pub xdg_runtime_dir: Option<PathBuf>,
    /// Root's runtime directory, `/run`.
    pub run: PathBuf,
    /// The temporary directory: `$TMPDIR`, else `/tmp`.
    pub tmp: PathBuf,
}

impl Env {
    pub fn from_process() -> Env {
        Env {
            // SAFETY: geteuid takes no arguments and cannot fail.
            euid: unsafe { libc::geteuid() },
            xdg_runtime_dir: std::env::var_os("XDG_RUNTIME_DIR")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from),
            run: PathBuf::from("/run"),
            tmp: std::env::temp_dir(),
        }
    }
}

/// Picks the directory (see the module's documentation), creating it if
/// it is missing, and returns it once it is checked.
pub fn choose(env: &Env) -> Result<PathBuf, RunDirError> {
    if let Some(xdg) = &env.xdg_runtime_dir {
        if !xdg.is_absolute() {
            log::warn!(
                "not using XDG_RUNTIME_DIR {}: not an absolute path",
                xdg.display()
            );
        } else {
            match check_private(xdg, env.euid) {
                Ok(()) => return create_private(&xdg.join(DIR_NAME), env.euid),
                Err(e) => log::warn!("not using XDG_RUNTIME_DIR: {e}"),
            }
        }
    }
    if env.euid == 0 {
        // A trusted parent: creating it, and any of its parents, is fine.
        let run = fs::create_dir_all(&env.run)
            .map_err(|source| RunDirError::Io {
                path: env.run.clone(),
                what: "cannot create it",
                source,
            })
            .and_then(|()| check_private(&env.run, env.euid));
        match run {
            Ok(()) => return create_private(&env.run.join(DIR_NAME), env.euid),
            Err(e) => log::warn!("not using {}: {e}", env.run.display()),
        }
    }
    check_shared(&env.tmp, env.euid)?;
    create_private(&env.tmp.join(format!("{DIR_NAME}-{}", env.euid)), env.euid)
}

/// Creates `dir` (mode 0700) unless something is there already, then
/// checks it with [`check_private`].
fn create_private(dir: &Path, euid: u32) -> Result<PathBuf, RunDirError> {
    match DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => log::info!("created {}", dir.display()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(source) => {
            return Err(RunDirError::Io {
                path: dir.to_owned(),
                what: "cannot create it",
                source,
            });
        }
    }
    check_private(dir, euid)?;
    Ok(dir.to_owned())
}

/// `path` itself (not what a symlink there points to) is a directory,
/// owned by `euid`, that neither its group nor others may write to.
pub fn check_private(path: &Path, euid: u32) -> Result<(), RunDirError> {
    let meta = dir_metadata(path)?;
    if meta.uid() != euid {
        return Err(RunDirError::NotOurs {
            path: path.to_owned(),
            owner: meta.uid(),
            us: euid,
        });
    }
    let mode = meta.mode() & 0o7777;
    let who = match mode & 0o022 {
        0 => return Ok(()),
        0o020 => "its group",
        0o002 => "others",
        _ => "its group and others",
    };
    Err(RunDirError::Writable {
        path: path.to_owned(),
        who,
        mode,
    })
}

/// `path` itself is a directory owned by `euid` or root in which nobody
/// else can remove or rename what we create: either only its owner may
/// write to it, or it is sticky (like `/tmp`).
fn check_shared(path: &Path, euid: u32) -> Result<(), RunDirError> {
    let meta = dir_metadata(path)?;
    if meta.uid() != euid && meta.uid() != 0 {
        return Err(RunDirError::NotOursNorRoot {
            path: path.to_owned(),
            owner: meta.uid(),
            us: euid,
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 && mode & libc::S_ISVTX == 0 {
        return Err(RunDirError::NotSticky {
            path: path.to_owned(),
            mode,
        });
    }
    Ok(())
}

/// lstat of `path`, which must be a directory and not a link to one.
fn dir_metadata(path: &Path) -> Result<fs::Metadata, RunDirError> {
    let meta = fs::symlink_metadata(path).map_err(|source| RunDirError::Io {
        path: path.to_owned(),
        what: "cannot check it",
        source,
    })?;
    if meta.file_type().is_symlink() {
        return Err(RunDirError::Symlink(path.to_owned()));
    }
    if !meta.is_dir() {
        return Err(RunDirError::NotADirectory(path.to_owned()));
    }
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{PermissionsExt, chown, symlink};

    fn euid() -> u32 {
        // SAFETY: geteuid takes no arguments and cannot fail.
        unsafe { libc::geteuid() }
    }

    fn chmod(path: &Path, mode: u32) {
        fs::set_permissions(path, fs::Permissions::from_mode(mode)).unwrap();
    }

    /// A temporary directory with three stand-ins: an XDG runtime
    /// directory, `/run` and `/tmp`.
    fn env(root: &Path) -> Env {
        let (xdg, run, tmp) = (root.join("xdg"), root.join("run"), root.join("tmp"));
        for d in [&xdg, &run, &tmp] {
            fs::create_dir(d).unwrap();
        }
        chmod(&xdg, 0o700);
        chmod(&run, 0o755);
        chmod(&tmp, 0o1777);
        Env {
            euid: euid(),
            xdg_runtime_dir: Some(xdg),
            run,
            tmp,
        }
    }

    #[test]
    fn the_check_refuses_links_files_and_writable_directories() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("d");
        fs::create_dir(&dir).unwrap();
        for ok in [0o700, 0o755, 0o500] {
            chmod(&dir, ok);
            check_private(&dir, euid()).unwrap();
        }
        for (bad, who) in [
            (0o770, "its group"),
            (0o707, "others"),
            (0o777, "its group and others"),
            (0o1777, "its group and others"),
        ] {
            chmod(&dir, bad);
            let e = check_private(&dir, euid()).unwrap_err().to_string();
            assert!(
                e.contains(&format!("writable by {who} (mode {bad:04o})")),
                "{e}"
            );
            assert!(e.ends_with("refusing to use it"), "{e}");
        }
        chmod(&dir, 0o700);
        let link = root.path().join("link");
        symlink(&dir, &link).unwrap();
        let e = check_private(&link, euid()).unwrap_err();
        assert!(matches!(e, RunDirError::Symlink(_)), "{e}");
        let file = root.path().join("f");
        fs::write(&file, b"").unwrap();
        let e = check_private(&file, euid()).unwrap_err();
        assert!(matches!(e, RunDirError::NotADirectory(_)), "{e}");
        let e = check_private(&dir, euid() + 1).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "{}: owned by uid {}, not by us (uid {}); refusing to use it",
                dir.display(),
                euid(),
                euid() + 1
            )
        );
    }

    #[test]
    fn the_runtime_directory_comes_first() {
        let root = tempfile::tempdir().unwrap();
        let env = env(root.path());
        let xdg = env.xdg_runtime_dir.clone().unwrap();
        let dir = choose(&env).unwrap();
        assert_eq!(dir, xdg.join("ringblk"));
        let meta = fs::symlink_metadata(&dir).unwrap();
        assert_eq!(meta.mode() & 0o7777, 0o700);
        // Found again, not created again.
        assert_eq!(choose(&env).unwrap(), dir);
    }

    #[test]
    fn an_unsafe_or_relative_runtime_directory_is_passed_over() {
        let root = tempfile::tempdir().unwrap();
        let mut env = env(root.path());
        let xdg = env.xdg_runtime_dir.clone().unwrap();
        chmod(&xdg, 0o777);
        let next = if env.euid == 0 {
            env.run.join("ringblk")
        } else {
            env.tmp.join(format!("ringblk-{}", env.euid))
        };
        assert_eq!(choose(&env).unwrap(), next);
        assert!(!xdg.join("ringblk").exists());
        env.xdg_runtime_dir = Some(PathBuf::from("relative/dir"));
        assert_eq!(choose(&env).unwrap(), next);
    }

    #[test]
    fn root_without_a_runtime_directory_uses_run() {
        let root = tempfile::tempdir().unwrap();
        if euid() != 0 {
            eprintln!("skipped: needs root");
            return;
        }
        let mut env = env(root.path());
        env.xdg_runtime_dir = None;
        assert_eq!(choose(&env).unwrap(), env.run.join("ringblk"));
        // A /run that is missing is created; one that is unsafe is
        // passed over for the temporary directory.
        fs::remove_dir_all(&env.run).unwrap();
        assert_eq!(choose(&env).unwrap(), env.run.join("ringblk"));
        chmod(&env.run, 0o777);
        assert_eq!(choose(&env).unwrap(), env.tmp.join("ringblk-0"));
    }

    #[test]
    fn others_fall_back_to_a_directory_of_their_own_in_tmp() {
        let root = tempfile::tempdir().unwrap();
        let mut env = env(root.path());
        env.xdg_runtime_dir = None;
        // As root, /run is passed over when it is not a directory.
        env.run = root.path().join("no-run-here");
        fs::write(&env.run, b"not a directory").unwrap();
        let dir = choose(&env).unwrap();
        assert_eq!(dir, env.tmp.join(format!("ringblk-{}", env.euid)));
        assert_eq!(fs::symlink_metadata(&dir).unwrap().mode() & 0o7777, 0o700);
        // Shared but not sticky: others could rename our directory away.
        chmod(&env.tmp, 0o777);
        let e = choose(&env).unwrap_err();
        assert!(matches!(e, RunDirError::NotSticky { .. }), "{e}");
    }

    /// What another user put where our directory goes is refused, not
    /// used and not replaced.
    #[test]
    fn a_directory_planted_in_tmp_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let mut env = env(root.path());
        env.xdg_runtime_dir = None;
        env.run = root.path().join("no-run-here");
        fs::write(&env.run, b"not a directory").unwrap();
        let ours = env.tmp.join(format!("ringblk-{}", env.euid));
        let elsewhere = root.path().join("elsewhere");
        fs::create_dir(&elsewhere).unwrap();
        chmod(&elsewhere, 0o700);
        symlink(&elsewhere, &ours).unwrap();
        let e = choose(&env).unwrap_err();
        assert!(matches!(e, RunDirError::Symlink(_)), "{e}");
        fs::remove_file(&ours).unwrap();
        fs::create_dir(&ours).unwrap();
        chmod(&ours, 0o777);
        let e = choose(&env).unwrap_err();
        assert!(matches!(e, RunDirError::Writable { .. }), "{e}");
        if euid() == 0 {
            chmod(&ours, 0o700);
            chown(&ours, Some(65534), Some(65534)).unwrap();
            let e = choose(&env).unwrap_err().to_string();
            assert_eq!(
                e,
                format!(
                    "{}: owned by uid 65534, not by us (uid 0); refusing to use it",
                    ours.display()
                )
            );
        }
    }
}
