//! Live migration of a real guest between two daemons serving one Ceph
//! RBD image on the binary's cluster: the exclusive lock passes to the
//! destination. The harness is the kit's `vm::migration`, as for the
//! image-file cases of `tests/guest/migration.rs`.

use ringblk_testkit::vm::migration::{Kill, Migration, Storage, Workload, run};

/// Both daemons serve one RBD image; the destination's writes take its
/// exclusive lock from the source's daemon. Two queues, on each daemon's
/// one image handle.
#[test]
fn migrate_busy_rbd() {
    run(Migration {
        storage: Storage::Rbd,
        ..Migration::busy(2)
    });
}

/// An idle guest on an RBD image migrates, then does its I/O on the
/// destination: the lock moves with the destination's first write.
#[test]
fn migrate_idle_rbd_then_io_on_destination() {
    run(Migration {
        storage: Storage::Rbd,
        workload: Workload::Idle,
        ..Migration::busy(1)
    });
}

/// The destination's daemon on an RBD image crashes right after the
/// migration: its restart resubmits through the inflight log once the OSD
/// has dropped the dead daemon's watch and lock (8 s on the test cluster).
#[test]
fn migrate_then_kill_destination_daemon_rbd() {
    run(Migration {
        storage: Storage::Rbd,
        kill: Some(Kill::DestinationAfterMigration),
        ..Migration::busy(2)
    });
}
