//! `--threads`' default under a cgroup CPU quota: a daemon in a cgroup
//! allowed one CPU's worth of time (as systemd's `CPUQuota=100%` or a
//! container's `--cpus 1` make) serves its queues on one thread, whatever
//! its affinity mask says, and serves I/O on every queue.
//!
//! Needs root and the cgroup `cpu` controller (v1's `cpu.cfs_quota_us`,
//! or v2's `cpu.max` in the root cgroup's subtree). Without them the test
//! skips, except under CI, where it fails.

use std::fs;
use std::path::{Path, PathBuf};

use ringblk_testkit::{
    Client, Daemon, DaemonOptions, MIB, Op, assert_pattern, is_root, pattern, skip,
};

/// A cgroup of our own with a quota of one CPU, removed on drop.
struct OneCpu {
    dir: PathBuf,
}

impl OneCpu {
    fn new() -> Result<OneCpu, String> {
        if !is_root() {
            return Err("making a cgroup needs root".into());
        }
        // cgroup v1's cpu hierarchy, else v2 with cpu enabled for the
        // root's children: where to make the cgroup, and its one-CPU quota.
        let v1_cpu = Path::new("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists();
        let v2_cpu = fs::read_to_string("/sys/fs/cgroup/cgroup.subtree_control")
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "cpu"));
        let (root, quota): (&str, &[(&str, &str)]) = if v1_cpu {
            (
                "/sys/fs/cgroup/cpu",
                &[
                    ("cpu.cfs_period_us", "100000"),
                    ("cpu.cfs_quota_us", "100000"),
                ],
            )
        } else if v2_cpu {
            ("/sys/fs/cgroup", &[("cpu.max", "100000 100000")])
        } else {
            return Err(
                "no cgroup cpu controller (v1 /sys/fs/cgroup/cpu, or cpu in v2's subtree_control)"
                    .into(),
            );
        };
        let dir = Path::new(root).join(format!("ringblk-test-{}", std::process::id()));
        fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let cg = OneCpu { dir };
        for (file, value) in quota {
            cg.write(file, value)?;
        }
        Ok(cg)
    }

    fn write(&self, file: &str, value: &str) -> Result<(), String> {
        let path = self.dir.join(file);
        fs::write(&path, value).map_err(|e| format!("{}: {e}", path.display()))
    }

    fn procs(&self) -> String {
        self.dir.join("cgroup.procs").display().to_string()
    }
}

impl Drop for OneCpu {
    fn drop(&mut self) {
        // The daemon is gone by now (its fixture is dropped first).
        let _ = fs::remove_dir(&self.dir);
    }
}

#[test]
fn a_one_cpu_quota_gets_one_thread_by_default() {
    let cg = match OneCpu::new() {
        Ok(cg) => cg,
        Err(why) => {
            skip(&why);
            return;
        }
    };
    let online = std::thread::available_parallelism().unwrap().get();
    assert!(
        online >= 2,
        "this test needs a machine with 2 CPUs or more to tell the quota from the mask"
    );
    // The shell puts itself in the cgroup, then becomes the daemon.
    let enter = format!("echo $$ > {} && exec \"$@\"", cg.procs());
    let mut d = Daemon::start_with(DaemonOptions {
        size: 16 * MIB,
        args: &["--queues", "2", "--seccomp", "enforce"],
        wrapper: &["sh", "-c", &enter, "sh"],
        ..DaemonOptions::default()
    });
    d.wait_for_log("2 queue(s) on 1 worker thread(s)");
    // A write and a read through each queue.
    let mut c = Client::connect_queues(&d.socket, 16 * 4096, 2);
    for q in 0..2usize {
        let data = pattern(q as u64, q as u64 * MIB, 4096);
        c.buf()[q * 4096..(q + 1) * 4096].copy_from_slice(&data);
    }
    let writes: Vec<(usize, Op)> = (0..2)
        .map(|q| {
            let (offset, buf_off, len) = (q as u64 * MIB, q * 4096, 4096);
            (
                q,
                Op::Write {
                    offset,
                    buf_off,
                    len,
                },
            )
        })
        .collect();
    assert_eq!(
        c.batch_queues(&writes),
        [0, 0],
        "writes through queues 0 and 1"
    );
    let reads: Vec<(usize, Op)> = (0..2)
        .map(|q| {
            let (offset, buf_off, len) = (q as u64 * MIB, (8 + q) * 4096, 4096);
            (
                q,
                Op::Read {
                    offset,
                    buf_off,
                    len,
                },
            )
        })
        .collect();
    assert_eq!(
        c.batch_queues(&reads),
        [0, 0],
        "reads through queues 0 and 1"
    );
    for q in 0..2usize {
        let got = c.buf()[(8 + q) * 4096..(9 + q) * 4096].to_vec();
        assert_pattern("read back", q as u64, q as u64 * MIB, &got);
        assert_pattern(
            "on the image",
            q as u64,
            q as u64 * MIB,
            &d.read_image(q as u64 * MIB, 4096),
        );
    }
    drop(c);
    d.assert_running();
    let cgroup = fs::read_to_string(format!("/proc/{}/cgroup", d.pid())).unwrap();
    assert!(
        cgroup.contains(cg.dir.file_name().unwrap().to_str().unwrap()),
        "the daemon is not in the test's cgroup:\n{cgroup}"
    );
}
