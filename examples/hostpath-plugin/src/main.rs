//! The `hostpath-plugin` binary.

use std::process::ExitCode;

use hostpath_plugin::config::{self, Command, CSI_ENDPOINT_ENV, USAGE};
use hostpath_plugin::{server, PLUGIN_VERSION};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let command = config::parse_args(
        std::env::args_os().skip(1),
        std::env::var(CSI_ENDPOINT_ENV).ok(),
        config::hostname,
    );
    let config = match command {
        Ok(Command::Run(config)) => config,
        Ok(Command::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Command::Version) => {
            println!("hostpath-plugin {PLUGIN_VERSION}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("hostpath-plugin: {e}\nRun `hostpath-plugin --help` for usage.");
            return ExitCode::from(2);
        }
    };

    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("hostpath-plugin: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(server::serve(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "hostpath-plugin failed");
            ExitCode::FAILURE
        }
    }
}
