use clap::{CommandFactory, Parser};
use ringblk::cli::{Cli, Command};
use ringblk::exit::Failure;

fn main() {
    ringblk::logging::init();
    // `ringblk help bench` is ringblk-bench's own help, as `ringblk bench
    // --help` is: clap's would only describe the pass-through.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.len() == 3 && argv[1] == "help" && argv[2] == "bench" {
        let help = ringblk::bench::BenchArgs {
            args: vec!["--help".into()],
        };
        finish(
            "bench",
            ringblk::bench::exec(&help).map_err(Failure::Runtime),
        );
    }
    // Usage errors clap finds exit with 2, --help and --version with 0.
    let cli = Cli::parse();
    let (name, result) = match cli.command {
        Command::Serve(args) => (
            "serve",
            ringblk::daemon::serve(*args).map_err(Failure::from),
        ),
        Command::Stats(args) => ("stats", ringblk::metrics::stats(&args)),
        Command::Ctl(args) => ("ctl", ringblk::api::ctl::ctl(&args)),
        Command::Bench(args) => (
            "bench",
            ringblk::bench::exec(&args).map_err(Failure::Runtime),
        ),
        Command::Generate(args) => ("generate", ringblk::generate::run(&args)),
    };
    finish(name, result);
}

/// Exits with `result`'s status (see `ringblk::exit`): a usage error the
/// way clap prints its own, against the subcommand's usage line.
fn finish(subcommand: &str, result: Result<(), Failure>) -> ! {
    match result {
        Ok(()) | Err(Failure::Closed) => std::process::exit(0),
        Err(Failure::Usage(message)) => {
            let mut cmd = Cli::command();
            cmd.build();
            let sub = cmd
                .find_subcommand_mut(subcommand)
                .expect("every subcommand is in the CLI");
            sub.error(clap::error::ErrorKind::ValueValidation, message)
                .exit()
        }
        Err(Failure::Runtime(message)) => {
            eprintln!("ringblk: {message}");
            std::process::exit(1)
        }
    }
}
