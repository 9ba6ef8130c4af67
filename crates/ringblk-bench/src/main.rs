use clap::Parser;

/// Load generator for any vhost-user-blk socket, and a side-by-side
/// comparison of ringblk with qemu-storage-daemon and the host's own
/// io_uring.
#[derive(Debug, Parser)]
#[command(name = "ringblk-bench", version)]
struct Cli {
    #[command(flatten)]
    args: ringblk_bench::BenchArgs,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = ringblk_bench::run(&cli.args) {
        eprintln!("ringblk-bench: {e}");
        std::process::exit(1);
    }
}
