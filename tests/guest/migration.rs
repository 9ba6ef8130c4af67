//! Live migration of a real guest between two daemons serving one image
//! file, busy or idle, with kill -9 of either daemon around it. The
//! harness, and what makes a missing dirty mark show, are in the kit's
//! `vm::migration`; the RBD cases are in `tests/rbd/migration.rs`.

use ringblk_testkit::vm::migration::{Kill, Migration, Storage, Workload, run};

#[test]
fn migrate_busy_one_queue() {
    run(Migration::busy(1));
}

/// Two queues, each with its own fio job (and vCPU).
#[test]
fn migrate_busy_two_queues() {
    run(Migration::busy(2));
}

#[test]
fn migrate_idle_then_io_on_destination() {
    run(Migration {
        workload: Workload::Idle,
        ..Migration::busy(1)
    });
}

/// The destination's daemon crashes right after the migration, under the
/// guest's fio; its restart takes over the rings through the inflight log.
#[test]
fn migrate_then_kill_destination_daemon() {
    run(Migration {
        kill: Some(Kill::DestinationAfterMigration),
        ..Migration::busy(2)
    });
}

/// The source's daemon crashes under the guest's fio and is restarted;
/// the migration then starts from the restarted one.
#[test]
fn kill_source_daemon_then_migrate() {
    run(Migration {
        kill: Some(Kill::SourceBeforeMigration),
        // Room for the kill, QEMU's reconnection and I/O against the new
        // daemon before the migration.
        fio_runtime: 30,
        ..Migration::busy(2)
    });
}

/// A dirty bitmap through a busy guest's migration: added on the source
/// before the boot, written out by the source's daemon as its rings stop,
/// loaded by the destination's as its own start; afterwards it holds every
/// granule the guest changed on either side.
#[test]
fn migrate_busy_with_a_dirty_bitmap() {
    run(Migration {
        bitmap: true,
        ..Migration::busy(1)
    });
}

/// A busy guest on a qcow2 overlay over the image file (`--format
/// qcow2`): its reads fall through to the base, its writes allocate in the
/// overlay on the source and then on the destination, whose daemon reads
/// the metadata afresh when its rings start. The chain checks clean.
#[test]
fn migrate_busy_qcow2_overlay() {
    run(Migration {
        storage: Storage::Qcow2,
        ..Migration::busy(2)
    });
}

/// A dirty bitmap through a busy guest's migration on a fresh qcow2
/// overlay: `ctl bitmap add` on the source puts it into the overlay (the
/// bitmaps extension created), the source writes the bits back as its
/// rings stop, the destination loads them as its own start; afterwards it
/// holds every granule the guest changed on either side, and QEMU lists
/// it in the overlay, not in use.
#[test]
fn migrate_busy_qcow2_overlay_with_a_dirty_bitmap() {
    run(Migration {
        storage: Storage::Qcow2,
        bitmap: true,
        ..Migration::busy(1)
    });
}

/// A busy guest on an encrypted qcow2 overlay (`encrypt.format=luks`,
/// `--key-file`) over the image file: its writes are encrypted into the
/// overlay on the source and then on the destination; QEMU, given the
/// secret, finds the chain clean and reads what the guest wrote.
#[test]
fn migrate_busy_encrypted_qcow2_overlay() {
    run(Migration {
        storage: Storage::EncryptedQcow2,
        ..Migration::busy(2)
    });
}
