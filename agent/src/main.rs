//! `berth`: one binary for every role. `berth agent -dev` runs a server and
//! a client in one process; every other command talks to the HTTP API.

mod agent;
mod cli;
mod client;
mod http;
mod logging;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match cli::run(args) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("Error: {e:#}");
            std::process::exit(1);
        }
    }
}
