//! `ringblk generate --out DIR`: the man pages (clap_mangen) and shell
//! completions (clap_complete) made from the CLI's own definitions, so
//! they cannot drift from `--help`. `scripts/package.sh` runs it before
//! cargo-deb packs what it wrote; a `cargo install` user can run it too.

use std::path::{Path, PathBuf};

use clap::CommandFactory;
use clap_complete::Shell;

use super::exit::Failure;

#[derive(Clone, Debug, clap::Args)]
pub struct GenerateArgs {
    /// Directory to write into: man/ (ringblk.1, ringblk-serve.1, ...)
    /// and completions/ (ringblk.bash, _ringblk for zsh, ringblk.fish).
    /// Created if missing.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

/// The shells completions are written for, and each file's name.
pub const COMPLETIONS: [(Shell, &str); 3] = [
    (Shell::Bash, "ringblk.bash"),
    (Shell::Zsh, "_ringblk"),
    (Shell::Fish, "ringblk.fish"),
];

pub fn run(args: &GenerateArgs) -> Result<(), Failure> {
    let err = |path: &Path, e: std::io::Error| {
        Failure::Runtime(format!("generate: {}: {e}", path.display()))
    };
    let man = args.out.join("man");
    let completions = args.out.join("completions");
    for dir in [&man, &completions] {
        std::fs::create_dir_all(dir).map_err(|e| err(dir, e))?;
    }
    clap_mangen::generate_to(crate::cli::Cli::command(), &man).map_err(|e| err(&man, e))?;
    for (shell, name) in COMPLETIONS {
        let path = completions.join(name);
        let mut file = std::fs::File::create(&path).map_err(|e| err(&path, e))?;
        clap_complete::generate(shell, &mut crate::cli::Cli::command(), "ringblk", &mut file);
    }
    Ok(())
}
