//! Crashes: kill -9 of a process allocating (no acknowledged write lost,
//! `qemu-img check` clean), and power loss simulated from the journal of
//! every write and fdatasync that reached the file (the write-order
//! checker: everything before an fdatasync, plus any subset of what came
//! after it, must check clean).

use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use super::harness::*;
use ringblk::disk::qcow2::{Journal, JournalOp};
use ringblk::disk::{self, Format, Image, OpenOptions};

/// An overlay with 4 KiB clusters over a qcow2 base, so that a short
/// workload needs new L2 tables and new refblocks too (each L2 table covers
/// 2 MiB, each refblock 8 MiB of the file).
fn small_cluster_overlay(dir: &Path, size: u64) -> std::path::PathBuf {
    small_cluster_overlay_with(dir, size, "cluster_size=4096")
}

/// [`small_cluster_overlay`] made with the `qemu-img create -o` options
/// `opts`.
fn small_cluster_overlay_with(dir: &Path, size: u64, opts: &str) -> std::path::PathBuf {
    let raw = dir.join("base.raw");
    raw_base(&raw, size);
    let base = dir.join("base.qcow2");
    qemu_img(&[
        "convert",
        "-O",
        "qcow2",
        raw.to_str().unwrap(),
        base.to_str().unwrap(),
    ]);
    let top = dir.join("top.qcow2");
    create_qcow2(&top, opts, Some(("base.qcow2", "qcow2")), None);
    top
}

/// The workload of the write-order checker: allocating writes of 512 B to
/// 12 KiB over the whole disk (new L2 tables, new refblocks), rewrites,
/// write-zeroes with unmap, a grow (L1 table and header), flushes.
fn workload(img: &dyn Image, size: u64) {
    let mut rng = Rng(0xc0ffee);
    for i in 0..160u64 {
        let len = 512 * (1 + rng.below(24));
        let off = 512 * rng.below((size - len) / 512);
        let mut data = vec![0u8; len as usize];
        fill(500 + i, off, &mut data);
        write(img, off, &data).unwrap();
        if i % 40 == 39 {
            flush(img).unwrap();
        }
        if i % 50 == 25 {
            let z = 4096 * rng.below(size / 4096 - 8);
            write_zeroes(img, z, 5 * 4096 + 100, true).unwrap();
        }
        if i == 100 {
            img.grow(size + 64 * MIB).unwrap();
        }
    }
}

/// Lays one journalled write, `data` at `offset`, over `image` (a file's
/// bytes, grown as the write grew the file).
fn apply_write(image: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let end = offset as usize + data.len();
    if image.len() < end {
        image.resize(end, 0);
    }
    image[offset as usize..end].copy_from_slice(data);
}

/// Every image a power loss could leave of a file that was `initial`,
/// from the journal `ops` of the writes and fdatasyncs that reached it: at
/// every `step`-th fdatasync (and the start; `step` 0 is 1), everything
/// before it plus, of the writes after it up to the next one, none
/// (subset 0), all (1) and random ones (2 to `subsets - 1`; none of these
/// when there are no such writes). `f` gets the segment's journal range,
/// the subset, how many writes the segment has, and the image.
fn power_loss_images(
    ops: &[JournalOp],
    initial: &[u8],
    step: usize,
    subsets: usize,
    rng: &mut Rng,
    mut f: impl FnMut(std::ops::Range<usize>, usize, usize, &[u8]),
) {
    let mut starts = vec![0usize];
    starts.extend(
        ops.iter()
            .enumerate()
            .filter(|(_, op)| matches!(op, JournalOp::Sync))
            .map(|(i, _)| i + 1),
    );
    let mut durable = initial.to_vec();
    let mut applied = 0usize;
    for (n, &start) in starts.iter().enumerate() {
        // Make everything before `start` durable.
        for op in &ops[applied..start] {
            if let JournalOp::Write { offset, data } = op {
                apply_write(&mut durable, *offset, data);
            }
        }
        applied = start;
        if n % step.max(1) != 0 {
            continue;
        }
        let end = ops[start..]
            .iter()
            .position(|op| matches!(op, JournalOp::Sync))
            .map_or(ops.len(), |p| start + p);
        let writes: Vec<(u64, &Vec<u8>)> = ops[start..end]
            .iter()
            .filter_map(|op| match op {
                JournalOp::Write { offset, data } => Some((*offset, data)),
                JournalOp::Sync => None,
            })
            .collect();
        for k in 0..subsets {
            let mut image = durable.clone();
            for (offset, data) in writes.iter() {
                // Subset 0: none of them; 1: all; then random ones.
                let keep = match k {
                    0 => false,
                    1 => true,
                    _ => rng.below(2) == 0,
                };
                if keep {
                    apply_write(&mut image, *offset, data);
                }
            }
            f(start..end, k, writes.len(), &image);
            if writes.is_empty() {
                break;
            }
        }
    }
}

/// How the workload opens its image.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// imago's own write order (what the ordering prevents).
    Unordered,
    /// Ordered, without an L2 log: an fdatasync before each group's L2
    /// tables.
    Ordered,
    /// Ordered, with the L2 log (as the daemon runs): L2 tables held back
    /// until a FLUSH or a bound, their entries logged.
    Logged,
}

/// Opens `top` for a workload in `mode`, with the journal of every write
/// and fdatasync attached.
fn open_for(top: &Path, mode: Mode, journal: &Arc<Journal>) -> Box<dyn Image> {
    let options = OpenOptions {
        ordered: mode != Mode::Unordered,
        journal: Some(Arc::clone(journal)),
        ..OpenOptions::default()
    };
    match mode {
        Mode::Logged => open_logged(top, options).0,
        _ => disk::open(top, Format::Qcow2, &options).unwrap(),
    }
}

/// What the daemon does when it next takes an image after a power loss:
/// the L2 log is not this boot's (here: there is none), so the mark is
/// cleared and the image is served as its L2 tables are.
fn after_power_loss(path: &Path) {
    let log = ringblk::disk::qcow2::l2log::path_for(path);
    let _ = std::fs::remove_file(&log);
    drop(open_logged(path, OpenOptions::default()));
    let _ = std::fs::remove_file(&log);
}

/// Runs the workload with a journal and checks power-loss images at up to
/// `boundaries` fdatasyncs, `subsets` random subsets of the writes after
/// each. Returns (images checked, images corrupt, most leaks).
fn power_loss_replays(
    name: &str,
    mode: Mode,
    boundaries: usize,
    subsets: usize,
) -> (usize, usize, u64) {
    let dir = scratch(name);
    let size = 48 * MIB;
    let top = small_cluster_overlay(&dir, size);
    let initial = std::fs::read(&top).unwrap();
    let journal = Arc::new(Journal::default());
    {
        let img = open_for(&top, mode, &journal);
        workload(&*img, size);
        flush(&*img).unwrap();
    }
    // The image as the workload left it checks clean (no crash).
    check_clean(&top);

    let ops = journal.ops();
    let syncs: Vec<usize> = ops
        .iter()
        .enumerate()
        .filter(|(_, op)| matches!(op, JournalOp::Sync))
        .map(|(i, _)| i)
        .collect();
    assert!(
        syncs.len() > 3,
        "only {} fdatasyncs in the journal",
        syncs.len()
    );
    let step = (syncs.len() + 1) / boundaries;
    let replay_path = dir.join("replay.qcow2");
    let (mut checked, mut corrupt, mut most_leaks) = (0, 0, 0);
    let mut rng = Rng(0xfeed);
    power_loss_images(
        &ops,
        &initial,
        step,
        subsets,
        &mut rng,
        |segment, k, writes, image| {
            let start = segment.start;
            std::fs::write(&replay_path, image).unwrap();
            if mode == Mode::Logged {
                if k == 1 {
                    // QEMU opens the file as the power loss left it, the
                    // mark (an autoclear bit) set or not, and finds it as
                    // consistent as the daemon's next start leaves it.
                    let (c, _) = check(&replay_path);
                    assert_eq!(
                        c, 0,
                        "segment from journal op {start}: the image as a power loss left it is corrupt"
                    );
                }
                after_power_loss(&replay_path);
            }
            let (c, l) = check(&replay_path);
            checked += 1;
            if c > 0 {
                corrupt += 1;
                let keep = dir.join(format!("corrupt-{corrupt}.qcow2"));
                std::fs::copy(&replay_path, &keep).unwrap();
                eprintln!(
                    "corrupt: {} (segment from journal op {start}, {writes} writes, subset {k})",
                    keep.display(),
                );
            }
            most_leaks = most_leaks.max(l);
        },
    );
    (checked, corrupt, most_leaks)
}

/// Power loss at any instant of the workload leaves no corruption (leaks
/// are allowed and reported).
#[test]
fn power_loss_leaves_no_corruption() {
    for (mode, what) in [(Mode::Ordered, "no L2 log"), (Mode::Logged, "L2 log")] {
        let name = format!("power-loss-{}", what.replace(' ', "-"));
        let (checked, corrupt, leaks) = power_loss_replays(&name, mode, 120, 4);
        eprintln!(
            "power loss ({what}): {checked} images checked, {corrupt} corrupt, at most {leaks} leaked clusters"
        );
        assert!(checked >= 100, "{what}: only {checked} images checked");
        assert_eq!(
            corrupt, 0,
            "{what}: {corrupt} of {checked} power-loss images are corrupt"
        );
    }
}

/// The checker finds what the ordering prevents: imago's writes in its own
/// order (no fdatasync between refblocks and L2 tables, pointers written
/// before the refcounts of what they point to) leave corrupt images.
#[test]
fn power_loss_without_ordering_is_caught() {
    let (checked, corrupt, _) = power_loss_replays("power-loss-unordered", Mode::Unordered, 40, 12);
    eprintln!("unordered: {checked} images checked, {corrupt} corrupt");
    assert!(
        corrupt > 0,
        "the checker found no corruption in {checked} images without the ordering"
    );
}

/// What a power loss must not take: with the write cache off
/// (`--writethrough`) every completed write, with it on every write
/// completed before an acknowledged FLUSH. Allocating writes (new L2
/// tables and refblocks too) note the journal's length at each such
/// point; the image is rebuilt as a power loss there leaves it at worst
/// (only what an fdatasync made durable), checks clean and reads back
/// every write it must keep. Returns (points checked, most leaks).
fn power_loss_keeps_durable_writes(name: &str, writethrough: bool, mode: Mode) -> (usize, u64) {
    let dir = scratch(name);
    let size = 48 * MIB;
    let top = small_cluster_overlay(&dir, size);
    let initial = std::fs::read(&top).unwrap();
    let journal = Arc::new(Journal::default());
    // (journal length, how many writes must survive from there on)
    let mut points: Vec<(usize, usize)> = Vec::new();
    let mut writes: Vec<(u64, u64, u64)> = Vec::new();
    {
        let img = open_for(&top, mode, &journal);
        let mut rng = Rng(0xd00d + u64::from(writethrough));
        for i in 0..96u64 {
            let len = 512 * (1 + rng.below(24));
            let off = 512 * rng.below((size - len) / 512);
            let seed = 700 + i;
            let mut data = vec![0u8; len as usize];
            fill(seed, off, &mut data);
            if writethrough {
                write_through(&*img, off, &data).unwrap();
            } else {
                write(&*img, off, &data).unwrap();
            }
            writes.push((off, len, seed));
            if writethrough {
                points.push((journal.ops().len(), writes.len()));
            } else if i % 8 == 7 {
                flush(&*img).unwrap();
                points.push((journal.ops().len(), writes.len()));
            }
        }
    }
    let ops = journal.ops();
    let replay_path = dir.join("replay.qcow2");
    let mut durable = initial;
    let mut model = vec![0u8; size as usize];
    fill(0, 0, &mut model);
    let (mut applied, mut modelled) = (0usize, 0usize);
    let (mut checked, mut most_leaks) = (0usize, 0u64);
    for (n, &(at, keep)) in points.iter().enumerate() {
        // Durable at `at`: the writes before the last fdatasync before it.
        let synced = ops[..at]
            .iter()
            .rposition(|op| matches!(op, JournalOp::Sync))
            .map_or(0, |p| p + 1);
        for op in &ops[applied..synced.max(applied)] {
            if let JournalOp::Write { offset, data } = op {
                apply_write(&mut durable, *offset, data);
            }
        }
        applied = applied.max(synced);
        for &(off, len, seed) in &writes[modelled..keep] {
            let r = off as usize..(off + len) as usize;
            fill(seed, off, &mut model[r]);
        }
        modelled = keep;
        // Every third point with write-through (each write is one).
        if writethrough && n % 3 != 2 {
            continue;
        }
        std::fs::write(&replay_path, &durable).unwrap();
        if mode == Mode::Logged {
            after_power_loss(&replay_path);
        }
        let (corrupt, leaks) = check(&replay_path);
        assert_eq!(corrupt, 0, "power loss after write {keep}: corrupt image");
        most_leaks = most_leaks.max(leaks);
        let img = open(&replay_path, false);
        for (i, &(off, len, _)) in writes[..keep].iter().enumerate() {
            let mut got = vec![0u8; len as usize];
            read(&*img, off, &mut got).unwrap();
            assert!(
                got[..] == model[off as usize..(off + len) as usize],
                "power loss after write {keep} ({}): write {i} ({len} bytes at {off}) lost",
                if writethrough {
                    "write-through, completed"
                } else {
                    "FLUSH acknowledged"
                }
            );
        }
        checked += 1;
    }
    (checked, most_leaks)
}

/// Runs [`power_loss_keeps_durable_writes`] with and without the L2 log,
/// and wants at least `least` power-loss images checked in each.
fn power_loss_keeps_in_both_modes(what: &str, writethrough: bool, least: usize) {
    for mode in [Mode::Ordered, Mode::Logged] {
        let name = format!("power-loss-{what}-{}", mode as u8);
        let (checked, leaks) = power_loss_keeps_durable_writes(&name, writethrough, mode);
        eprintln!(
            "{what} (L2 log: {}): {checked} power-loss images, at most {leaks} leaked clusters",
            mode == Mode::Logged
        );
        assert!(checked >= least, "{what}: only {checked} images checked");
    }
}

/// Write-through: a power loss right after a write completed loses none
/// of the writes completed so far (their L2 entries are durable too).
#[test]
fn power_loss_keeps_every_completed_write_through() {
    power_loss_keeps_in_both_modes("writethrough", true, 30);
}

/// Write-back: a power loss right after a FLUSH was acknowledged loses
/// none of the writes completed before it.
#[test]
fn power_loss_keeps_every_flushed_write() {
    power_loss_keeps_in_both_modes("flushed", false, 12);
}

const CHILD_ENV: &str = "RINGBLK_FORMAT_CRASH_CHILD";

/// The process that is killed: allocating 4 KiB writes to distinct blocks,
/// printing `ACK block seed` once each completes (its commit returned).
/// Does nothing unless started by `kill_9_loses_no_acknowledged_write`.
#[test]
fn crash_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.split(',');
    let path = parts.next().unwrap().to_string();
    let round: u64 = parts.next().unwrap().parse().unwrap();
    let threads: u64 = parts.next().unwrap().parse().unwrap();
    let logged = parts.next() == Some("logged");
    let img = Arc::new(if logged {
        open_logged(Path::new(&path), OpenOptions::default()).0
    } else {
        open(Path::new(&path), true)
    });
    let blocks = img.size() / 4096;
    std::thread::scope(|s| {
        for t in 0..threads {
            let img = Arc::clone(&img);
            s.spawn(move || {
                let mut rng = Rng(0x9999 + round * 100 + t);
                loop {
                    // Blocks of this round and thread: block % (rounds*threads).
                    let slot = round * threads + t;
                    let block = rng.below(blocks / 64) * 64 + slot;
                    let seed = 10_000 + round * 1000 + t;
                    let mut data = vec![0u8; 4096];
                    fill(seed, block * 4096, &mut data);
                    write(&**img, block * 4096, &data).unwrap();
                    println!("ACK {block} {seed}");
                }
            });
        }
    });
}

/// kill -9 at random points of allocating writes, five times on one image:
/// each time `qemu-img check` finds no corruption, every acknowledged
/// write reads back, and a resubmission of the writes in flight (inflight
/// replay, which may allocate again) keeps the image consistent. Without
/// an L2 log.
#[test]
fn kill_9_loses_no_acknowledged_write() {
    kill_9_rounds("kill9", false);
}

/// The same with the L2 log, as the daemon runs: the child never flushes,
/// so each kill leaves L2 entries only in the log, and the image marked
/// (autoclear bit 62). Right after the kill, before anything of ringblk's
/// runs, QEMU opens the image: `qemu-img info` and `check` (no corruption)
/// succeed, and `qemu-img convert` reads every write of the earlier
/// rounds (flushed), and each block of this round as either its write or
/// what it held before (the file alone is the disk as of the last
/// write-out, plus writes that went in place). The next open with the log
/// writes the log's entries in, and every acknowledged write reads back.
/// On the old code (incompatible bit 62) `qemu-img info` refused the image.
#[test]
fn kill_9_with_the_l2_log_loses_no_acknowledged_write() {
    kill_9_rounds("kill9-logged", true);
}

fn kill_9_rounds(name: &str, logged: bool) {
    let dir = scratch(name);
    let size = 64 * MIB;
    // 64-bit refcounts: a refblock covers 2 MiB of the file, so that the
    // rounds hook up new refblocks too, and kills land while one is held
    // back (its refcount table entry not written yet).
    let top = small_cluster_overlay_with(&dir, size, "cluster_size=4096,refcount_bits=64");
    let exe = std::env::current_exe().unwrap();
    // This binary again, running only `crash_child`: its test name is this
    // module's path in the binary (the crate's name left out).
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    let child_test = format!("{module}::crash_child");
    let mut acked: Vec<(u64, u64)> = Vec::new();
    let mut rng = Rng(77);
    let mut leak_counts = Vec::new();
    let mut replayed = Vec::new();
    // Rounds with the L2 log whose kill found the image marked.
    let mut marked_rounds = 0;
    // What each block held at the last FLUSH (the end of the last round).
    let mut flushed: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
    let base_raw = std::fs::read(dir.join("base.raw")).unwrap();
    let mut round_blocks: Vec<(u64, u64)>;
    // 8 rounds of 8 threads: 64 distinct block slots (`crash_child`).
    for round in 0..8u64 {
        let threads = 8;
        let mut child = Command::new(&exe)
            .args([
                child_test.as_str(),
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(
                CHILD_ENV,
                format!(
                    "{},{round},{threads},{}",
                    top.display(),
                    if logged { "logged" } else { "plain" }
                ),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let want = 50 + rng.below(400) as usize;
        round_blocks = Vec::new();
        let mut reader = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        let mut round_acks = 0;
        while round_acks < want {
            line.clear();
            if reader.read_line(&mut line).unwrap() == 0 {
                panic!("the child exited early: {:?}", child.wait());
            }
            if let Some(rest) = line.strip_prefix("ACK ") {
                let mut it = rest.split_whitespace();
                let block: u64 = it.next().unwrap().parse().unwrap();
                let seed: u64 = it.next().unwrap().parse().unwrap();
                acked.push((block, seed));
                round_blocks.push((block, seed));
                round_acks += 1;
            }
        }
        // SIGKILL, mid-write.
        child.kill().unwrap();
        child.wait().unwrap();
        // Acks already in the pipe were published before the kill.
        let mut rest = String::new();
        while reader.read_line(&mut rest).unwrap_or(0) > 0 {
            if let Some(r) = rest.trim_end().strip_prefix("ACK ") {
                let mut it = r.split_whitespace();
                if let (Some(b), Some(s)) = (it.next(), it.next()) {
                    acked.push((b.parse().unwrap(), s.parse().unwrap()));
                    round_blocks.push((b.parse().unwrap(), s.parse().unwrap()));
                }
            }
            rest.clear();
        }
        if logged {
            // QEMU opens the image as the kill left it, marked or not.
            let info = Command::new("qemu-img")
                .args(["info", "-f", "qcow2"])
                .arg(&top)
                .output()
                .unwrap();
            assert!(
                info.status.success(),
                "round {round}: qemu-img info refused the image: {}",
                String::from_utf8_lossy(&info.stderr)
            );
            let mut h = [0u8; 96];
            std::fs::File::open(&top)
                .unwrap()
                .read_exact_at(&mut h, 0)
                .unwrap();
            assert_eq!(h[72] & 0x40, 0, "round {round}: incompatible bit 62 set");
            let marked = h[88] & 0x40 != 0;
            if marked {
                marked_rounds += 1;
            }
            check_clean(&top);
            // The file alone: the disk as of the last FLUSH at least.
            let converted = dir.join("converted.raw");
            qemu_img(&[
                "convert",
                "-O",
                "raw",
                top.to_str().unwrap(),
                converted.to_str().unwrap(),
            ]);
            let conv = std::fs::File::open(&converted).unwrap();
            let block_of = |block: u64| {
                let mut got = vec![0u8; 4096];
                conv.read_exact_at(&mut got, block * 4096).unwrap();
                got
            };
            for (&block, &seed) in &flushed {
                let mut want = vec![0u8; 4096];
                fill(seed, block * 4096, &mut want);
                assert!(
                    block_of(block) == want,
                    "round {round}: flushed block {block} is not in the image without its L2 log"
                );
            }
            // This round's blocks (never written before): the write, or
            // the base's data.
            let mut in_log = 0;
            for &(block, seed) in &round_blocks {
                let mut want = vec![0u8; 4096];
                fill(seed, block * 4096, &mut want);
                let got = block_of(block);
                let at = (block * 4096) as usize;
                if got != want {
                    assert!(
                        got[..] == base_raw[at..at + 4096],
                        "round {round}: block {block} reads neither its write nor what it held"
                    );
                    in_log += 1;
                }
            }
            assert!(
                marked || in_log == 0,
                "round {round}: {in_log} acknowledged writes missing from an unmarked image"
            );
            drop(conv);
            std::fs::remove_file(&converted).unwrap();
            // The next open writes the log in. (A kill right after a
            // write-out, which a new table's hook-up makes, finds the log
            // empty and the image unmarked.)
            let (img, n) = open_logged(&top, OpenOptions::default());
            assert_eq!(
                n > 0,
                marked,
                "round {round}: {n} L2 log entries written in, the image {}marked",
                if marked { "" } else { "not " }
            );
            replayed.push(n);
            drop(img);
        }
        let leaks = check_clean(&top);
        leak_counts.push(leaks);
        // Every acknowledged write is there (the last ack of a block wins;
        // blocks are distinct per round and thread, and rounds reuse none).
        let img = open(&top, false);
        let mut last = std::collections::HashMap::new();
        for &(b, s) in &acked {
            last.insert(b, s);
        }
        for (&block, &seed) in &last {
            let mut got = vec![0u8; 4096];
            read(&*img, block * 4096, &mut got).unwrap();
            let mut want = vec![0u8; 4096];
            fill(seed, block * 4096, &mut want);
            assert!(
                got == want,
                "round {round}: acknowledged block {block} lost"
            );
        }
        drop(img);
        // Inflight replay: the writes that may have been in flight are
        // submitted again after the restart (the same data to the same
        // blocks), possibly allocating again.
        let img = if logged {
            open_logged(&top, OpenOptions::default()).0
        } else {
            open(&top, true)
        };
        for t in 0..threads {
            let mut rng2 = Rng(0x9999 + round * 100 + t);
            let slot = round * threads + t;
            for _ in 0..3 {
                let block = rng2.below(size / 4096 / 64) * 64 + slot;
                let seed = 10_000 + round * 1000 + t;
                let mut data = vec![0u8; 4096];
                fill(seed, block * 4096, &mut data);
                write(&*img, block * 4096, &data).unwrap();
            }
        }
        flush(&*img).unwrap();
        drop(img);
        check_clean(&top);
        for &(b, s) in &acked {
            flushed.insert(b, s);
        }
    }
    eprintln!(
        "kill -9 ({name}): {} acknowledged writes, leaked clusters after each kill: {leak_counts:?}, L2 log entries written in: {replayed:?}",
        acked.len()
    );
    if logged {
        assert!(
            marked_rounds >= 4,
            "only {marked_rounds} of 8 kills found L2 entries in the log"
        );
    }
    // The rounds hooked up new refblocks (one covers 2 MiB of the file).
    let len = std::fs::metadata(&top).unwrap().len();
    assert!(len > 4 * MIB, "the image grew to {len} bytes only");
    let _ = std::fs::File::open(&top).unwrap().read_at(&mut [0u8; 1], 0);
}

/// An L2 log is a file from elsewhere as far as the next open knows: one
/// whose entries point outside the image's L2 tables and refblocks (here:
/// into the header) is not applied, the mark is cleared all the same, and
/// the image is as its own tables have it, consistent. One of another
/// image, or cut short, is not applied either (unit tests in l2log.rs).
#[test]
fn a_log_pointing_outside_the_tables_is_not_applied() {
    use ringblk::disk::qcow2::l2log::{L2Log, path_for};
    let dir = scratch("l2log-hostile");
    let top = small_cluster_overlay(&dir, 8 * MIB);
    let header = std::fs::read(&top).unwrap()[..512].to_vec();
    {
        let (img, _) = open_logged(&top, OpenOptions::default());
        let mut data = vec![0u8; 4096];
        fill(9, 4096, &mut data);
        write(&*img, 4096, &data).unwrap();
        // Killed: nothing written out.
        std::mem::forget(img);
    }
    let image = std::fs::File::open(&top).unwrap();
    let log = L2Log::open(&path_for(&top)).unwrap();
    log.reset(&image).unwrap();
    log.append(&[(0x40, u64::MAX)]).unwrap();
    let (img, replayed) = open_logged(&top, OpenOptions::default());
    assert_eq!(replayed, 0, "a hostile entry was written into the image");
    drop(img);
    let after = std::fs::read(&top).unwrap();
    assert_eq!(
        after[0x40..0x48],
        header[0x40..0x48],
        "the header was written"
    );
    check_clean(&top);
}

/// A commit of data clusters allocated since the last one logs their L2
/// entries and refcounts itself: one record of two words (the entry, the
/// refcount's word) per allocating write, where imago writing its tables
/// makes two records (the L2 table's diff, the refblock's). After a kill
/// -9 (the image forgotten, not dropped: nothing written out) the next
/// open replays them: every write reads back, and `qemu-img check` finds
/// the image clean.
#[test]
fn a_commit_logs_its_allocations_itself() {
    let dir = scratch("l2log-allocations");
    let top = small_cluster_overlay(&dir, 8 * MIB);
    let log = ringblk::disk::qcow2::l2log::path_for(&top);
    let block = |i: u64| {
        let mut data = vec![0u8; 4096];
        fill(20 + i, i * 8192, &mut data);
        data
    };
    {
        let (img, _) = open_logged(&top, OpenOptions::default());
        // The first commit after the open has imago write its caches.
        write(&*img, 0, &block(0)).unwrap();
        let before = std::fs::metadata(&log).unwrap().len();
        // In the same L2 table (2 MiB) and refblock (8 MiB of the file).
        for i in 1..=3 {
            write(&*img, i * 8192, &block(i)).unwrap();
        }
        let grown = std::fs::metadata(&log).unwrap().len() - before;
        assert_eq!(grown, 3 * (16 + 2 * 16), "one record of two words a write");
        std::mem::forget(img);
    }
    let (img, replayed) = open_logged(&top, OpenOptions::default());
    assert!(replayed >= 6, "{replayed} entries replayed");
    for i in 0..=3 {
        let mut got = vec![0u8; 4096];
        read(&*img, i * 8192, &mut got).unwrap();
        assert!(got == block(i), "block {i} after the replay");
    }
    flush(&*img).unwrap();
    drop(img);
    check_clean(&top);
}

/// An image an older daemon left marked by a kill -9 (incompatible bit
/// 62, which QEMU refuses) is still recovered: the next open with the log
/// writes the log's entries in and clears the old bit, and QEMU opens the
/// image, clean, with the write. (The old code did this too: this guards
/// the upgrade, it does not fix it.)
#[test]
fn an_image_marked_by_an_older_daemon_is_recovered() {
    let dir = scratch("l2log-old-mark");
    let top = small_cluster_overlay(&dir, 8 * MIB);
    let mut data = vec![0u8; 4096];
    fill(77, 3 * 4096, &mut data);
    {
        let (img, _) = open_logged(&top, OpenOptions::default());
        // The first allocation hooks up an L2 table (a write-out); the
        // second one's entry is in the log only.
        let mut first = vec![0u8; 4096];
        fill(76, 0, &mut first);
        write(&*img, 0, &first).unwrap();
        write(&*img, 3 * 4096, &data).unwrap();
        // Killed: nothing written out.
        std::mem::forget(img);
    }
    // As the older daemon marked it: incompatible bit 62, no autoclear bit.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&top)
        .unwrap();
    let mut h = [0u8; 96];
    f.read_exact_at(&mut h, 0).unwrap();
    assert_ne!(h[88] & 0x40, 0, "the kill left no mark");
    f.write_all_at(&[h[72] | 0x40], 72).unwrap();
    f.write_all_at(&[h[88] & !0x40], 88).unwrap();
    drop(f);
    let info = Command::new("qemu-img")
        .args(["info", "-f", "qcow2"])
        .arg(&top)
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&info.stderr).contains("incompatible feature"),
        "QEMU opened an image with incompatible bit 62"
    );
    // Nothing but a writable open with the log takes it.
    assert!(disk::open(&top, Format::Qcow2, &OpenOptions::default()).is_err());
    let (img, replayed) = open_logged(&top, OpenOptions::default());
    assert!(replayed > 0, "the log was not written in");
    drop(img);
    let mut h = [0u8; 96];
    std::fs::File::open(&top)
        .unwrap()
        .read_exact_at(&mut h, 0)
        .unwrap();
    assert_eq!((h[72] & 0x40, h[88] & 0x40), (0, 0), "a mark is left");
    check_clean(&top);
    let img = open(&top, false);
    let mut got = vec![0u8; 4096];
    read(&*img, 3 * 4096, &mut got).unwrap();
    assert!(got == data, "the write the log held is lost");
}

/// `image` (a qcow2 chain) converted to raw: the disk it reads as.
fn disk_of(image: &Path, dir: &Path) -> Vec<u8> {
    let out = dir.join("disk-of.raw");
    qemu_img(&[
        "convert",
        "-f",
        "qcow2",
        "-O",
        "raw",
        image.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    let data = std::fs::read(&out).unwrap();
    std::fs::remove_file(&out).unwrap();
    data
}

/// Power loss at any instant of a stream (its copy into the top, a
/// fdatasync'd stretch at a time, and its switch of the top's backing
/// file): whatever subset of the writes after the last fdatasync reached
/// the top, the chain it names (the old one or the new one) checks clean
/// and reads as the disk read before the stream. The copy's data reaches
/// the file before any table points to it, and the header's name before
/// the fields that name it.
#[test]
fn power_loss_during_a_stream_keeps_the_disk() {
    let dir = scratch("power-loss-stream");
    let size = 8 * MIB;
    let base = dir.join("base.raw");
    raw_base(&base, size);
    let mid = dir.join("mid.qcow2");
    create_qcow2(&mid, "cluster_size=4096", Some(("base.raw", "raw")), None);
    let top = dir.join("top.qcow2");
    create_qcow2(
        &top,
        "cluster_size=4096",
        Some(("mid.qcow2", "qcow2")),
        None,
    );
    let mut rng = Rng(0x5eed);
    for (path, seed) in [(&mid, 10u64), (&top, 20)] {
        let img = open(path, true);
        for i in 0..60u64 {
            let len = 512 * (1 + rng.below(32));
            let off = 512 * rng.below((size - len) / 512);
            let mut data = vec![0u8; len as usize];
            fill(seed + i, off, &mut data);
            write(&*img, off, &data).unwrap();
        }
        if seed == 10 {
            // Zeroes the middle layer says are explicit: over the base's
            // data, they must stay zeroes.
            write_zeroes(&*img, 2 * MIB, 256 * 1024, false).unwrap();
        }
        flush(&*img).unwrap();
    }
    let reference = disk_of(&top, &dir);
    let initial = std::fs::read(&top).unwrap();
    let journal = Arc::new(Journal::default());
    let base_name = base.to_str().unwrap().to_string();
    {
        let options = OpenOptions {
            journal: Some(Arc::clone(&journal)),
            ..OpenOptions::default()
        };
        let img = disk::open(&top, Format::Qcow2, &options).unwrap();
        let q = img.as_qcow2().unwrap();
        let mut copied = 0;
        for off in (0..size).step_by(MIB as usize) {
            copied += q.stream_step(2, off, MIB).unwrap().copied;
        }
        assert!(copied > 0, "the stream copied nothing");
        let streamed = q
            .rebase(0, 2, Some(&base_name), &options, None, None)
            .unwrap();
        assert_eq!(streamed.chain(), [top.clone(), base.clone()]);
        let mut buf = vec![0u8; size as usize];
        read(&streamed, 0, &mut buf).unwrap();
        assert!(buf == reference, "the streamed image reads otherwise");
    }
    check_clean(&top);
    assert!(disk_of(&top, &dir) == reference, "after the stream");

    let ops = journal.ops();
    let replay = dir.join("replay.qcow2");
    let (mut checked, mut switched) = (0, 0);
    power_loss_images(&ops, &initial, 1, 4, &mut rng, |segment, k, _, image| {
        std::fs::write(&replay, image).unwrap();
        let (corrupt, _) = check(&replay);
        assert_eq!(corrupt, 0, "journal ops {segment:?}, subset {k}: corrupt");
        assert!(
            disk_of(&replay, &dir) == reference,
            "journal ops {segment:?}, subset {k}: the disk reads otherwise"
        );
        let info = qemu_img(&["info", "--output=json", replay.to_str().unwrap()]);
        if info.contains(&format!("\"backing-filename\": \"{base_name}\"")) {
            switched += 1;
        }
        checked += 1;
    });
    eprintln!(
        "power loss during a stream: {checked} images checked, {switched} with the new chain"
    );
    assert!(checked >= 20, "only {checked} images checked");
    assert!(switched > 0, "no image had the new chain");
}

/// A power loss at any point of an active commit's copy into its base
/// (replayed from the base's journal, every prefix and subsets of the
/// writes in flight): the base checks clean, and the chain the top names
/// (the top over that base) reads as the disk read before: what the copy
/// wrote into the base lies under clusters the top has. Once copied, the
/// base on its own reads as the disk, and so does the image the pivot
/// makes of it.
#[test]
fn power_loss_during_an_active_commit_keeps_the_disk() {
    let dir = scratch("power-loss-active-commit");
    let size = 8 * MIB;
    let base = dir.join("base.raw");
    raw_base(&base, size);
    let mid = dir.join("mid.qcow2");
    create_qcow2(&mid, "cluster_size=4096", Some(("base.raw", "raw")), None);
    let top = dir.join("top.qcow2");
    create_qcow2(
        &top,
        "cluster_size=65536",
        Some(("mid.qcow2", "qcow2")),
        None,
    );
    let mut rng = Rng(0xac7e);
    for (path, seed) in [(&mid, 10u64), (&top, 20)] {
        let img = open(path, true);
        for i in 0..60u64 {
            let len = 512 * (1 + rng.below(32));
            let off = 512 * rng.below((size - len) / 512);
            let mut data = vec![0u8; len as usize];
            fill(seed + i, off, &mut data);
            write(&*img, off, &data).unwrap();
        }
        if seed == 20 {
            // Zeroes the top says are explicit: over the base's data,
            // they must go down as zeroes.
            write_zeroes(&*img, 2 * MIB, 256 * 1024, false).unwrap();
        }
        flush(&*img).unwrap();
    }
    let reference = disk_of(&top, &dir);
    let initial = std::fs::read(&mid).unwrap();
    let journal = Arc::new(Journal::default());
    {
        let options = OpenOptions {
            journal: Some(Arc::clone(&journal)),
            ..OpenOptions::default()
        };
        // Only the base's writes are journaled.
        let img = disk::open(&top, Format::Qcow2, &OpenOptions::default()).unwrap();
        let q = img.as_qcow2().unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&mid)
            .unwrap();
        let into = q.open_base(1, file, &options, true).unwrap();
        let mut copied = 0;
        for off in (0..size).step_by(MIB as usize) {
            copied += q.commit_extents(&into, 0, 1, &[(off, MIB)]).unwrap().copied;
        }
        assert!(copied > 0, "the commit copied nothing");
        let pivoted = q.pivot(&into, 1, &options, || Ok(())).unwrap();
        assert_eq!(pivoted.chain(), [mid.clone(), base.clone()]);
        let mut buf = vec![0u8; size as usize];
        read(&pivoted, 0, &mut buf).unwrap();
        assert!(buf == reference, "the pivoted image reads otherwise");
    }
    check_clean(&mid);
    assert!(
        disk_of(&mid, &dir) == reference,
        "the base after the commit"
    );

    let ops = journal.ops();
    let (mut checked, mut whole) = (0, 0);
    let copied_base = std::fs::read(&mid).unwrap();
    power_loss_images(&ops, &initial, 1, 4, &mut rng, |segment, k, _, image| {
        std::fs::write(&mid, image).unwrap();
        let (corrupt, _) = check(&mid);
        assert_eq!(corrupt, 0, "journal ops {segment:?}, subset {k}: corrupt");
        assert!(
            disk_of(&top, &dir) == reference,
            "journal ops {segment:?}, subset {k}: the chain reads otherwise"
        );
        if disk_of(&mid, &dir) == reference {
            whole += 1;
        }
        checked += 1;
    });
    std::fs::write(&mid, copied_base).unwrap();
    eprintln!(
        "power loss during an active commit: {checked} images checked, {whole} with the whole copy"
    );
    assert!(checked >= 20, "only {checked} images checked");
    assert!(whole > 0, "no image had the whole copy");
}
