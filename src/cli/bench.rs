//! `ringblk bench`: runs `ringblk-bench`, the benchmark client. It is a
//! binary of its own (`crates/ringblk-bench`) so that the daemon does not
//! link libblkio, the histograms, the progress bar and the plotting.

use std::ffi::OsString;
use std::io;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

/// `ringblk bench` arguments: all of them, `--help` included, go to
/// `ringblk-bench` as they are.
#[derive(Clone, Debug, clap::Args)]
pub struct BenchArgs {
    /// Arguments of ringblk-bench (`ringblk bench --help` lists them).
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "ARGS"
    )]
    pub args: Vec<OsString>,
}

/// Replaces this process with `ringblk-bench ARGS`: the one next to this
/// executable (where `cargo build --workspace` puts it, and where the
/// Debian package installs both: /usr/bin), else the first on PATH. RINGBLK_BIN tells it to serve `--compare` runs with this daemon.
/// Returns only if that fails.
pub fn exec(args: &BenchArgs) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("finding this executable: {e}"))?;
    let beside = exe.with_file_name("ringblk-bench");
    let program = if beside.is_file() {
        beside
    } else {
        PathBuf::from("ringblk-bench")
    };
    let err = Command::new(&program)
        .args(&args.args)
        .env("RINGBLK_BIN", &exe)
        .exec();
    Err(if err.kind() == io::ErrorKind::NotFound {
        format!(
            "ringblk-bench not found next to {} or on PATH: install the ringblk package, or build it (cargo build --release -p ringblk-bench, or cargo install --locked --path crates/ringblk-bench)",
            exe.display()
        )
    } else {
        format!("running {}: {err}", program.display())
    })
}
