use clap::{CommandFactory, Parser};

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
    // `ringblk-bench --generate-man DIR`: writes DIR/ringblk-bench.1 from
    // these definitions (scripts/package.sh; never written by hand). Not
    // a flag of `Cli`, whose benchmark arguments it does not take.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.len() == 3 && argv[1] == "--generate-man" {
        let dir = std::path::Path::new(&argv[2]);
        if let Err(e) = clap_mangen::Man::new(Cli::command()).generate_to(dir) {
            eprintln!("ringblk-bench: {}: {e}", dir.display());
            std::process::exit(1);
        }
        return;
    }
    let cli = Cli::parse();
    if let Err(e) = ringblk_bench::run(&cli.args) {
        eprintln!("ringblk-bench: {e}");
        std::process::exit(1);
    }
}
