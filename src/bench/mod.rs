//! `ringblk bench`: a load generator on libblkio, and `--compare`.

/// `ringblk bench` arguments.
#[derive(Clone, Debug, clap::Args)]
pub struct BenchArgs {
    /// vhost-user-blk socket to drive.
    #[arg(long)]
    pub socket: Option<String>,
}

/// Runs the benchmark.
pub fn run(_args: &BenchArgs) -> Result<(), String> {
    Err("bench: not implemented yet".into())
}
