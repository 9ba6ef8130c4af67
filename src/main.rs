use clap::Parser;
use ringblk::cli::{Cli, Command};

fn main() {
    env_logger::Builder::from_env(
        env_logger::Env::default().default_filter_or("info,virtio_queue=off"),
    )
    .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => ringblk::daemon::serve(*args).map_err(|e| e.to_string()),
        Command::Stats(args) => ringblk::metrics::stats(&args),
        Command::Ctl(args) => ringblk::api::ctl::ctl(&args),
        Command::Bench(args) => ringblk::bench::exec(&args),
    };
    if let Err(e) = result {
        eprintln!("ringblk: {e}");
        std::process::exit(1);
    }
}
