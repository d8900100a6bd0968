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

    fn validate_config(&self, paths: &[PathBuf]) -> anyhow::Result<berth_cli::ValidConfig> {
        let config = config::load(paths)?;
        let tls = &config.security.tls;
        if tls.rpc_enabled() || tls.http_enabled() {
            tls::check_files(&tls.files()?)?;
        }
        let roles = match (config.server_enabled(), config.client_enabled()) {
            (true, true) => "server and client",
            (true, false) => "server",
            _ => "client",
        };
        let mut notes = Vec::new();
        if config.server_enabled() {
            notes.extend(config::store::etcd_block_unused(
                config.server.store.as_deref(),
                &config.etcd,
            ));
        }
        if !config.server_enabled() {
            match config.security.acl.enabled {
                Some(true) => {}
                Some(false) => notes.push(
                    "acl { enabled = false } on a client: once its servers enforce ACL tokens, \
                     this client checks tokens on its own routes anyway and refuses to start \
                     with this file; leave the acl block out to follow the servers"
                        .to_string(),
                ),
                None => notes.push(
                    "no acl block: this client checks ACL tokens on its own routes whenever \
                     its servers enforce them"
                        .to_string(),
                ),
            }
        }
        Ok(berth_cli::ValidConfig { roles, notes })
    }
}
