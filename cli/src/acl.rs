//! `berth acl bootstrap|policy|token`: ACL policies and tokens. A token's
//! secret is printed once, when it is made; lists and reads show accessor
//! IDs only.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};

use super::output::{ago_cell, key_values, print_lines, text, Table};
use super::{enc, print_json, Ctx};
use berth_api::ApiClient;

#[derive(Subcommand, Debug)]
pub enum AclCommand {
    /// Make the first management token (once per cluster)
    Bootstrap(JsonArgs),
    /// Apply, list, show and delete ACL policies
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Make, list, show and delete ACL tokens
    #[command(subcommand)]
    Token(TokenCommand),
}

#[derive(Args, Debug)]
pub struct JsonArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum PolicyCommand {
    /// Make or replace policy NAME from the HCL rules in FILE
    ///
    /// Root-equivalent capabilities: until tasks run isolated, submit-job
    /// (and namespace policy "write"), csi-register-plugin and
    /// alloc-lifecycle run or restart tasks as root on every node with
    /// raw_exec; give them only to whom you would give root there.
    Apply(PolicyApplyArgs),
    /// List the policies
    List(JsonArgs),
    /// Show a policy with its rules
    Info(NameArgs),
    /// Delete a policy
    Delete(NameArgs),
}

#[derive(Args, Debug)]
pub struct PolicyApplyArgs {
    /// What the policy is for
    #[arg(long, value_name = "TEXT", default_value = "")]
    pub description: String,
    /// The policy's name
    #[arg(value_name = "NAME")]
    pub name: String,
    /// The HCL rules (`-` reads standard input)
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
}

#[derive(Args, Debug)]
pub struct NameArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
    #[arg(value_name = "NAME")]
    pub name: String,
}

#[derive(Subcommand, Debug)]
pub enum TokenCommand {
    /// Make a token; its secret is printed this once
    Create(TokenCreateArgs),
    /// List the tokens
    List(JsonArgs),
    /// Show a token (by accessor ID or unique prefix)
    Info(AccessorArgs),
    /// Show the token in use (-token or BERTH_TOKEN) and its policies
    #[command(name = "self")]
    Self_(JsonArgs),
    /// Delete a token
    Delete(AccessorArgs),
}

#[derive(Args, Debug)]
pub struct TokenCreateArgs {
    /// A name for people
    #[arg(long, default_value = "")]
    pub name: String,
    /// client (what its policies grant) or management (everything)
    #[arg(long = "type", value_name = "TYPE", default_value = "client")]
    pub token_type: String,
    /// A policy the token holds (repeatable)
    #[arg(long = "policy", value_name = "NAME", action = clap::ArgAction::Append)]
    pub policies: Vec<String>,
    /// How long the token works (e.g. 8h; none: until deleted)
    #[arg(long, value_name = "DUR")]
    pub ttl: Option<String>,
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct AccessorArgs {
    /// Print the API's JSON
    #[arg(long)]
    pub json: bool,
    #[arg(value_name = "ACCESSOR")]
    pub accessor: String,
}

pub fn run(cmd: AclCommand, ctx: &Ctx) -> Result<i32> {
    let api = ctx.api();
    match cmd {
        AclCommand::Bootstrap(a) => {
            let v = api.post("/v1/acl/bootstrap", &json!({}))?;
            show_token(&v, a.json)
        }
        AclCommand::Policy(p) => policy(p, api),
        AclCommand::Token(t) => token(t, api),
    }
}

fn policy(cmd: PolicyCommand, api: &ApiClient) -> Result<i32> {
    match cmd {
        PolicyCommand::Apply(a) => {
            let rules = if a.file.as_os_str() == "-" {
                std::io::read_to_string(std::io::stdin()).context("reading standard input")?
            } else {
                std::fs::read_to_string(&a.file)
                    .with_context(|| format!("reading {}", a.file.display()))?
            };
            api.put(
                &format!("/v1/acl/policy/{}", enc(&a.name)),
                &json!({ "description": a.description, "rules": rules }),
            )?;
            println!("Successfully wrote {:?} ACL policy!", a.name);
            Ok(0)
        }
        PolicyCommand::List(a) => {
            let v = api.get("/v1/acl/policies")?;
            if a.json {
                return print_json(&v);
            }
            let mut t = Table::new(["Name", "Description"]);
            for p in v.as_array().into_iter().flatten() {
                t.push([text(&p["name"]), text(&p["description"])]);
            }
            print_lines(t.lines());
            Ok(0)
        }
        PolicyCommand::Info(a) => {
            let v = api.get(&format!("/v1/acl/policy/{}", enc(&a.name)))?;
            if a.json {
                return print_json(&v);
            }
            print_lines(key_values(&[
                ("Name", text(&v["name"])),
                ("Description", text(&v["description"])),
            ]));
            println!(
                "\nRules\n\n{}",
                v["rules"].as_str().unwrap_or_default().trim_end()
            );
            Ok(0)
        }
        PolicyCommand::Delete(a) => {
            api.delete(&format!("/v1/acl/policy/{}", enc(&a.name)))?;
            println!("Successfully deleted {:?} ACL policy!", a.name);
            Ok(0)
        }
    }
}

fn token(cmd: TokenCommand, api: &ApiClient) -> Result<i32> {
    match cmd {
        TokenCommand::Create(a) => {
            let v = api.put(
                "/v1/acl/token",
                &json!({
                    "name": a.name,
                    "type": a.token_type,
                    "policies": a.policies,
                    "ttl": a.ttl,
                }),
            )?;
            show_token(&v, a.json)
        }
        TokenCommand::List(a) => {
            let v = api.get("/v1/acl/tokens")?;
            if a.json {
                return print_json(&v);
            }
            let mut t = Table::new(["Name", "Type", "Accessor ID", "Policies", "Expires"]);
            for tok in v.as_array().into_iter().flatten() {
                t.push([
                    text(&tok["name"]),
                    text(&tok["type"]),
                    text(&tok["accessor_id"]),
                    policies(tok),
                    expires(tok),
                ]);
            }
            print_lines(t.lines());
            Ok(0)
        }
        TokenCommand::Info(a) => {
            let v = api.get(&format!("/v1/acl/token/{}", enc(&a.accessor)))?;
            show_token(&v, a.json)
        }
        TokenCommand::Self_(a) => {
            let v = api.get("/v1/acl/token/self")?;
            show_token(&v, a.json)
        }
        TokenCommand::Delete(a) => {
            api.delete(&format!("/v1/acl/token/{}", enc(&a.accessor)))?;
            println!("Token {} successfully deleted", a.accessor);
            Ok(0)
        }
    }
}

fn policies(tok: &Value) -> String {
    let list: Vec<&str> = tok["policies"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    if list.is_empty() {
        "-".into()
    } else {
        list.join(", ")
    }
}

fn expires(tok: &Value) -> String {
    match tok["expiration_time_ms"].as_i64() {
        Some(_) => ago_cell(&tok["expiration_time_ms"]),
        None => "never".into(),
    }
}

/// A token as Nomad prints one; the secret only when the answer has it
/// (a token just made).
fn show_token(v: &Value, json: bool) -> Result<i32> {
    if json {
        return print_json(v);
    }
    let mut pairs = vec![
        ("Accessor ID", text(&v["accessor_id"])),
        ("Name", text(&v["name"])),
        ("Type", text(&v["type"])),
        ("Policies", policies(v)),
        ("Expires", expires(v)),
        ("Create Time", ago_cell(&v["create_time_ms"])),
    ];
    if let Some(secret) = v["secret_id"].as_str() {
        pairs.insert(1, ("Secret ID", secret.to_string()));
    }
    print_lines(key_values(&pairs));
    Ok(0)
}
