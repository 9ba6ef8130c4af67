//! The daemon: configuration, socket, signals and the serve loop.

use crate::cli::ServeArgs;

/// Runs `ringblk serve`.
pub fn serve(_args: ServeArgs) -> Result<(), String> {
    Err("serve: not implemented yet".into())
}
