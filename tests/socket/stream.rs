//! Stream jobs (`ctl stream`, `ctl job`): the layers between the top and a
//! base copied up into the top while the guest writes, then dropped from
//! the chain; qemu-img is the judge of what is left on disk.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ringblk_testkit::qemu_img::{check_clean, compare_identical, qemu_img, sha256};
use ringblk_testkit::{Client, MIB, ctl, test_dir};

use super::qcow2::{
    Chain, SIZE, canonical, chain, reads_as_reference, serve, snapshot, status_chain, stop,
    write_round,
};

fn ok(out: &std::process::Output, what: &str) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// The daemon's control socket, snapshot and backup directories in a
/// test's directory (the directories made).
struct Dirs {
    api: PathBuf,
    snaps: PathBuf,
    backups: PathBuf,
}

fn dirs(dir: &Path) -> Dirs {
    let d = Dirs {
        api: dir.join("api.sock"),
        snaps: dir.join("snaps"),
        backups: dir.join("backups"),
    };
    std::fs::create_dir(&d.snaps).unwrap();
    std::fs::create_dir(&d.backups).unwrap();
    d
}

/// `--api API --snapshot-dir SNAPS [--backup-dir BACKUPS]`.
fn args_of<'a>(api: &'a Path, snaps: &'a Path, backups: Option<&'a Path>) -> Vec<&'a str> {
    let mut args = vec![
        "--api",
        api.to_str().unwrap(),
        "--snapshot-dir",
        snaps.to_str().unwrap(),
    ];
    if let Some(b) = backups {
        args.extend(["--backup-dir", b.to_str().unwrap()]);
    }
    args
}

/// `ctl ARGS` must fail with one line containing `what`.
fn refused(api: &Path, args: &[&str], what: &str) {
    let out = ctl(api, args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "ctl {args:?}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "ctl {args:?}: {err}");
    assert!(err.contains(what), "ctl {args:?}: {err}");
}

/// Polls `job status` until the job is no longer running.
fn wait_job(api: &Path) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let job = ok(&ctl(api, &["job", "status"]), "job status");
        if job["state"] != "running" {
            return job;
        }
        assert!(Instant::now() < deadline, "the job runs on: {job}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The chain qemu-img sees from `top`, top first (`-U`: also while the
/// daemon holds the image).
fn qemu_chain(top: &Path) -> Vec<String> {
    let out = qemu_img(&[
        "info",
        "-U",
        "--backing-chain",
        "--output=json",
        top.to_str().unwrap(),
    ]);
    let infos: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    infos
        .iter()
        .map(|i| canonical(Path::new(i["filename"].as_str().unwrap())))
        .collect()
}

/// Waits until a process that was killed no longer holds `image`'s
/// locks: its io_uring, torn down by the kernel after the process is
/// reaped, holds its files (and so their locks) until then.
fn unlocked(image: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = std::process::Command::new("qemu-img")
            .args(["info", "-f", "qcow2"])
            .arg(image)
            .output()
            .unwrap();
        if out.status.success() {
            return;
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("Failed to lock") && Instant::now() < deadline,
            "qemu-img info {}: {err}",
            image.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A chain of four: base.raw, top.qcow2 (the named image), s1.qcow2 and
/// s2.qcow2 made by live snapshots, each layer with writes of its own.
fn four_layers(dir: &Path, c: &Chain, client: &mut Client, api: &Path) {
    write_round(client, c, 10, 12);
    snapshot(api, "s1.qcow2");
    write_round(client, c, 20, 12);
    snapshot(api, "s2.qcow2");
    write_round(client, c, 30, 6);
    assert_eq!(
        status_chain(api),
        [
            canonical(&dir.join("snaps/s2.qcow2")),
            canonical(&dir.join("snaps/s1.qcow2")),
            canonical(&c.top),
            canonical(&c.base),
        ]
    );
}

/// A stream onto the base while the guest writes, then one that leaves
/// the top alone: each time every read is what the guest wrote, the
/// layers dropped are untouched and listed as unused, qemu-img sees the
/// new chain and finds every file clean, and a restart with the same
/// command line (which follows the snapshot records to the top) serves
/// the new chain.
#[test]
fn a_stream_under_writes_drops_the_layers_and_loses_nothing() {
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let Dirs { api, snaps, .. } = dirs(dir.path());
    let args = args_of(&api, &snaps, None);
    let d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    four_layers(dir.path(), &c, &mut client, &api);
    let (s1, s2) = (snaps.join("s1.qcow2"), snaps.join("s2.qcow2"));
    let sums = [sha256(&c.top), sha256(&s1), sha256(&c.base)];

    // Slow enough that the guest's writes land while it copies.
    let base = canonical(&c.base);
    let started = ok(
        &ctl(&api, &["stream", "--base", &base, "--speed", "2M"]),
        "stream",
    );
    assert_eq!(started["state"], "running");
    assert_eq!(started["kind"], "stream");
    assert_eq!(started["total"], SIZE);
    // Its progress shows in the metrics.
    let metrics = ctl(&api, &["stats", "--prometheus"]);
    let text = String::from_utf8_lossy(&metrics.stdout);
    assert!(
        text.contains("ringblk_job_running{kind=\"stream\"} 1"),
        "{text}"
    );
    assert!(text.contains(&format!(
        "ringblk_job_total_bytes{{kind=\"stream\"}} {SIZE}"
    )));
    // One job at a time; a snapshot or a backup waits for it.
    refused(&api, &["stream"], "a stream job is running already");
    refused(
        &api,
        &["snapshot", "--overlay", "s3.qcow2"],
        "a stream job is running",
    );
    let mut rounds = 0;
    while ok(&ctl(&api, &["job", "status"]), "job status")["state"] == "running" {
        write_round(&mut client, &c, 40 + rounds, 3);
        rounds += 1;
    }
    let job = wait_job(&api);
    assert_eq!(job["state"], "completed", "{job}");
    assert!(
        rounds > 0,
        "the stream ended before the guest wrote during it"
    );
    assert_eq!(job["done"], SIZE);
    let metrics = ctl(&api, &["stats", "--prometheus"]);
    let text = String::from_utf8_lossy(&metrics.stdout);
    assert!(
        text.contains("ringblk_job_running{kind=\"stream\"} 0"),
        "{text}"
    );
    assert!(text.contains(&format!("ringblk_job_done_bytes{{kind=\"stream\"}} {SIZE}")));
    // And in the JSON document, as `job status` has it.
    let doc = ok(&ctl(&api, &["stats", "--json"]), "stats --json");
    assert_eq!(doc["job"]["state"], "completed", "{doc}");
    assert_eq!(doc["job"]["done"], SIZE, "{doc}");
    assert!(job["copied"].as_u64().unwrap() > 0, "{job}");
    let new_chain = [canonical(&s2), base.clone()];
    assert_eq!(status_chain(&api), new_chain);
    assert_eq!(job["chain"], serde_json::json!(new_chain));
    assert_eq!(
        job["unused"],
        serde_json::json!([canonical(&s1), canonical(&c.top)])
    );
    reads_as_reference(&mut client, &c, "after the stream");
    write_round(&mut client, &c, 90, 4);
    reads_as_reference(&mut client, &c, "writes after the stream");

    // Standing alone: every layer below the top copied up.
    let job = ok(&ctl(&api, &["stream"]), "stream to none");
    assert_eq!(job["base"], serde_json::Value::Null);
    let job = wait_job(&api);
    assert_eq!(job["state"], "completed", "{job}");
    assert_eq!(status_chain(&api), [canonical(&s2)]);
    assert_eq!(job["unused"], serde_json::json!([base]));
    reads_as_reference(&mut client, &c, "after the second stream");
    drop(client);
    stop(d);

    assert_eq!(qemu_chain(&s2), [canonical(&s2)]);
    check_clean(&s2);
    compare_identical(&s2, &c.reference);
    assert_eq!(
        [sha256(&c.top), sha256(&s1), sha256(&c.base)],
        sums,
        "a dropped layer was written"
    );

    // The same command line again: the records lead to s2, which now
    // stands alone.
    let d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    assert_eq!(status_chain(&api), [canonical(&s2)]);
    reads_as_reference(&mut client, &c, "after a restart");
    drop(client);
    stop(d);
}

/// Bad requests get one line each, and a cancelled stream leaves the
/// chain as it was (what it had copied reads the same).
#[test]
fn a_stream_refuses_bad_input_and_a_cancel_leaves_the_chain() {
    let dir = test_dir();
    let c = chain(dir.path(), "qcow2", SIZE);
    let Dirs {
        api,
        snaps,
        backups,
    } = dirs(dir.path());
    let args = args_of(&api, &snaps, Some(&backups));
    let d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    four_layers(dir.path(), &c, &mut client, &api);
    let before = status_chain(&api);
    refused(&api, &["job", "status"], "no job has run");
    refused(&api, &["job", "cancel"], "no job has run");
    // A speed of 0 is refused by the command line before the daemon,
    // which refuses it too (for a client of the API).
    let out = ctl(&api, &["stream", "--speed", "0"]);
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("'0' is not a usable size"));
    refused(
        &api,
        &["stream", "--base", "/nowhere.qcow2"],
        "not in the chain",
    );
    refused(&api, &["stream", "--base", &before[0]], "that is the top");
    // A backup reads the chain: no stream under it.
    let out = ctl(&api, &["backup", "start", "--nbd", "b.sock"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    refused(&api, &["stream"], "a backup is running");
    let out = ctl(&api, &["backup", "stop"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    ok(&ctl(&api, &["stream", "--speed", "1M"]), "stream");
    refused(
        &api,
        &["backup", "start", "--nbd", "b.sock"],
        "a stream job is running",
    );
    std::thread::sleep(Duration::from_millis(300));
    let job = ok(&ctl(&api, &["job", "cancel"]), "job cancel");
    assert_eq!(job["state"], "cancelled", "{job}");
    assert!(job["done"].as_u64().unwrap() < SIZE, "{job}");
    assert_eq!(status_chain(&api), before);
    reads_as_reference(&mut client, &c, "after a cancel");
    write_round(&mut client, &c, 70, 4);
    reads_as_reference(&mut client, &c, "writes after a cancel");
    // SIGTERM in the middle of a stream: the daemon stops cleanly (the
    // job cancelled, its stretch committed), and a restart finds the
    // chain as it was and no job cut short.
    ok(&ctl(&api, &["stream", "--speed", "1M"]), "stream");
    std::thread::sleep(Duration::from_millis(200));
    drop(client);
    stop(d);
    let s2 = snaps.join("s2.qcow2");
    assert_eq!(qemu_chain(&s2), before);
    check_clean(&s2);
    compare_identical(&s2, &c.reference);
    let d = serve(&c, dir.path(), &args);
    refused(&api, &["job", "status"], "no job has run");
    assert_eq!(status_chain(&api), before);
    stop(d);

    // A raw image has no chain to stream.
    let raw = dir.path().join("plain.raw");
    std::fs::write(&raw, vec![0u8; MIB as usize]).unwrap();
    let api2 = dir.path().join("api2.sock");
    let d = ringblk_testkit::Daemon::start_in(
        dir.path(),
        ringblk_testkit::DaemonOptions {
            image: Some(raw),
            args: &["--api", api2.to_str().unwrap()],
            ..Default::default()
        },
    );
    refused(&api2, &["stream"], "needs an image with a backing chain");
    stop(d);
}

/// kill -9 at points through a stream (while it copies, and right after
/// it switched), then the same command line: the chain is the old one or
/// the new one, it reads as the guest wrote it, and qemu-img finds every
/// file of it clean.
#[test]
fn a_kill_9_during_a_stream_leaves_a_chain_that_serves() {
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let Dirs { api, snaps, .. } = dirs(dir.path());
    let args = args_of(&api, &snaps, None);
    let mut d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    four_layers(dir.path(), &c, &mut client, &api);
    let old = status_chain(&api);
    let s2 = snaps.join("s2.qcow2");
    let mut switched = false;
    for (round, wait_ms) in [150u64, 600, 0].into_iter().enumerate() {
        let speed = if wait_ms == 0 { "1G" } else { "4M" };
        ok(
            &ctl(&api, &["stream", "--base", &old[3], "--speed", speed]),
            "stream",
        );
        write_round(&mut client, &c, 100 + round as u64 * 10, 3);
        if wait_ms == 0 {
            let job = wait_job(&api);
            assert_eq!(job["state"], "completed", "{job}");
        } else {
            std::thread::sleep(Duration::from_millis(wait_ms));
        }
        drop(client);
        let st = d.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
        assert!(!st.success());
        unlocked(&s2);
        let chain = qemu_chain(&s2);
        assert!(
            chain == old || chain == [old[0].clone(), old[3].clone()],
            "round {round}: the chain on disk is {chain:?}"
        );
        switched = chain.len() == 2;
        eprintln!("round {round}: killed {wait_ms} ms into the stream; switched: {switched}");
        check_clean(&s2);
        compare_identical(&s2, &c.reference);
        // The killed daemon's fixture goes first: it removes its socket,
        // which the next one reuses.
        drop(d);
        d = serve(&c, dir.path(), &args);
        client = Client::connect(&d.socket, 2 * MIB as usize);
        assert_eq!(qemu_chain(&s2), status_chain(&api));
        // The job record says what became of the job.
        let job = ctl(&api, &["job", "status"]);
        if switched {
            // Completed before the kill (its record gone), or switched
            // just before it.
            let text = String::from_utf8_lossy(&job.stdout);
            assert!(
                !job.status.success() || text.contains("\"completed\""),
                "round {round}: {text}"
            );
        } else {
            let job = ok(&job, "job status after a restart");
            assert_eq!(job["state"], "interrupted", "round {round}: {job}");
            assert!(job["error"].as_str().unwrap().contains("start it again"));
        }
        reads_as_reference(&mut client, &c, "after a kill -9 during a stream");
        if switched {
            break;
        }
    }
    assert!(switched, "no round got to the switch");
    drop(client);
    stop(d);
    check_clean(&s2);
}

/// A dirty bitmap across a stream: the bits the guest's writes set before,
/// during and after it are all there (the copy itself sets none, since it
/// changes nothing the guest reads), an incremental backup after it
/// exports exactly those ranges, a full one reads as the guest wrote, and
/// once the backup is done the bits leave the bitmap in the image.
#[test]
fn a_bitmap_follows_the_guest_across_a_stream() {
    use ringblk_testkit::nbd;
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let Dirs {
        api,
        snaps,
        backups,
    } = dirs(dir.path());
    let args = args_of(&api, &snaps, Some(&backups));
    let d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    four_layers(dir.path(), &c, &mut client, &api);
    ok_text(&ctl(&api, &["bitmap", "add", "b"]), "bitmap add");
    let k64 = 64 * 1024;
    let write = |client: &mut Client, seed: u64, offset: u64| {
        let data = c.write(seed, offset, k64 as usize);
        assert_eq!(client.write(offset, &data), 0);
    };
    write(&mut client, 1, MIB);
    ok(&ctl(&api, &["stream", "--speed", "8M"]), "stream");
    write(&mut client, 2, 3 * MIB);
    let job = wait_job(&api);
    assert_eq!(job["state"], "completed", "{job}");
    write(&mut client, 3, 5 * MIB);
    assert_eq!(client.flush(), 0);

    let sock = nbd::backup_start(&api, &backups, "b.sock", Some("b"));
    assert_eq!(
        nbd::dirty(&sock, "b"),
        [(MIB, k64), (3 * MIB, k64), (5 * MIB, k64)]
    );
    let full = dir.path().join("full.raw");
    nbd::copy_full(&sock, &full);
    assert!(
        std::fs::read(&full).unwrap() == std::fs::read(&c.reference).unwrap(),
        "the full backup after a stream differs from what the guest wrote"
    );
    ok_text(&ctl(&api, &["backup", "stop"]), "backup stop");
    drop(client);
    stop(d);
    let s2 = dir.path().join("snaps/s2.qcow2");
    assert_eq!(qemu_chain(&s2), [canonical(&s2)]);
    assert_eq!(nbd::qemu_nbd_dirty(&s2, "b"), []);
    check_clean(&s2);
}

fn ok_text(out: &std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A stream over a base of compressed clusters (`qemu-img convert -c`):
/// the top, standing alone after it, reads as the base and the guest's
/// writes did, and checks clean.
#[test]
fn a_stream_decompresses_what_it_copies() {
    let dir = test_dir();
    let c = chain(dir.path(), "compressed", SIZE);
    let Dirs { api, snaps, .. } = dirs(dir.path());
    let d = serve(&c, dir.path(), &args_of(&api, &snaps, None));
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    write_round(&mut client, &c, 5, 8);
    ok(&ctl(&api, &["stream"]), "stream");
    let job = wait_job(&api);
    assert_eq!(job["state"], "completed", "{job}");
    assert_eq!(status_chain(&api), [canonical(&c.top)]);
    reads_as_reference(&mut client, &c, "after streaming a compressed base");
    drop(client);
    stop(d);
    assert_eq!(qemu_chain(&c.top), [canonical(&c.top)]);
    check_clean(&c.top);
    compare_identical(&c.top, &c.reference);
}

/// Five layers: base.raw, top.qcow2 (the named image), and s1, s2, s3
/// made by live snapshots, each with writes of its own.
fn five_layers(dir: &Path, c: &Chain, client: &mut Client, api: &Path) -> Vec<String> {
    four_layers(dir, c, client, api);
    snapshot(api, "s3.qcow2");
    write_round(client, c, 60, 5);
    let chain = status_chain(api);
    assert_eq!(chain[0], canonical(&dir.join("snaps/s3.qcow2")));
    chain
}

/// A commit of the layer right below the top into its backing file while
/// the guest writes: the guest reads what it wrote throughout, the layer
/// drops out of the chain (listed as unused, unchanged), qemu-img sees the
/// new chain clean and reading as the guest wrote, and a restart follows
/// the records to it. What a commit cannot do yet, or must not, is refused
/// in one line.
#[test]
fn a_commit_under_writes_drops_the_layer_and_loses_nothing() {
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let Dirs { api, snaps, .. } = dirs(dir.path());
    let args = args_of(&api, &snaps, None);
    let d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    let chain = five_layers(dir.path(), &c, &mut client, &api);
    let (s3, s2, s1) = (&chain[0], &chain[1], &chain[2]);
    refused(
        &api,
        &["commit", "--top", &chain[3]],
        "may write only the image --image names",
    );
    refused(
        &api,
        &["commit", "--top", s2, "--base", s3],
        "a commit's base is below its top",
    );
    refused(
        &api,
        &["commit", "--top", s2, "--base", &chain[4]],
        "may write only the image --image names",
    );
    let sums = [sha256(Path::new(s2)), sha256(&c.top), sha256(&c.base)];

    let job = ok(
        &ctl(&api, &["commit", "--top", s2, "--speed", "2M"]),
        "commit",
    );
    assert_eq!(job["kind"], "commit");
    assert_eq!(job["base"], serde_json::json!(s1));
    refused(&api, &["stream"], "a commit job is running already");
    let mut rounds = 0;
    while ok(&ctl(&api, &["job", "status"]), "job status")["state"] == "running" {
        write_round(&mut client, &c, 80 + rounds, 3);
        rounds += 1;
    }
    let job = wait_job(&api);
    assert_eq!(job["state"], "completed", "{job}");
    assert!(
        rounds > 0,
        "the commit ended before the guest wrote during it"
    );
    assert!(job["copied"].as_u64().unwrap() > 0, "{job}");
    let new_chain = [s3.clone(), s1.clone(), chain[3].clone(), chain[4].clone()];
    assert_eq!(status_chain(&api), new_chain);
    assert_eq!(job["unused"], serde_json::json!([s2]));
    reads_as_reference(&mut client, &c, "after the commit");
    write_round(&mut client, &c, 95, 4);
    reads_as_reference(&mut client, &c, "writes after the commit");
    drop(client);
    stop(d);
    let s3p = Path::new(s3);
    assert_eq!(qemu_chain(s3p), new_chain);
    for layer in [s3, s1] {
        check_clean(Path::new(layer));
    }
    compare_identical(s3p, &c.reference);
    assert_eq!(
        [sha256(Path::new(s2)), sha256(&c.top), sha256(&c.base)],
        sums,
        "a layer other than the base was written"
    );
    let d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    assert_eq!(status_chain(&api), new_chain);
    reads_as_reference(&mut client, &c, "after a restart");
    // After the restart the image --image names is below the top (the
    // records led past it): a commit into it, of the layer above it.
    ok(
        &ctl(&api, &["commit", "--top", s1]),
        "commit into the named image",
    );
    write_round(&mut client, &c, 97, 3);
    let job = wait_job(&api);
    assert_eq!(job["state"], "completed", "{job}");
    assert_eq!(job["base"], serde_json::json!(chain[3]));
    let last_chain = [s3.clone(), chain[3].clone(), chain[4].clone()];
    assert_eq!(status_chain(&api), last_chain);
    reads_as_reference(&mut client, &c, "after a commit into the named image");
    drop(client);
    stop(d);
    assert_eq!(qemu_chain(s3p), last_chain);
    check_clean(&c.top);
    compare_identical(s3p, &c.reference);
    assert_eq!(sha256(&c.base), sums[2], "the raw base was written");
}

/// kill -9 in the middle of a commit: the chain on disk is the old one,
/// it serves after a restart (which says the job was cut short) and reads
/// as the guest wrote; the base, with part of the copy in it, and the
/// rest of the chain check clean; the commit started again completes.
#[test]
fn a_kill_9_during_a_commit_leaves_the_chain_as_it_was() {
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let Dirs { api, snaps, .. } = dirs(dir.path());
    let args = args_of(&api, &snaps, None);
    let mut d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    let chain = five_layers(dir.path(), &c, &mut client, &api);
    ok(
        &ctl(&api, &["commit", "--top", &chain[1], "--speed", "1M"]),
        "commit",
    );
    std::thread::sleep(Duration::from_millis(300));
    drop(client);
    let st = d.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    assert!(!st.success());
    let s3 = Path::new(&chain[0]);
    unlocked(s3);
    assert_eq!(qemu_chain(s3), chain);
    for layer in &chain[..3] {
        check_clean(Path::new(layer));
    }
    compare_identical(s3, &c.reference);
    drop(d);
    let d = serve(&c, dir.path(), &args);
    let job = ok(&ctl(&api, &["job", "status"]), "job status");
    assert_eq!(job["state"], "interrupted", "{job}");
    assert_eq!(job["kind"], "commit");
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    reads_as_reference(&mut client, &c, "after a kill -9 during a commit");
    ok(&ctl(&api, &["commit", "--top", &chain[1]]), "commit again");
    let job = wait_job(&api);
    assert_eq!(job["state"], "completed", "{job}");
    reads_as_reference(&mut client, &c, "after the commit completed");
    drop(client);
    stop(d);
    check_clean(s3);
    compare_identical(s3, &c.reference);
}

/// A migration starting (the front-end acks dirty logging, as QEMU does
/// at the start of one) cancels a running stream, and a running active
/// commit (which stops tracking the guest's writes), each of which lets
/// the image go for the destination; the chain stays as it was and reads
/// as written.
#[test]
fn a_migration_cancels_a_running_job() {
    use ringblk_testkit::frontend::{Conn, F_LOG_ALL, P_LOG_SHMFD};
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let Dirs { api, snaps, .. } = dirs(dir.path());
    let args = args_of(&api, &snaps, None);
    let d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    let chain = five_layers(dir.path(), &c, &mut client, &api);
    drop(client);
    let jobs: [(Vec<&str>, &str); 2] = [
        (vec!["stream", "--speed", "1M"], "stream"),
        (
            vec!["commit", "--top", &chain[0], "--speed", "128K"],
            "commit",
        ),
    ];
    for (start, kind) in jobs {
        ok(&ctl(&api, &start), kind);
        let conn = Conn::connect(&d.socket);
        conn.handshake_with(F_LOG_ALL, P_LOG_SHMFD);
        let job = wait_job(&api);
        assert_eq!(job["state"], "cancelled", "{job}");
        assert_eq!(status_chain(&api), chain);
        assert!(
            d.log()
                .contains(&format!("a migration started: the {kind} job is cancelled"))
        );
        // And none starts while the migration is under way.
        refused(&api, &["stream"], "a migration is under way");
        drop(conn);
        let mut client = Client::connect(&d.socket, 2 * MIB as usize);
        reads_as_reference(
            &mut client,
            &c,
            &format!("after a migration cancelled a {kind}"),
        );
    }
    stop(d);
}

/// An active commit (`commit --top` naming the active layer) while the
/// guest writes: the top's data and the guest's writes during the job go
/// down into the base, which becomes the top at the pivot; the old top is
/// listed unused and written no more after it; qemu-img finds the new
/// chain clean and reading as the guest wrote; a restart with the same
/// command line serves the base (the pivot removed the snapshot record
/// that led past it). Then a second one, two layers deep, into the image
/// `--image` names, which a restart then serves as it is.
#[test]
fn an_active_commit_under_writes_pivots_and_loses_nothing() {
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let Dirs { api, snaps, .. } = dirs(dir.path());
    let args = args_of(&api, &snaps, None);
    let d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    let chain = five_layers(dir.path(), &c, &mut client, &api);
    let (s3, s2) = (&chain[0], &chain[1]);
    refused(
        &api,
        &["commit", "--top", s3, "--base", &chain[4]],
        "may write only the image --image names",
    );
    let job = ok(
        &ctl(&api, &["commit", "--top", s3, "--speed", "512K"]),
        "active commit",
    );
    assert_eq!(job["kind"], "commit");
    assert_eq!(job["active"], true, "{job}");
    assert_eq!(job["base"], serde_json::json!(s2));
    refused(&api, &["stream"], "a commit job is running already");
    refused(
        &api,
        &["snapshot", "--overlay", "s9.qcow2"],
        "a commit job is running",
    );
    refused(&api, &["resize", "64M"], "a commit job is running");
    let mut rounds = 0;
    while ok(&ctl(&api, &["job", "status"]), "job status")["state"] == "running" {
        write_round(&mut client, &c, 110 + rounds, 4);
        rounds += 1;
    }
    let job = wait_job(&api);
    assert_eq!(job["state"], "completed", "{job}");
    assert!(
        rounds > 0,
        "the commit ended before the guest wrote during it"
    );
    assert!(job["copied"].as_u64().unwrap() > 0, "{job}");
    let new_chain: Vec<String> = chain[1..].to_vec();
    assert_eq!(status_chain(&api), new_chain);
    assert_eq!(job["unused"], serde_json::json!([s3]));
    reads_as_reference(&mut client, &c, "after the pivot");
    let s3_sum = sha256(Path::new(s3));
    write_round(&mut client, &c, 130, 6);
    reads_as_reference(&mut client, &c, "writes after the pivot");
    assert_eq!(
        sha256(Path::new(s3)),
        s3_sum,
        "the old top was written after the pivot"
    );
    drop(client);
    stop(d);
    let s2p = Path::new(s2);
    assert_eq!(qemu_chain(s2p), new_chain);
    check_clean(s2p);
    compare_identical(s2p, &c.reference);
    let d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    assert_eq!(status_chain(&api), new_chain);
    reads_as_reference(&mut client, &c, "after a restart");

    // Two layers deep, into the named image (below s1 and s2 now).
    let named = chain[3].clone();
    ok(
        &ctl(&api, &["commit", "--top", s2, "--base", &named]),
        "active commit into the named image",
    );
    write_round(&mut client, &c, 140, 3);
    let job = wait_job(&api);
    assert_eq!(job["state"], "completed", "{job}");
    let last_chain = [named.clone(), chain[4].clone()];
    assert_eq!(status_chain(&api), last_chain);
    assert_eq!(job["unused"], serde_json::json!([s2, &chain[2]]));
    reads_as_reference(&mut client, &c, "after the pivot to the named image");
    write_round(&mut client, &c, 150, 3);
    drop(client);
    stop(d);
    assert_eq!(qemu_chain(&c.top), last_chain);
    check_clean(&c.top);
    compare_identical(&c.top, &c.reference);
    let d = serve(&c, dir.path(), &args);
    assert_eq!(status_chain(&api), last_chain);
    assert!(
        !d.log().contains("was superseded by live snapshot"),
        "a restart followed a record past the named image"
    );
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    reads_as_reference(&mut client, &c, "after a restart on the named image");
    drop(client);
    stop(d);
}

/// What an active commit refuses, and a cancel before its pivot: the
/// chain is as it was and reads as the guest wrote, the base's copy is
/// hidden under the top (qemu-img finds every file clean).
#[test]
fn an_active_commit_refuses_what_a_restart_could_not_follow_and_a_cancel_leaves_the_chain() {
    let dir = test_dir();
    let c = chain(dir.path(), "qcow2", SIZE);
    let Dirs { api, snaps, .. } = dirs(dir.path());
    let args = args_of(&api, &snaps, None);
    let d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    write_round(&mut client, &c, 10, 8);
    // The top is the named image, over a base qemu-img made, which the
    // daemon does not write.
    refused(
        &api,
        &["commit", "--top", c.top.to_str().unwrap()],
        "may write only the image --image names",
    );
    snapshot(&api, "s1.qcow2");
    write_round(&mut client, &c, 20, 8);
    snapshot(&api, "s2.qcow2");
    write_round(&mut client, &c, 25, 4);
    // A stream dropped s1, the overlay whose record led past the named
    // image: no record would make a restart serve the named image.
    let named = canonical(&c.top);
    ok(&ctl(&api, &["stream", "--base", &named]), "stream");
    assert_eq!(wait_job(&api)["state"], "completed");
    let before = status_chain(&api);
    assert_eq!(before[1], named);
    refused(
        &api,
        &["commit", "--top", &before[0]],
        "no record of a layer above it",
    );
    snapshot(&api, "s3.qcow2");
    write_round(&mut client, &c, 27, 4);
    let before = status_chain(&api);
    ok(
        &ctl(&api, &["commit", "--top", &before[0], "--speed", "64K"]),
        "active commit",
    );
    write_round(&mut client, &c, 30, 3);
    std::thread::sleep(Duration::from_millis(300));
    let job = ok(&ctl(&api, &["job", "cancel"]), "job cancel");
    assert_eq!(job["state"], "cancelled", "{job}");
    assert_eq!(status_chain(&api), before);
    reads_as_reference(&mut client, &c, "after a cancelled active commit");
    write_round(&mut client, &c, 40, 4);
    reads_as_reference(&mut client, &c, "writes after a cancel");
    drop(client);
    stop(d);
    let s3 = snaps.join("s3.qcow2");
    assert_eq!(qemu_chain(&s3), before);
    check_clean(&s3);
    check_clean(&snaps.join("s2.qcow2"));
    compare_identical(&s3, &c.reference);
}

/// kill -9 during an active commit, before its pivot and after it: the
/// chain on disk is the old one (the base's copy hidden under the top) or
/// the new one, a restart with the same command line serves it and reads
/// as the guest wrote, qemu-img finds it clean, and `job status` says
/// what became of the job.
#[test]
fn a_kill_9_during_an_active_commit_leaves_a_chain_that_serves() {
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let Dirs { api, snaps, .. } = dirs(dir.path());
    let args = args_of(&api, &snaps, None);
    let mut d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    let chain = five_layers(dir.path(), &c, &mut client, &api);
    let (s3, s2) = (Path::new(&chain[0]), Path::new(&chain[1]));
    ok(
        &ctl(&api, &["commit", "--top", &chain[0], "--speed", "128K"]),
        "active commit",
    );
    write_round(&mut client, &c, 120, 3);
    std::thread::sleep(Duration::from_millis(300));
    drop(client);
    let st = d.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    assert!(!st.success());
    unlocked(s3);
    assert_eq!(qemu_chain(s3), chain);
    check_clean(s3);
    check_clean(s2);
    compare_identical(s3, &c.reference);
    drop(d);
    d = serve(&c, dir.path(), &args);
    assert_eq!(status_chain(&api), chain);
    let job = ok(&ctl(&api, &["job", "status"]), "job status");
    assert_eq!(job["state"], "interrupted", "{job}");
    assert_eq!(job["active"], true, "{job}");
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    reads_as_reference(&mut client, &c, "after a kill -9 before the pivot");
    // Again, to its end, and a kill -9 right after the pivot.
    ok(
        &ctl(&api, &["commit", "--top", &chain[0]]),
        "active commit again",
    );
    write_round(&mut client, &c, 125, 3);
    let job = wait_job(&api);
    assert_eq!(job["state"], "completed", "{job}");
    write_round(&mut client, &c, 128, 3);
    drop(client);
    let st = d.signal_and_wait(libc::SIGKILL, Duration::from_secs(10));
    assert!(!st.success());
    unlocked(s2);
    let new_chain: Vec<String> = chain[1..].to_vec();
    assert_eq!(qemu_chain(s2), new_chain);
    check_clean(s2);
    compare_identical(s2, &c.reference);
    drop(d);
    let d = serve(&c, dir.path(), &args);
    assert_eq!(status_chain(&api), new_chain);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    reads_as_reference(&mut client, &c, "after a kill -9 after the pivot");
    drop(client);
    stop(d);
}

/// A dirty bitmap across an active commit into a base that has the
/// bitmap too (a live snapshot left it there, frozen): the bits the
/// guest's writes set before, during and after the job are in the bitmap
/// the pivot moved into the base, an incremental backup exports exactly
/// them, and once it is done the bits leave the bitmap in the base.
#[test]
fn a_bitmap_follows_the_guest_across_an_active_commit() {
    use ringblk_testkit::nbd;
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let Dirs {
        api,
        snaps,
        backups,
    } = dirs(dir.path());
    let args = args_of(&api, &snaps, Some(&backups));
    let d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    ok_text(&ctl(&api, &["bitmap", "add", "b"]), "bitmap add");
    four_layers(dir.path(), &c, &mut client, &api);
    let s1 = snaps.join("s1.qcow2");
    assert!(
        qemu_img(&["info", "-U", s1.to_str().unwrap()]).contains("name: b"),
        "the snapshot left no bitmap in the layer below the top"
    );
    // Everything so far backed up: the bitmap starts empty.
    let sock = nbd::backup_start(&api, &backups, "b.sock", Some("b"));
    drop(sock);
    ok_text(&ctl(&api, &["backup", "stop"]), "backup stop");
    let k64 = 64 * 1024;
    let write = |client: &mut Client, seed: u64, offset: u64| {
        let data = c.write(seed, offset, k64 as usize);
        assert_eq!(client.write(offset, &data), 0);
    };
    write(&mut client, 1, MIB);
    let s2 = status_chain(&api)[0].clone();
    ok(
        &ctl(&api, &["commit", "--top", &s2, "--speed", "256K"]),
        "active commit",
    );
    write(&mut client, 2, 3 * MIB);
    let job = wait_job(&api);
    assert_eq!(job["state"], "completed", "{job}");
    assert_eq!(status_chain(&api)[0], canonical(&s1));
    write(&mut client, 3, 5 * MIB);
    assert_eq!(client.flush(), 0);

    let sock = nbd::backup_start(&api, &backups, "b.sock", Some("b"));
    assert_eq!(
        nbd::dirty(&sock, "b"),
        [(MIB, k64), (3 * MIB, k64), (5 * MIB, k64)]
    );
    let full = dir.path().join("full.raw");
    nbd::copy_full(&sock, &full);
    assert!(
        std::fs::read(&full).unwrap() == std::fs::read(&c.reference).unwrap(),
        "the full backup after an active commit differs from what the guest wrote"
    );
    ok_text(&ctl(&api, &["backup", "stop"]), "backup stop");
    drop(client);
    stop(d);
    assert_eq!(nbd::qemu_nbd_dirty(&s1, "b"), []);
    check_clean(&s1);
    compare_identical(&s1, &c.reference);
}

/// A commit of a layer deeper than the one below the top, while the
/// guest writes: the layer above it (read-only in the chain) is pointed at
/// the base, the committed layer drops out, the guest reads what it wrote
/// throughout, qemu-img finds the new chain clean and reading so, and a
/// restart with the same command line follows the records to it (the
/// dropped layer recorded as such).
#[test]
fn a_commit_of_a_deeper_layer_drops_it_and_loses_nothing() {
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let Dirs { api, snaps, .. } = dirs(dir.path());
    let args = args_of(&api, &snaps, None);
    let d = serve(&c, dir.path(), &args);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    let chain = five_layers(dir.path(), &c, &mut client, &api);
    let (s3, s2, s1, named) = (&chain[0], &chain[1], &chain[2], &chain[3]);
    let sums = [sha256(Path::new(s1)), sha256(&c.base)];
    let job = ok(
        &ctl(&api, &["commit", "--top", s1, "--speed", "1M"]),
        "commit of a deeper layer",
    );
    assert_eq!(job["base"], serde_json::json!(named));
    let mut rounds = 0;
    while ok(&ctl(&api, &["job", "status"]), "job status")["state"] == "running" {
        write_round(&mut client, &c, 160 + rounds, 3);
        rounds += 1;
    }
    let job = wait_job(&api);
    assert_eq!(job["state"], "completed", "{job}");
    assert!(
        rounds > 0,
        "the commit ended before the guest wrote during it"
    );
    let new_chain = [s3.clone(), s2.clone(), named.clone(), chain[4].clone()];
    assert_eq!(status_chain(&api), new_chain);
    assert_eq!(job["unused"], serde_json::json!([s1]));
    reads_as_reference(&mut client, &c, "after a deeper commit");
    write_round(&mut client, &c, 180, 4);
    reads_as_reference(&mut client, &c, "writes after a deeper commit");
    drop(client);
    stop(d);
    let s3p = Path::new(s3);
    assert_eq!(qemu_chain(s3p), new_chain);
    for layer in [s3, s2, named] {
        check_clean(Path::new(layer));
    }
    compare_identical(s3p, &c.reference);
    assert_eq!(
        [sha256(Path::new(s1)), sha256(&c.base)],
        sums,
        "a layer other than the base and the one above the committed one was written"
    );
    let d = serve(&c, dir.path(), &args);
    assert_eq!(status_chain(&api), new_chain);
    let mut client = Client::connect(&d.socket, 2 * MIB as usize);
    reads_as_reference(&mut client, &c, "after a restart");
    drop(client);
    stop(d);
}

/// An active commit on 64 queues (the most a device has), the guest
/// writing on all of them
/// faster than one pass copies: more than the pivot's threshold changes
/// during the job, so its dirty bitmap is swapped and copied again at
/// least once (`passes`), and what the guest
/// wrote on every queue is in the base after the pivot.
#[test]
fn an_active_commit_on_64_queues_follows_writes_on_all_of_them() {
    use ringblk_testkit::Op;
    let dir = test_dir();
    let c = chain(dir.path(), "raw", SIZE);
    let Dirs { api, snaps, .. } = dirs(dir.path());
    let mut args = args_of(&api, &snaps, None);
    args.extend(["--queues", "64"]);
    let d = serve(&c, dir.path(), &args);
    let buf = 4 * MIB as usize;
    let mut client = Client::connect_queues(&d.socket, buf, 64);
    snapshot(&api, "s1.qcow2");
    let k64 = 64 * 1024usize;
    // `n` 64 KiB writes of pattern `seed`, 256 KiB apart from `first` on
    // (wrapping), 64 at a time, one on each queue.
    let write_spread = |client: &mut Client, seed: u64, first: u64, n: u64| {
        for batch in 0..n.div_ceil(64) {
            let mut ops = Vec::new();
            for i in batch * 64..((batch + 1) * 64).min(n) {
                let offset = (first + i * 256 * 1024) % (SIZE - k64 as u64);
                let offset = offset & !(k64 as u64 - 1);
                let data = c.write(seed + i, offset, k64);
                let buf_off = (i - batch * 64) as usize * k64;
                client.buf()[buf_off..buf_off + k64].copy_from_slice(&data);
                ops.push((
                    (i % 64) as usize,
                    Op::Write {
                        offset,
                        buf_off,
                        len: k64,
                    },
                ));
            }
            assert!(client.batch_queues(&ops).iter().all(|&r| r == 0));
        }
        assert_eq!(client.flush(), 0);
    };
    // 8 MiB in the top before the job.
    write_spread(&mut client, 1000, 0, 128);
    let top = status_chain(&api)[0].clone();
    let job = ok(
        &ctl(&api, &["commit", "--top", &top, "--speed", "4M"]),
        "active commit",
    );
    assert_eq!(job["active"], true, "{job}");
    let metrics = ctl(&api, &["stats", "--prometheus"]);
    let text = String::from_utf8_lossy(&metrics.stdout);
    assert!(
        text.contains("ringblk_job_remaining_bytes{kind=\"commit\"}"),
        "{text}"
    );
    // More than the pivot's threshold (8 MiB) while the first pass runs:
    // 12 MiB over other clusters and those it copies.
    for round in 0..3u64 {
        write_spread(&mut client, 2000 + round * 100, round * 64 * 1024, 64);
    }
    let job = wait_job(&api);
    assert_eq!(job["state"], "completed", "{job}");
    assert!(
        job["passes"].as_u64().unwrap() >= 1,
        "no pass over the guest's writes during the first copy: {job}"
    );
    assert_eq!(status_chain(&api), [canonical(&c.top), canonical(&c.base)]);
    reads_as_reference(&mut client, &c, "after the pivot");
    write_spread(&mut client, 3000, 3 * 64 * 1024, 32);
    reads_as_reference(&mut client, &c, "writes on 64 queues after the pivot");
    drop(client);
    stop(d);
    check_clean(&c.top);
    compare_identical(&c.top, &c.reference);
}
