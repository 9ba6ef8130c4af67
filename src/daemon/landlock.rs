//! Landlock: what the daemon may do with files and the network after
//! start-up, by path, on top of the seccomp filter's syscall list.
//!
//! Applied at the end of start-up, just before the seccomp filter, by the
//! thread that then serves the connections: once every file, socket and
//! ring the daemon will use is open. What it allows:
//! - the image: read, and write and truncate unless `--readonly` (device
//!   ioctls for a block device); a qcow2 image's backing chain: read;
//! - a qcow2 image's snapshot directory (`--snapshot-dir`): creating,
//!   reading, writing, truncating and removing regular files beneath it
//!   (live snapshots' overlays);
//! - removing the daemon's own sockets at shutdown (in their directories)
//!   and its private directory (in `$TMPDIR`);
//! - in the dirty bitmaps' directory (`--bitmap-dir`, else the image's
//!   own: see docs/security.md), creating, reading, writing, truncating
//!   and removing regular files (the sidecars; the seccomp filter lets it
//!   create new files there, and open no existing one);
//! - in the backups' directory (`--backup-dir`), making and removing a
//!   Unix socket (a backup's NBD export);
//! - nothing else on any path: no opening, creating, renaming, linking,
//!   executing, truncating or listing anything else; with ABI 9, no
//!   connect to a Unix socket by path.
//!
//! Network (ABI 4): no TCP `bind`; no TCP `connect` either, but for the
//! RBD engine, whose cluster's monitors and OSDs listen on ports a rule
//! could not know. Scopes (ABI 6): no connecting or sending to an abstract
//! Unix socket made outside the sandbox, no signal to a process outside it.
//!
//! What it does not cover:
//! - descriptors opened before it (the image, the sockets, the memfds a
//!   front-end sends): Landlock checks a path when it is opened, and the
//!   daemon opens nothing after start-up (the seccomp filter has no
//!   `openat`);
//! - before ABI 8, threads started before it: Landlock then restricts the
//!   calling thread and the threads it starts, which here are all the
//!   threads of each connection (the crate's message thread, the relay,
//!   the queue workers: everything a front-end or a guest drives), but not
//!   the control API's and metrics endpoint's threads, the signal thread
//!   or librbd's, which the seccomp filter covers alone. With ABI 8 the
//!   ruleset is put on every thread at once (`all_threads`).
//!
//! A kernel without Landlock (before 5.13, or not enabled at boot) gets
//! one log line and the daemon runs without it. `--landlock off` turns it
//! off; it is independent of `--seccomp`.

use std::fs::File;

use landlock::{
    ABI, Access, AccessFs, AccessNet, BitFlags, LandlockStatus, PathBeneath, RestrictSelfAttr,
    RestrictionStatus, Ruleset, RulesetAttr, RulesetCreated, RulesetCreatedAttr, RulesetError,
    RulesetStatus, Scope,
};

use super::DaemonError;
use super::args::LandlockMode;
use super::removal::Removal;
use super::seccomp::Profile;

/// The newest Landlock ABI whose rights the ruleset asks for. Each right
/// the running kernel lacks is left out (the crate's best effort): ABI 9's
/// `ResolveUnix` where the kernel has ABI 7, and so on.
const ABI_WANTED: ABI = ABI::V9;

/// What the daemon may still touch after start-up.
#[derive(Default)]
pub struct Allowed {
    /// The image, and whether it may be written.
    pub image: Option<(File, bool)>,
    /// Files the image reads from: a qcow2 backing chain (read-only).
    pub backing: Vec<File>,
    /// A qcow2 image's snapshot directory: live snapshots create their
    /// overlays in it, read and write them, and remove one a failed
    /// snapshot left.
    pub snapshot_dir: Option<File>,
    /// What the daemon removes at shutdown: each in its directory.
    pub removals: Vec<Removal>,
    /// The dirty bitmaps' directory: sidecars are created, written,
    /// truncated and removed there.
    pub bitmap_dir: Option<File>,
    /// The backups' directory: an NBD socket is made and removed there.
    pub backup_dir: Option<File>,
}

/// Restricts the calling thread (and, with ABI 8, every thread) to
/// `allowed`, and logs what the kernel enforced.
pub fn restrict(mode: LandlockMode, profile: Profile, allowed: Allowed) -> Result<(), DaemonError> {
    if mode == LandlockMode::Off {
        log::warn!("Landlock disabled (--landlock off)");
        return Ok(());
    }
    let err = |e: RulesetError| DaemonError::Landlock(e.to_string());
    let status = ruleset(profile, &allowed)
        .and_then(|r| r.all_threads(true))
        .and_then(RulesetCreated::restrict_self)
        .map_err(err)?;
    // Detail when it works (as the seccomp filter's line); a warning when
    // the kernel has no Landlock.
    match status.ruleset {
        RulesetStatus::NotEnforced => log::warn!("{}", describe(&status, &tcp(profile))),
        _ => log::debug!("{}", describe(&status, &tcp(profile))),
    }
    Ok(())
}

/// The TCP rights the ruleset handles (and so denies) for `profile`.
fn tcp(profile: Profile) -> BitFlags<AccessNet> {
    match profile {
        Profile::File => AccessNet::BindTcp | AccessNet::ConnectTcp,
        // The cluster's monitors and OSDs, on ports of its own choosing.
        Profile::Rbd => AccessNet::BindTcp.into(),
    }
}

/// The daemon's ruleset for `profile`, not yet enforced.
pub fn ruleset(profile: Profile, allowed: &Allowed) -> Result<RulesetCreated, RulesetError> {
    let mut r = Ruleset::default()
        .handle_access(AccessFs::from_all(ABI_WANTED))?
        .handle_access(tcp(profile) & AccessNet::from_all(ABI_WANTED))?
        .scope(Scope::from_all(ABI_WANTED))?
        .create()?;
    if let Some((image, writable)) = &allowed.image {
        let mut access = BitFlags::from(AccessFs::ReadFile);
        if *writable {
            access |= AccessFs::WriteFile | AccessFs::Truncate;
        }
        // A block device's BLKDISCARD, BLKGETSIZE64 (on the descriptor
        // opened before, which this does not govern; a reopen would need
        // it). A regular file's rule is masked to file rights anyway.
        access |= AccessFs::IoctlDev;
        r = r.add_rule(PathBeneath::new(image, access))?;
    }
    for file in &allowed.backing {
        r = r.add_rule(PathBeneath::new(file, AccessFs::ReadFile))?;
    }
    if let Some(dir) = &allowed.bitmap_dir {
        let access = AccessFs::MakeReg
            | AccessFs::RemoveFile
            | AccessFs::ReadFile
            | AccessFs::WriteFile
            | AccessFs::Truncate;
        r = r.add_rule(PathBeneath::new(dir, access))?;
    }
    if let Some(dir) = &allowed.backup_dir {
        r = r.add_rule(PathBeneath::new(
            dir,
            AccessFs::MakeSock | AccessFs::RemoveFile,
        ))?;
    }

    if let Some(dir) = &allowed.snapshot_dir {
        let access = AccessFs::MakeReg
            | AccessFs::ReadFile
            | AccessFs::WriteFile
            | AccessFs::Truncate
            | AccessFs::RemoveFile;
        r = r.add_rule(PathBeneath::new(dir, access))?;
    }
    for removal in &allowed.removals {
        let access = if removal.is_dir() {
            AccessFs::RemoveDir
        } else {
            AccessFs::RemoveFile
        };
        r = r.add_rule(PathBeneath::new(removal.parent(), access))?;
    }
    Ok(r)
}

/// One line: what the kernel enforced, and on which threads.
fn describe(status: &RestrictionStatus, tcp: &BitFlags<AccessNet>) -> String {
    let abi = match status.landlock {
        LandlockStatus::Available { effective_abi, .. } => effective_abi,
        _ => ABI::Unsupported,
    };
    if status.ruleset == RulesetStatus::NotEnforced || abi == ABI::Unsupported {
        return "Landlock is not available (a kernel before 5.13, or not enabled at boot: lsm=); running without it".into();
    }
    let mut covers = vec![format!(
        "{} file system rights",
        AccessFs::from_all(abi).len()
    )];
    if AccessNet::from_all(abi).contains(*tcp) {
        covers.push(if tcp.contains(AccessNet::ConnectTcp) {
            "no TCP bind or connect".into()
        } else {
            "no TCP bind".into()
        });
    }
    if !Scope::from_all(abi).is_empty() {
        covers.push("abstract Unix sockets and signals scoped".into());
    }
    format!(
        "Landlock ABI {} enforced ({}) on {}",
        abi as i32,
        covers.join(", "),
        if status.all_threads {
            "every thread"
        } else {
            "the serving thread and the threads it starts"
        }
    )
}

/// The Landlock ABI of the running kernel (0: none), for the tests.
#[cfg(test)]
pub fn kernel_abi() -> i32 {
    // SAFETY: with a null attr and size 0, LANDLOCK_CREATE_RULESET_VERSION
    // only returns the ABI version; no pointer is read.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            1u32,
        )
    };
    v.max(0) as i32
}

#[cfg(test)]
mod tests;
