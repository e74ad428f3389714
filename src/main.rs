use std::process::ExitCode;

use clap::Parser;
use gpu_offload::cli::{Cli, dispatch};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    // A write past a file-size limit must fail with an error we report and clean up after,
    // not kill the process mid-write.
    // SAFETY: setting a signal's disposition to "ignore" at start-up, before any threads.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    let cli = Cli::parse();
    let filter = EnvFilter::try_new(&cli.log).unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    match dispatch(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line naming the problem, with its causes.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
