//! Live migration of a real guest whose disk ringblk serves: the harness
//! of `tests/guest/migration.rs` (image files) and `tests/rbd/migration.rs`
//! (RBD images); each test there is a [`Migration`] given to [`run`].
//!
//! Two daemons serve one image file (shared storage), each on its own
//! socket; a source QEMU boots the guest against the first, a destination
//! QEMU (`-incoming`) waits on the second, and the test migrates the guest
//! over QMP while it runs (`tests/guest/init.sh`, `ringblk.test=migrate`):
//!
//! - busy: fio random writes with `verify_backlog`, a loop re-reading with
//!   O_DIRECT a region the host filled, and a loop reading other regions
//!   the host filled through the guest's page cache, from before the
//!   migration until well after it;
//! - idle: no I/O while the migration runs, then I/O on the destination;
//! - kills: the destination daemon SIGKILLed right after the migration, or
//!   the source's before it, and restarted; QEMU reconnects
//!   (`reconnect=1`) and the guest sees no error;
//! - RBD ([`Storage::Rbd`], for a daemon built with `--features rbd`): the
//!   busy guest with both daemons serving one Ceph RBD image (`rbd:`) on
//!   the single-node cluster the test binary then starts ([`crate::ceph`]).
//!   The host's regions go in with `rbd import`, and the host's checks
//!   read `rbd export`. The image has exclusive-lock (the default): the
//!   destination's first write takes the lock from the source's daemon,
//!   which librbd hands over on request once the source's ring has
//!   stopped.
//! - a dirty bitmap ([`Migration::bitmap`], image files and qcow2
//!   overlays, where it is in the overlay, checked with QEMU): the source's
//!   daemon gets a bitmap before the guest boots; after the migration the
//!   destination's holds every granule the guest changed on either side
//!   (the image against its state before the boot) and nothing outside
//!   what the guest writes, read with `nbdinfo` from a backup's export;
//! - qcow2 ([`Storage::Qcow2`]): both daemons serve a qcow2 overlay over
//!   the image file with `--format qcow2`; the source makes the metadata
//!   durable when its rings stop, the destination reads it afresh when
//!   its rings start. The host's checks read the chain converted to raw,
//!   after `qemu-img check` found it clean;
//! - an encrypted qcow2 ([`Storage::EncryptedQcow2`]): the same with the
//!   overlay encrypted (`encrypt.format=luks`, the passphrase from a key
//!   file), QEMU converting it with the secret.
//!
//! What makes a missing dirty mark show. Guest RAM is copied for real (no
//! `x-ignore-shared`, which would skip it). A page a daemon fills (a read)
//! after QEMU sent it reaches the destination only if the daemon marks it
//! in QEMU's dirty log; otherwise the destination has the page as it was.
//! Data read with O_DIRECT is used at once, so fio and the re-reads only
//! see the reads that complete while the source stops; data in the page
//! cache is used again later, on the destination. Three things make such
//! pages many: the guest boots with `init_on_alloc=0` (Debian's kernel
//! zeroes every page it allocates, a CPU write that has QEMU send the page
//! again anyway), the page-cache regions are large enough to take cold
//! pages from the free lists, and a busy guest's migration is held for
//! `HOLD` in its rounds of dirty pages (`migrate`). With the daemon's own
//! marking turned off (the io_uring reads' pages), the busy tests fail.
//!
//! Guest RAM is 8 KiB short of 512 MiB: QEMU before 9.0 loses vCPU writes
//! from its dirty bitmap under TCG when a RAM block's size is a multiple
//! of 256 KiB (the fast path of `cpu_physical_memory_sync_dirty_bitmap`
//! leaves the TCG TLB stale; upstream "physmem: Fix migration dirty bitmap
//! coherency with TCG memory access"). Debian 12's QEMU 7.2 has the bug: a
//! held migration of a 512 MiB guest corrupts its kernel's memory, with
//! qemu-storage-daemon serving the disk as with ringblk. Other sizes take
//! the slow path, which is right.
//!
//! QEMU's `total-time` and `downtime` are printed on stderr (`--nocapture`
//! shows them). These tests share the guest machinery, its environment
//! variables (`RINGBLK_GUEST_BACKEND=qsd` included, without the kills) and
//! its lock with the other guest tests ([`crate::vm`]); they skip only
//! where QEMU cannot run at all, and never where `CI` is set.

use std::fs::{self, File};
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::ceph;
use crate::vm::{self, qmp::Qmp};
use crate::vm::{
    BOOT_CHECKS, Backend, DaemonSpec, Guard, IMAGE_SIZE, MIB, QemuSpec, backend,
    check_guest_pattern, console_info, daemon_command, guest_timeout, kill_with_requests_in_flight,
    new_nonce, parse_console, qemu_command, read_at, read_log, resubmitted_in, threads_of, verbose,
    wait_for_socket, write_host_pattern,
};

/// The region fio writes from offset 0 (`init.sh`'s default `fio_mb`).
const FIO_MB: u64 = 32;
/// The migration's downtime limit: QEMU's default (300 ms) leaves a loaded
/// 2-core machine little room to converge under TCG.
const DOWNTIME_LIMIT_MS: u64 = 500;
/// Guest RAM: 8 KiB short of 512 MiB, to stay off a QEMU bug (see the
/// top of this file).
const GUEST_RAM: &str = "524280K";
/// How long a busy guest's migration is held in its iterative phase
/// (see `migrate`): the guest's page-cache loop reads a few regions in
/// that time.
const HOLD: Duration = Duration::from_secs(3);
/// The migration's bandwidth (bytes per second), and while it is held.
const BANDWIDTH: u64 = 1 << 30;
const HOLD_BANDWIDTH: u64 = 32 * MIB;
/// How long a migration may take before the test cancels it.
const MIGRATION_TIMEOUT: Duration = Duration::from_secs(120);
/// The regions the busy guest reads through its page cache: 12 of 2 MiB
/// from 32 MiB, their SHA-256s at 57 MiB (`init.sh`'s migrate layout).
const CACHE_REGIONS_AT: u64 = 32 * MIB;
const CACHE_REGION_LEN: usize = 2 << 20;
const CACHE_REGIONS: usize = 12;
const CACHE_SUMS_AT: u64 = 57 * MIB;
/// The guest's printed line that lets the host migrate.
const MIGRATE_NOW: &str = "RINGBLK-MIGRATE";

/// Checks of a busy guest before the marker, and after the migration (all
/// on the destination).
const BUSY_BEFORE: &[&str] = &["cache-sums"];
const BUSY_CHECKS: &[&str] = &[
    "fio-migrate",
    "reread",
    "page-cache",
    "queues-used",
    "guest-pattern",
];
/// Checks after an idle guest's migration, all on the destination.
const IDLE_CHECKS: &[&str] = &[
    "idle",
    "fio-verify",
    "host-pattern-after",
    "queues-used",
    "guest-pattern",
];

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// fio and the re-reads run through the migration.
    Busy,
    /// No I/O during the migration; I/O on the destination afterwards.
    Idle,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Kill {
    /// SIGKILL the source's daemon under the busy guest, restart it, then
    /// migrate.
    SourceBeforeMigration,
    /// SIGKILL the destination's daemon as soon as the migration is
    /// complete, and restart it.
    DestinationAfterMigration,
}

/// What both daemons serve.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// One image file.
    File,
    /// One RBD image (`rbd:POOL/IMAGE`) on the test cluster.
    Rbd,
    /// A qcow2 overlay (`--format qcow2`) over the image file, which holds
    /// the host's regions: the guest reads them through the backing chain
    /// and its writes allocate in the overlay.
    Qcow2,
    /// As `Qcow2`, the overlay encrypted (`encrypt.format=luks`, the kit's
    /// passphrase in a key file both daemons read).
    EncryptedQcow2,
}

/// One migration test.
pub struct Migration {
    pub storage: Storage,
    /// Queues of the disk, and vCPUs of the guest.
    pub queues: u16,
    pub workload: Workload,
    pub kill: Option<Kill>,
    /// Seconds of the busy guest's fio: long enough to span the migration
    /// with room to spare, and everything before it.
    pub fio_runtime: u32,
    /// A dirty bitmap added on the source before the guest boots must
    /// reach the destination whole (image files and qcow2 overlays,
    /// ringblk only).
    pub bitmap: bool,
}

impl Migration {
    /// A busy guest on `queues` queues of an image file, nothing killed.
    pub fn busy(queues: u16) -> Self {
        Migration {
            storage: Storage::File,
            queues,
            workload: Workload::Busy,
            kill: None,
            fio_runtime: 20,
            bitmap: false,
        }
    }
}

/// One side of the migration: its daemon's socket and the files of its
/// daemon and QEMU.
struct Side {
    name: &'static str,
    socket: PathBuf,
    daemon_log: PathBuf,
    qemu_log: PathBuf,
    console: PathBuf,
    qmp: PathBuf,
}

impl Side {
    fn new(dir: &Path, name: &'static str) -> Side {
        Side {
            name,
            socket: dir.join(format!("{name}.sock")),
            daemon_log: dir.join(format!("{name}-daemon.log")),
            qemu_log: dir.join(format!("{name}-qemu.log")),
            console: dir.join(format!("{name}-console.log")),
            qmp: dir.join(format!("{name}-qmp.sock")),
        }
    }
}

/// Prints every log of the run if the test panics (a Drop, so that a
/// panic anywhere, QMP's included, comes with the evidence).
struct Evidence<'a> {
    sides: [&'a Side; 2],
}

impl Drop for Evidence<'_> {
    fn drop(&mut self) {
        if !thread::panicking() {
            return;
        }
        for side in self.sides {
            for (what, path) in [
                ("guest console", &side.console),
                ("qemu output", &side.qemu_log),
                ("daemon output", &side.daemon_log),
            ] {
                eprintln!(
                    "==== {} {what} ====\n{}",
                    side.name,
                    read_log(path).trim_end()
                );
            }
        }
    }
}

/// Boots the guest on the source, migrates it to the destination while it
/// runs `m`'s workload (with `m`'s kill), and panics with every problem
/// found: the guest's checks on either side, the image as the host sees
/// it, the daemons' fates, the lock's hand-over on RBD.
pub fn run(m: Migration) {
    let Some(assets) = vm::assets_or_skip() else {
        return;
    };
    let backend = backend();
    if backend == Backend::Qsd {
        if let Some(why) = vm::qemu_unusable(vm::QSD) {
            panic!("RINGBLK_GUEST_BACKEND=qsd but {why}");
        }
        if m.kill.is_some() {
            // Its restart does not resume in-flight requests.
            eprintln!("not with qemu-storage-daemon: the kills test ringblk's recovery");
            return;
        }
        if m.storage != Storage::File {
            eprintln!("not with qemu-storage-daemon: its command line here serves raw files only");
            return;
        }
    }

    let tmp = tempfile::Builder::new()
        .prefix("ringblk-migration-")
        .tempdir()
        .expect("temporary directory");
    let dir = tmp.path();
    let image = dir.join("disk.img");
    File::create(&image)
        .and_then(|f| f.set_len(IMAGE_SIZE))
        .expect("create the image");
    let nonce = new_nonce();
    let host_pattern = write_host_pattern(&image, &nonce);
    if m.workload == Workload::Busy {
        write_cache_regions(&image, &nonce);
    }
    // What the guest finds: a granule it changed differs from this.
    let initial = dir.join("initial.img");
    if m.bitmap {
        assert!(
            matches!(m.storage, Storage::File | Storage::Qcow2) && backend == Backend::Ringblk,
            "the bitmap case is for ringblk on an image file or a qcow2 overlay"
        );
        assert!(crate::nbd::have_tools(), "nbdinfo and qemu-img are needed");
        fs::copy(&image, &initial).expect("copying the image");
        fs::create_dir(dir.join("backups")).expect("the backup directory");
    }
    // The cluster, if any, starts before the guest lock is taken.
    let served = Served::new(m.storage, &image);
    let _one = vm::one_guest();
    let started = Instant::now();

    let src = Side::new(dir, "source");
    let dst = Side::new(dir, "destination");
    let _evidence = Evidence {
        sides: [&src, &dst],
    };

    // Both daemons serve the one image. O_DIRECT keeps requests in flight
    // long enough for a kill to catch some (an RBD image has no page cache
    // in between: librbd's is off).
    let mut extra: Vec<String> = match (m.kill, m.storage) {
        (Some(_), Storage::File | Storage::Qcow2 | Storage::EncryptedQcow2) => {
            vec!["--direct".into()]
        }
        _ => vec![],
    };
    extra.extend(served.args.iter().cloned());
    let start_daemon = |side: &Side| {
        let mut extra = extra.clone();
        if m.bitmap {
            extra.extend([
                "--api".into(),
                api_of(dir, side).display().to_string(),
                "--backup-dir".into(),
                dir.join("backups").display().to_string(),
            ]);
        }
        let spec = DaemonSpec {
            socket: &side.socket,
            image: &served.image,
            readonly: false,
            queues: m.queues,
            queues_flag: true,
            extra: &extra,
            dir,
        };
        let (mut cmd, serial) = daemon_command(&spec, backend);
        let mut d = Guard::spawn_logged("daemon", &mut cmd, &side.daemon_log);
        wait_for_socket(&mut d, &side.socket, &side.daemon_log);
        (d, serial)
    };
    let (mut src_daemon, serial) = start_daemon(&src);
    if m.bitmap {
        // Before the destination's daemon starts: it finds the sidecar
        // then (a daemon opens its bitmaps' files at start-up).
        crate::ctl_ok(&api_of(dir, &src), &["bitmap", "add", "mig"]);
    }
    // The destination's daemon starts before the source's guest boots,
    // also when the bitmap is in a qcow2 image: its start writes nothing
    // into the image (the bitmaps are marked in use when a daemon claims
    // it), so the source, which claims the image as its guest boots,
    // loads its bitmap consistent.
    let mut dst_daemon = start_daemon(&dst).0;

    let append = format!(
        "console=ttyS0 quiet panic=-1 init_on_alloc=0 ringblk.test=migrate ringblk.migrate={} \
         ringblk.fio_runtime={} ringblk.fio_mb={FIO_MB} ringblk.sectors={} ringblk.serial={serial} \
         ringblk.queues={} ringblk.nonce={nonce} ringblk.verbose={}",
        match m.workload {
            Workload::Busy => "busy",
            Workload::Idle => "idle",
        },
        m.fio_runtime,
        IMAGE_SIZE / 512,
        m.queues,
        u8::from(verbose()),
    );
    let device = format!("vhost-user-blk-pci,chardev=c0,num-queues={}", m.queues);
    let qemu = |side: &Side| {
        let mut cmd = qemu_command(&QemuSpec {
            assets,
            memory: GUEST_RAM,
            vcpus: m.queues,
            socket: &side.socket,
            // Both reconnect: a killed daemon is restarted on its socket.
            reconnect: true,
            device: &device,
            append: &append,
            console: &side.console,
        });
        cmd.arg("-qmp")
            .arg(format!("unix:{},server=on,wait=off", side.qmp.display()));
        cmd
    };

    // The destination first: it listens (on a port it could bind) before
    // the source exists.
    let (mut dst_qemu, mut dst_qmp, uri) = {
        let mut dst_qemu = Guard::spawn_logged(
            "destination qemu",
            qemu(&dst).args(["-incoming", "defer"]),
            &dst.qemu_log,
        );
        let mut dst_qmp = Qmp::connect("destination", &dst.qmp, Duration::from_secs(30), || {
            dst_qemu.exited().is_none()
        });
        let uri = listen_for_migration(&mut dst_qmp);
        (dst_qemu, dst_qmp, uri)
    };
    let mut src_qemu = Guard::spawn_logged("source qemu", &mut qemu(&src), &src.qemu_log);
    let mut src_qmp = Qmp::connect("source", &src.qmp, Duration::from_secs(30), || {
        src_qemu.exited().is_none()
    });

    wait_for_marker(&src, &mut src_qemu);
    let marker_at = Instant::now();
    match m.workload {
        // fio is writing (the guest waits for that): let it and the
        // re-reads run against the source for a while.
        Workload::Busy => thread::sleep(Duration::from_secs(2)),
        Workload::Idle => {}
    }
    // Who writes the image now (RBD: the exclusive lock's holder).
    let writer_before = served.writer();
    if m.kill == Some(Kill::SourceBeforeMigration) {
        let before = ring_starts(&src);
        src_daemon = restart_daemon(src_daemon, &src, &start_daemon);
        wait_for_reconnection(&src, &mut src_daemon, before);
        // I/O against the new daemon before the migration.
        thread::sleep(Duration::from_secs(2));
    }

    let hold = match m.workload {
        Workload::Busy => HOLD,
        Workload::Idle => Duration::ZERO,
    };
    let stats = migrate(&mut src_qmp, &uri, hold);
    eprintln!(
        "migration ({} queue(s), {}, {}) completed {:.1?} after the guest's go: \
         total-time {} ms, downtime {} ms, setup-time {} ms, {} MiB of RAM sent \
         ({} dirty-sync rounds)",
        m.queues,
        match m.workload {
            Workload::Busy => "busy guest",
            Workload::Idle => "idle guest",
        },
        match m.storage {
            Storage::File => "image file",
            Storage::Rbd => "RBD image",
            Storage::Qcow2 => "qcow2 overlay",
            Storage::EncryptedQcow2 => "encrypted qcow2 overlay",
        },
        marker_at.elapsed(),
        stats["total-time"],
        stats["downtime"],
        stats["setup-time"],
        stats["ram"]["transferred"].as_u64().unwrap_or(0) / MIB,
        stats["ram"]["dirty-sync-count"],
    );
    if m.kill == Some(Kill::DestinationAfterMigration) {
        dst_daemon = restart_daemon(dst_daemon, &dst, &start_daemon);
    }

    let mut problems = Vec::new();
    // The source is paused for good: let it go.
    src_qmp.quit();
    match src_qemu.wait_for(Duration::from_secs(20)) {
        Some(s) if s.success() => {}
        other => problems.push(format!("source QEMU after quit: {other:?}")),
    }
    let status = dst_qmp.run("query-status", json!({}));
    if status["status"] != "running" {
        problems.push(format!("the destination is not running: {status}"));
    }
    if m.workload == Workload::Idle {
        // The guest's go-ahead: an NMI, noticed without disk I/O.
        dst_qmp.run("inject-nmi", json!({}));
    }

    let timeout = guest_timeout();
    let dst_status = dst_qemu.wait_for(timeout);
    if dst_status.is_none() {
        eprintln!(
            "==== where the destination daemon's threads are ====\n{}\
             ==== where the destination QEMU's threads are ====\n{}",
            threads_of(dst_daemon.pid()),
            threads_of(dst_qemu.pid())
        );
    }
    match dst_status {
        None => problems.push(format!(
            "the destination QEMU did not finish within {timeout:?} (killed)"
        )),
        Some(s) if !s.success() => problems.push(format!("the destination QEMU exited with {s}")),
        Some(_) => {}
    }

    problems.extend(served.check_handover(writer_before, m.workload == Workload::Idle));
    if m.bitmap {
        problems.extend(check_bitmap(
            dir,
            &src,
            &dst,
            &image,
            served.qcow2.as_deref(),
            &initial,
        ));
    }
    problems.extend(check_guest(
        &m,
        &src,
        &dst,
        &served.host_view(&image),
        &host_pattern,
    ));
    // Both daemons outlive their QEMU, and a killed one's successor
    // resubmitted what was in flight.
    for (side, daemon) in [(&src, &mut src_daemon), (&dst, &mut dst_daemon)] {
        if let Some(status) = daemon.exited() {
            problems.push(format!("the {} daemon exited: {status}", side.name));
        }
        if read_log(&side.daemon_log).contains("panicked") {
            problems.push(format!("the {} daemon panicked", side.name));
        }
    }
    if let Some(kill) = m.kill {
        let side = match kill {
            Kill::SourceBeforeMigration => &src,
            Kill::DestinationAfterMigration => &dst,
        };
        let resubmitted = resubmitted_in(&read_log(&side.daemon_log));
        eprintln!(
            "requests resubmitted by the restarted {} daemon: {resubmitted}",
            side.name
        );
        if resubmitted == 0 {
            problems.push(format!(
                "the kill of the {} daemon caught no request in flight: recovery was not exercised",
                side.name
            ));
        }
    }

    eprintln!("migration test ran {:.1?}", started.elapsed());
    assert!(
        problems.is_empty(),
        "{} problem(s) with the migration:\n  {}",
        problems.len(),
        problems.join("\n  ")
    );
}

/// A side's control API socket ([`Migration::bitmap`]).
fn api_of(dir: &Path, side: &Side) -> PathBuf {
    dir.join(format!("{}-api.sock", side.name))
}

/// After a [`Migration::bitmap`] run, both guests gone: the bitmap the
/// source's daemon wrote out as its rings stopped is the one the
/// destination's loaded, and holds every granule that differs from
/// `initial` (changed on either side) and nothing outside what the guest
/// writes (its fio region and its pattern: `init.sh`'s migrate layout).
///
/// On a qcow2 overlay (`qcow2`) the bitmap is in the overlay itself: the
/// guest's disk is the overlay converted to raw, and once the destination
/// let the image go, QEMU (`qemu-img info`, qemu-nbd + nbdinfo) lists the
/// bitmap, not in use, with the same dirty ranges as the export's.
fn check_bitmap(
    dir: &Path,
    src: &Side,
    dst: &Side,
    image: &Path,
    qcow2: Option<&Path>,
    initial: &Path,
) -> Vec<String> {
    const GRAN: u64 = 64 * 1024;
    let mut problems = Vec::new();
    let src_state = crate::nbd::bitmap_state(&api_of(dir, src), "mig");
    let dst_state = crate::nbd::bitmap_state(&api_of(dir, dst), "mig");
    eprintln!(
        "bitmap 'mig' (dirty bytes, consistent): source {src_state:?}, destination {dst_state:?}"
    );
    let (Some((src_dirty, _)), Some((dst_dirty, true))) = (src_state, dst_state) else {
        problems.push(format!(
            "bitmap 'mig': source {src_state:?}, destination {dst_state:?} (want it on both, consistent)"
        ));
        return problems;
    };
    if dst_dirty < src_dirty || src_dirty == 0 {
        problems.push(format!(
            "bitmap 'mig': the source wrote out {src_dirty} dirty bytes, the destination holds {dst_dirty}"
        ));
    }
    let sock = crate::nbd::backup_start(
        &api_of(dir, dst),
        &dir.join("backups"),
        "mig.sock",
        Some("mig"),
    );
    let marked = crate::nbd::dirty(&sock, "mig");
    crate::ctl_ok(&api_of(dir, dst), &["backup", "stop"]);
    let disk = match qcow2 {
        None => image.to_path_buf(),
        Some(top) => {
            // The backup's stop let the image go: the bitmap is written.
            let listed = crate::qemu_img::bitmaps(top);
            if listed != [("mig".to_string(), vec!["auto".to_string()])] {
                problems.push(format!(
                    "qemu-img info lists {listed:?} in the overlay (want 'mig', not in use)"
                ));
            } else {
                let qemu = crate::nbd::qemu_nbd_dirty(top, "mig");
                // The export's bits were taken out of the bitmap at the
                // backup's start; what the bitmap recorded since is none.
                if !qemu.is_empty() {
                    problems.push(format!(
                        "QEMU finds {qemu:?} dirty in 'mig' after the backup's instant (no write since)"
                    ));
                }
            }
            let raw = dir.join("overlay-now.raw");
            crate::qemu_img::qemu_img(&[
                "convert",
                "-O",
                "raw",
                top.to_str().expect("a UTF-8 path"),
                raw.to_str().expect("a UTF-8 path"),
            ]);
            raw
        }
    };
    let (now, before) = (
        fs::read(&disk).expect("the image"),
        fs::read(initial).expect("the initial image"),
    );
    let covered = |off: u64| marked.iter().any(|&(o, l)| o <= off && off < o + l);
    let mut missing = Vec::new();
    for g in 0..now.len() as u64 / GRAN {
        let r = (g * GRAN) as usize..((g + 1) * GRAN) as usize;
        if now[r.clone()] != before[r] && !covered(g * GRAN) {
            missing.push(g * GRAN);
        }
    }
    if !missing.is_empty() {
        problems.push(format!(
            "bitmap 'mig' misses {} changed granule(s), the first at {:?}",
            missing.len(),
            &missing[..missing.len().min(8)]
        ));
    }
    let written = crate::nbd::granules(
        &[
            (0, FIO_MB * MIB),
            (vm::GUEST_PATTERN_AT, vm::PATTERN_LEN as u64),
        ],
        GRAN,
        IMAGE_SIZE,
    );
    let inside = |(o, l): (u64, u64)| written.iter().any(|&(wo, wl)| wo <= o && o + l <= wo + wl);
    if let Some(r) = marked.iter().find(|&&r| !inside(r)) {
        problems.push(format!(
            "bitmap 'mig' marks {r:?}, outside what the guest writes ({written:?})"
        ));
    }
    problems
}

/// The image both daemons serve: `--image` and the flags that go with it.
struct Served {
    image: PathBuf,
    args: Vec<String>,
    /// The RBD image (`POOL/IMAGE`).
    rbd: Option<String>,
    /// The qcow2 overlay over the file.
    qcow2: Option<PathBuf>,
    /// Its passphrase's key file, if it is encrypted.
    key: Option<PathBuf>,
}

impl Served {
    /// Serves `file` itself, or an RBD image imported from it.
    fn new(storage: Storage, file: &Path) -> Served {
        match storage {
            Storage::File => Served {
                image: file.to_path_buf(),
                args: Vec::new(),
                rbd: None,
                qcow2: None,
                key: None,
            },
            Storage::Qcow2 => {
                let top = file.with_file_name("overlay.qcow2");
                crate::qemu_img::overlay(file, "raw", &top);
                Served {
                    image: top.clone(),
                    args: vec!["--format".into(), "qcow2".into()],
                    rbd: None,
                    qcow2: Some(top),
                    key: None,
                }
            }
            Storage::EncryptedQcow2 => {
                let dir = file.parent().expect("the image's directory");
                let key = crate::luks::key_file(dir, crate::luks::PASS);
                let top = file.with_file_name("overlay.qcow2");
                let base = file.file_name().and_then(|n| n.to_str());
                let base = base.expect("a UTF-8 name");
                crate::luks::qemu_img_qcow2_luks(&top, &key, Some((base, "raw")), None);
                Served {
                    image: top.clone(),
                    args: vec![
                        "--format".into(),
                        "qcow2".into(),
                        "--key-file".into(),
                        key.display().to_string(),
                    ],
                    rbd: None,
                    qcow2: Some(top),
                    key: Some(key),
                }
            }
            Storage::Rbd => {
                let c = ceph::cluster();
                let name = format!("rbd/migrate{}-{}", std::process::id(), new_nonce());
                let path = file.to_str().expect("a UTF-8 path");
                c.rbd(&["import", "--no-progress", path, &name]);
                // The hand-over of the exclusive lock is part of the test.
                let info = c.rbd(&["info", "--format", "json", &name]);
                let info: Value = serde_json::from_slice(&info.stdout).expect("rbd info's JSON");
                assert!(
                    info["features"]
                        .as_array()
                        .is_some_and(|f| f.iter().any(|f| f == "exclusive-lock")),
                    "the imported image has no exclusive-lock: {info}"
                );
                Served {
                    image: PathBuf::from(format!("rbd:{name}")),
                    args: vec!["--ceph-conf".into(), c.conf.display().to_string()],
                    rbd: Some(name),
                    qcow2: None,
                    key: None,
                }
            }
        }
    }

    /// The client that holds the RBD image's exclusive lock (`client.N`),
    /// as `rbd lock ls` shows it; `None` for a file, or if nobody holds it
    /// for a second (it may be free for a moment while it passes).
    fn writer(&self) -> Option<String> {
        if let Some(name) = &self.rbd {
            let deadline = Instant::now() + Duration::from_secs(1);
            loop {
                let out = ceph::cluster().rbd(&["lock", "ls", "--format", "json", name]);
                let locks: Value = serde_json::from_slice(&out.stdout).expect("rbd lock ls's JSON");
                let mut lockers = Vec::new();
                lockers_in(&locks, &mut lockers);
                assert!(
                    lockers.len() <= 1,
                    "more than one lock on the image: {locks}"
                );
                if !lockers.is_empty() || Instant::now() > deadline {
                    return lockers.pop();
                }
                thread::sleep(Duration::from_millis(20));
            }
        }
        None
    }

    /// A problem unless the exclusive lock, held by `before`'s client on
    /// the source, is now held by another (the destination's daemon). A
    /// source that never wrote (an idle guest) holds nothing, and then
    /// the destination must hold it after its writes.
    fn check_handover(&self, before: Option<String>, idle: bool) -> Option<String> {
        if self.rbd.is_some() {
            let after = self.writer();
            eprintln!(
                "the image's exclusive lock: {} before the migration, {} after",
                before.as_deref().unwrap_or("nobody"),
                after.as_deref().unwrap_or("nobody")
            );
            return match (before, after) {
                (Some(b), Some(a)) if a != b => None,
                (None, Some(_)) if idle => None,
                (b, a) => Some(format!(
                    "the exclusive lock did not pass from the source's daemon to the \
                     destination's: held by {b:?} before the migration, {a:?} after"
                )),
            };
        }
        None
    }

    /// The file that holds what the guest left: `file` itself, the RBD
    /// image exported next to it, or the qcow2 chain converted to raw
    /// next to it once `qemu-img check` found it clean.
    fn host_view(&self, file: &Path) -> PathBuf {
        if let Some(top) = &self.qcow2 {
            let raw = file.with_file_name("converted.img");
            let raw_path = raw.to_str().expect("a UTF-8 path");
            let top_path = top.to_str().expect("a UTF-8 path");
            match &self.key {
                None => {
                    let leaks = crate::qemu_img::check_clean(top);
                    eprintln!("qemu-img check of the overlay: clean, {leaks} leaked cluster(s)");
                    crate::qemu_img::qemu_img(&["convert", "-O", "raw", top_path, raw_path]);
                }
                Some(key) => {
                    let secret = format!("secret,id=s0,file={}", key.display());
                    let opts =
                        format!("driver=qcow2,file.filename={top_path},encrypt.key-secret=s0");
                    let open = ["--object", secret.as_str(), "--image-opts", opts.as_str()];
                    let (corruptions, leaks) = crate::qemu_img::check_with(&open);
                    assert_eq!(corruptions, 0, "qemu-img check of the encrypted overlay");
                    eprintln!(
                        "qemu-img check of the encrypted overlay: clean, {leaks} leaked cluster(s)"
                    );
                    let mut args = vec!["convert"];
                    args.extend(open);
                    args.extend(["-O", "raw", raw_path]);
                    crate::qemu_img::qemu_img(&args);
                }
            }
            return raw;
        }
        if let Some(name) = &self.rbd {
            let exported = file.with_file_name("exported.img");
            let path = exported.to_str().expect("a UTF-8 path");
            ceph::cluster().rbd(&["export", "--no-progress", name, path]);
            return exported;
        }
        file.to_path_buf()
    }
}

/// Every `locker` in `rbd lock ls`'s JSON (whatever its nesting).
fn lockers_in(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("locker", Value::String(s)) => out.push(s.clone()),
                    _ => lockers_in(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| lockers_in(v, out)),
        _ => {}
    }
}

/// What the guest said on either side, and what the image holds.
fn check_guest(
    m: &Migration,
    src: &Side,
    dst: &Side,
    image: &Path,
    host_pattern: &[u8],
) -> Vec<String> {
    let mut problems = Vec::new();
    let src_console = read_log(&src.console);
    let dst_console = read_log(&dst.console);
    let after = match m.workload {
        Workload::Busy => BUSY_CHECKS,
        Workload::Idle => IDLE_CHECKS,
    };
    let before_verdict = parse_console(&src_console);
    let after_verdict = parse_console(&dst_console);
    // The source's console ends at the migration, the destination's with
    // the guest's end.
    problems.extend(before_verdict.problems(BOOT_CHECKS));
    if m.workload == Workload::Busy {
        problems.extend(before_verdict.problems(BUSY_BEFORE));
    }
    problems.extend(after_verdict.problems(after));
    if !after_verdict.done {
        problems.push("the guest never printed RINGBLK-DONE on the destination".into());
    }
    for name in after {
        let on_source = before_verdict
            .passed
            .iter()
            .chain(&before_verdict.failed)
            .any(|p| p.split(' ').next() == Some(name));
        if on_source {
            problems.push(format!(
                "the guest finished `{name}` on the source: the migration came too late"
            ));
        }
    }
    if let Some(passes) = console_info(&dst_console, "reread-passes") {
        eprintln!(
            "the guest re-read the host's 1 MiB {passes} times with O_DIRECT, and filled its \
             page cache {} times from the host's regions ({} reads)",
            console_info(&dst_console, "page-cache-fills").unwrap_or("?"),
            console_info(&dst_console, "page-cache-reads").unwrap_or("?"),
        );
    }

    // The image, as the host sees it.
    match console_info(&dst_console, "fio-region-sha256") {
        Some(guest_sum) => {
            let host_sum = sha256(&read_at(image, 0, (FIO_MB * MIB) as usize));
            if guest_sum != host_sum {
                problems.push(format!(
                    "host: the first {FIO_MB} MiB of the image (sha256 {host_sum}) are not \
                     what the guest read on the destination (sha256 {guest_sum})"
                ));
            }
        }
        None => problems.push("the guest printed no fio-region-sha256".into()),
    }
    if after_verdict.passed("guest-pattern") {
        problems.extend(check_guest_pattern(image, host_pattern));
    }
    eprintln!(
        "the guest's checks: {} passed, {} failed",
        before_verdict.passed.len() + after_verdict.passed.len(),
        before_verdict.failed.len() + after_verdict.failed.len()
    );
    if verbose() {
        eprintln!("==== source console ====\n{src_console}");
        eprintln!("==== destination console ====\n{dst_console}");
    }
    problems
}

/// Has the destination listen on a free local port; its URI.
fn listen_for_migration(dst: &mut Qmp) -> String {
    let mut tries = 0;
    loop {
        // A port free a moment ago; another process may take it first,
        // and then QEMU says so and the next one is tried.
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free local port")
            .port();
        let uri = format!("tcp:127.0.0.1:{port}");
        match dst.execute("migrate-incoming", json!({ "uri": uri })) {
            Ok(_) => return uri,
            Err(e) if tries < 5 => {
                eprintln!("migrate-incoming {uri}: {e}; trying another port");
                tries += 1;
            }
            Err(e) => panic!("the destination cannot listen on {uri}: {e}"),
        }
    }
}

/// Waits for the guest's go on the source's console.
fn wait_for_marker(src: &Side, qemu: &mut Guard) {
    let deadline = Instant::now() + guest_timeout();
    loop {
        let console = read_log(&src.console);
        if console.lines().any(|l| l.trim() == MIGRATE_NOW) {
            return;
        }
        assert!(
            !console.contains("RINGBLK-DONE"),
            "the guest finished without asking for the migration"
        );
        if let Some(status) = qemu.exited() {
            panic!("the source QEMU exited ({status}) before the guest asked for the migration");
        }
        assert!(
            Instant::now() < deadline,
            "the guest did not ask for the migration within {:?}",
            guest_timeout()
        );
        thread::sleep(Duration::from_millis(100));
    }
}

/// Migrates the source to `uri` and waits for the end; query-migrate's
/// answer once `completed`. Panics if it fails or takes too long.
///
/// QEMU's first pass sends all of RAM; then each round syncs the dirty
/// bitmap (what the vCPUs wrote, and the back-end's log) and sends the
/// pages marked since the last sync, until what is left fits in the
/// downtime limit. A page a back-end fills after QEMU sent it reaches the
/// destination only if the back-end marks it in the log. With `hold`, the
/// migration is held in those rounds that long after the first pass: a
/// downtime limit of 1 ms is not met while the guest runs (at 32 MiB/s,
/// so that the rounds are many and the pages they leave behind few).
/// Rounds send pages the guest wrote and freed, which its page cache
/// takes again for a read that only the back-end writes: a quick
/// migration seldom shows a missing mark there.
fn migrate(src: &mut Qmp, uri: &str, hold: Duration) -> Value {
    let set = |src: &mut Qmp, downtime_ms: u64, bandwidth: u64| {
        src.run(
            "migrate-set-parameters",
            json!({ "downtime-limit": downtime_ms, "max-bandwidth": bandwidth }),
        );
    };
    let holding = !hold.is_zero();
    set(src, if holding { 1 } else { DOWNTIME_LIMIT_MS }, BANDWIDTH);
    if let Err(e) = src.execute("migrate", json!({ "uri": uri })) {
        panic!("QEMU refused to migrate: {e}");
    }
    let deadline = Instant::now() + MIGRATION_TIMEOUT;
    // When the hold began; whether it is over.
    let mut held_since = None;
    let mut released = !holding;
    loop {
        let info = src.run("query-migrate", json!({}));
        match info["status"].as_str() {
            Some("completed") => return info,
            Some("failed") | Some("cancelled") => panic!(
                "the migration {}: {}",
                info["status"],
                info.get("error-desc").unwrap_or(&info)
            ),
            _ if Instant::now() > deadline => {
                let _ = src.execute("migrate_cancel", json!({}));
                panic!("the migration did not complete within {MIGRATION_TIMEOUT:?}: {info}");
            }
            _ => {}
        }
        // The first sync of the dirty bitmap starts the first pass, the
        // second ends it.
        let syncs = info["ram"]["dirty-sync-count"].as_u64().unwrap_or(0);
        if !released && syncs >= 2 {
            match held_since {
                None => {
                    set(src, 1, HOLD_BANDWIDTH);
                    held_since = Some(Instant::now());
                }
                Some(t) if t.elapsed() >= hold => {
                    set(src, DOWNTIME_LIMIT_MS, BANDWIDTH);
                    released = true;
                }
                Some(_) => {}
            }
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// SIGKILLs `daemon` while it has requests in flight and starts a new one
/// on the same socket and image.
fn restart_daemon<F>(mut daemon: Guard, side: &Side, start: &F) -> Guard
where
    F: Fn(&Side) -> (Guard, &'static str),
{
    // Long enough for a just-migrated destination to start its device
    // and take requests.
    kill_with_requests_in_flight(daemon.pid() as i32, &side.socket, Duration::from_secs(30));
    let status = daemon.wait_for(Duration::from_secs(20));
    eprintln!("killed the {} daemon: {status:?}", side.name);
    drop(daemon);
    start(side).0
}

/// How many times QEMU has started a daemon's rings on `side` (it hands
/// over the inflight region on every start: SeaBIOS's, the kernel's, a
/// reconnection's).
fn ring_starts(side: &Side) -> usize {
    read_log(&side.daemon_log)
        .matches("inflight region installed")
        .count()
}

/// Waits until QEMU has started the restarted daemon's rings, i.e. until
/// the log shows more starts than `before`.
fn wait_for_reconnection(side: &Side, daemon: &mut Guard, before: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while ring_starts(side) <= before {
        if let Some(status) = daemon.exited() {
            panic!("the restarted {} daemon exited: {status}", side.name);
        }
        assert!(
            Instant::now() < deadline,
            "QEMU did not reconnect to the restarted {} daemon within 30 s",
            side.name
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// Fills the regions the busy guest reads through its page cache, each
/// with different records (`rbcch NONCE K`, K counting through all of
/// them), and writes their SHA-256s, one line each, after them.
fn write_cache_regions(image: &Path, nonce: &str) {
    let mut data = Vec::with_capacity(CACHE_REGIONS * CACHE_REGION_LEN);
    for k in 0..CACHE_REGIONS * CACHE_REGION_LEN / 32 {
        writeln!(data, "rbcch {nonce} {k:016}").expect("writing to a Vec");
    }
    let mut sums = String::new();
    for region in data.chunks(CACHE_REGION_LEN) {
        sums.push_str(&sha256(region));
        sums.push('\n');
    }
    // Empty lines up to the 4 KiB the guest reads.
    let mut sums = sums.into_bytes();
    assert!(sums.len() <= 4096);
    sums.resize(4096, b'\n');
    let f = fs::OpenOptions::new()
        .write(true)
        .open(image)
        .expect("open the image");
    f.write_all_at(&data, CACHE_REGIONS_AT)
        .and_then(|()| f.write_all_at(&sums, CACHE_SUMS_AT))
        .and_then(|()| f.sync_all())
        .expect("write the cache regions");
}

/// The SHA-256 of `data` in hex, by coreutils' sha256sum.
fn sha256(data: &[u8]) -> String {
    let mut child = Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("running sha256sum");
    let mut stdin = child.stdin.take().expect("sha256sum's stdin");
    let writer = thread::scope(|s| {
        let w = s.spawn(move || stdin.write_all(data));
        let out = child.wait_with_output().expect("sha256sum's output");
        (w.join().expect("writer thread"), out)
    });
    let (written, out) = writer;
    written.expect("writing to sha256sum");
    assert!(out.status.success(), "sha256sum failed: {}", out.status);
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}
