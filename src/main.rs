use clap::{CommandFactory, Parser};
use ringblk::cli::exit::Failure;
use ringblk::cli::{Cli, Command};

fn main() {
    ringblk::cli::logging::init();
    // `ringblk help bench` is ringblk-bench's own help, as `ringblk bench
    // --help` is: clap's would only describe the pass-through.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if argv.len() == 3 && argv[1] == "help" && argv[2] == "bench" {
        let help = ringblk::cli::bench::BenchArgs {
            args: vec!["--help".into()],
        };
        finish(
            "bench",
            ringblk::cli::bench::exec(&help).map_err(Failure::Runtime),
        );
    }
    // Usage errors clap finds exit with 2, --help and --version with 0.
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => usage(e),
    };
    let (name, result) = match cli.command {
        Command::Serve(args) => (
            "serve",
            ringblk::daemon::serve(*args).map_err(Failure::from),
        ),
        Command::Stats(args) => ("stats", ringblk::cli::stats::stats(&args)),
        Command::Ctl(args) => ("ctl", ringblk::cli::ctl::ctl(&args)),
        Command::Backup(args) => ("backup", ringblk::cli::backup::run(&args)),
        Command::Bench(args) => (
            "bench",
            ringblk::cli::bench::exec(&args).map_err(Failure::Runtime),
        ),
        Command::Generate(args) => ("generate", ringblk::cli::generate::run(&args)),
    };
    finish(name, result);
}

/// Exits with `result`'s status (see `ringblk::cli::exit`): a usage error the
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
            usage(sub.error(clap::error::ErrorKind::ValueValidation, message))
        }
        Err(Failure::Runtime(message)) => {
            eprintln!("{}ringblk: {message}", error_priority());
            std::process::exit(1)
        }
    }
}

/// Prints clap's error (or help) and exits as clap does; under the
/// journal, each line of an error carries its priority.
fn usage(e: clap::Error) -> ! {
    if !e.use_stderr() || !ringblk::cli::logging::under_journal() {
        e.exit()
    }
    for line in e.render().to_string().lines().filter(|l| !l.is_empty()) {
        eprintln!("{}{line}", error_priority());
    }
    std::process::exit(e.exit_code())
}

/// `<3>` (syslog's LOG_ERR) when stderr is the journal (`ringblk::cli::logging`).
fn error_priority() -> &'static str {
    if ringblk::cli::logging::under_journal() {
        "<3>"
    } else {
        ""
    }
}
