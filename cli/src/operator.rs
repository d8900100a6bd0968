//! `berth operator root keyring rotate` and `berth operator store`.

use anyhow::Result;
use clap::{Args, Subcommand};
use serde_json::json;

use super::{print_json, Ctx};
use berth_api::ApiClient;
use berth_structs::text::{count, count_of};

#[derive(Subcommand, Debug)]
pub enum OperatorCommand {
    /// Operate the servers' root keyring, which seals the secrets of the
    /// state database
    #[command(subcommand)]
    Root(RootCommand),
    /// Where the servers keep their state and, on etcd, each member's
    /// health
    Store(StoreArgs),
}

#[derive(Args, Debug)]
pub struct StoreArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum RootCommand {
    /// The keys that seal CSI volume secrets and node secrets at rest
    #[command(subcommand)]
    Keyring(KeyringCommand),
}

#[derive(Subcommand, Debug)]
pub enum KeyringCommand {
    /// Make a new key, seal every stored secret again with it, and remove
    /// the old keys; prints the new key's ID
    Rotate(RotateArgs),
}

#[derive(Args, Debug)]
pub struct RotateArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
}

pub fn run(cmd: OperatorCommand, ctx: &Ctx) -> Result<i32> {
    match cmd {
        OperatorCommand::Root(RootCommand::Keyring(KeyringCommand::Rotate(a))) => {
            keyring_rotate(a, ctx.api())
        }
        OperatorCommand::Store(a) => store(a, ctx.api()),
    }
}

fn store(a: StoreArgs, api: &ApiClient) -> Result<i32> {
    let v = api.get("/v1/operator/store")?;
    if a.json {
        return print_json(&v);
    }
    let kind = v["store"].as_str().unwrap_or_default();
    match v["prefix"].as_str() {
        Some(prefix) => println!("Store: {kind} (prefix {prefix})"),
        None => println!("Store: {kind}"),
    }
    let members = v["members"].as_array().cloned().unwrap_or_default();
    if members.is_empty() {
        return Ok(0);
    }
    let mut table =
        super::output::Table::new(["Endpoint", "Health", "Leader", "Version", "Problem"]);
    let mut unhealthy = 0;
    for m in &members {
        let healthy = m["healthy"].as_bool().unwrap_or(false);
        unhealthy += usize::from(!healthy);
        let problems: Vec<&str> = m["errors"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e.as_str())
            .collect();
        table.push([
            m["endpoint"].as_str().unwrap_or_default().to_string(),
            if healthy { "healthy" } else { "unhealthy" }.to_string(),
            m["is_leader"].as_bool().unwrap_or(false).to_string(),
            m["version"].as_str().unwrap_or_default().to_string(),
            problems.join("; "),
        ]);
    }
    super::output::print_lines(table.lines());
    // A member down is worth a nonzero exit for scripts.
    Ok(i32::from(unhealthy > 0))
}

fn keyring_rotate(a: RotateArgs, api: &ApiClient) -> Result<i32> {
    let v = api.put("/v1/operator/keyring/rotate", &json!({}))?;
    if a.json {
        return print_json(&v);
    }
    println!("Key ID: {}", v["key_id"].as_str().unwrap_or_default());
    println!(
        "Sealed again: {}, {}; retired {}",
        count(v["volumes"].as_u64().unwrap_or(0), "volume", "volumes"),
        count(
            v["node_secrets"].as_u64().unwrap_or(0),
            "node secret",
            "node secrets"
        ),
        count_of(v["retired"].as_array().map_or(0, Vec::len), "key", "keys")
    );
    Ok(0)
}
