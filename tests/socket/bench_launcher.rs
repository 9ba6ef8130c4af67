//! `ringblk bench` runs `ringblk-bench`, a binary of its own; without one
//! it says in one line what to build. (The pass-through itself is tested
//! with the bench, in `crates/ringblk-bench/tests/bench_smoke.rs`.)

use std::process::Command;

#[test]
fn bench_without_ringblk_bench_says_what_to_build() {
    let dir = tempfile::tempdir_in(ringblk_testkit::tmp_dir()).expect("tempdir");
    // A daemon with no ringblk-bench beside it. A hard link keeps its path
    // (current_exe), in the same file system as target/.
    let exe = dir.path().join("ringblk");
    let daemon = ringblk_testkit::ringblk_bin();
    std::fs::hard_link(&daemon, &exe)
        .or_else(|_| std::fs::copy(&daemon, &exe).map(drop))
        .expect("placing the daemon alone");
    let out = Command::new(&exe)
        .args(["bench", "--help"])
        .env("PATH", dir.path())
        .output()
        .expect("running ringblk bench");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(
        err.trim_end(),
        format!(
            "ringblk: ringblk-bench not found next to {} or on PATH: install the ringblk package, or build it (cargo build --release -p ringblk-bench, or cargo install --locked --path crates/ringblk-bench)",
            exe.display()
        )
    );
}
