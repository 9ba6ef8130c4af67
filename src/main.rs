use clap::Parser;
use ringblk::cli::Cli;

fn main() {
    env_logger::Builder::from_env(
        env_logger::Env::default().default_filter_or("info,virtio_queue=off"),
    )
    .init();
    if let Err(e) = ringblk::cli::run(Cli::parse()) {
        eprintln!("ringblk: {e}");
        std::process::exit(1);
    }
}
