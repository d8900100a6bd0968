//! The berth agent process: configuration, the server and client roles
//! wired together, the HTTP API server and its routes, logging, systemd.
//! The `berth` binary is this library and the CLI (`berth-cli`); the
//! commands the CLI cannot run itself it hands to [`AgentHost`].

pub mod agent;
pub mod config;
mod data_dir;
pub mod http;
mod listener;
mod logging;
mod systemd;
pub mod tls;

use std::path::PathBuf;

/// What the `berth` binary runs itself: agents and the check of their
/// configuration files.
pub struct AgentHost;

impl berth_cli::Host for AgentHost {
    fn agent(&self, args: berth_cli::agent_args::AgentArgs) -> anyhow::Result<i32> {
        agent::run_from_args(args)
    }

    fn config_roles(&self, paths: &[PathBuf]) -> anyhow::Result<&'static str> {
        let config = config::load(paths)?;
        Ok(match (config.server_enabled(), config.client_enabled()) {
            (true, true) => "server and client",
            (true, false) => "server",
            _ => "client",
        })
    }
}
