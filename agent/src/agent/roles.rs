//! Starting the roles' listeners: the server role with its agent protocol
//! and HTTP API, or a client-only agent's HTTP API.

use berth_sync::Shutdown;
use std::net::SocketAddr;

use anyhow::{Context, Result};
use berth_server::leader_link::MAX_RPC_STREAMS_PER_CONNECTION;
use berth_server::{Server, ServerConfig};

use super::flags::AgentConfig;

/// Opens the server state and starts the server role, its agent protocol
/// listener and the HTTP API on `tasks`; returns the address the agent
/// protocol listens on (the port it got when asked for port 0), as a
/// client on this machine dials it.
pub(super) async fn start_server(
    config: &AgentConfig,
    tls: Option<&std::sync::Arc<crate::tls::AgentTls>>,
    data_dir: &std::path::Path,
    shutdown_rx: &Shutdown,
    tasks: &mut tokio::task::JoinSet<Result<()>>,
    info: &std::sync::Arc<crate::http::agent_api::AgentInfo>,
) -> Result<(SocketAddr, std::sync::Arc<Server>)> {
    let rpc_listener = tokio::net::TcpListener::bind(config.rpc_addr)
        .await
        .with_context(|| format!("binding the agent protocol to {}", config.rpc_addr))?;
    let rpc_addr = rpc_listener.local_addr()?;
    let http_listener = tokio::net::TcpListener::bind(config.http_addr)
        .await
        .with_context(|| format!("binding the HTTP API to {}", config.http_addr))?;
    let http_addr = http_listener.local_addr()?;
    tracing::info!(rpc_addr = %rpc_addr, http_addr = %http_addr, "agent starting");
    let _ = info.rpc_addr.set(rpc_addr);
    let _ = info.http_addr.set(http_addr);
    if let Some(t) = tls.filter(|t| t.rpc) {
        let _ = info
            .server_tls
            .set(t.clone() as std::sync::Arc<dyn berth_client::servers::ServerTls>);
    }
    let mut server_config = server_config(config, data_dir);
    server_config.identity = berth_server::leader::ServerIdentity {
        name: config.node_name.clone().unwrap_or_else(host_name),
        rpc_addr: rpc_addr.to_string(),
        http_addr: http_addr.to_string(),
    };
    // Opening waits for etcd when the state is kept there.
    let server = Server::open(server_config).context("opening the server state")?;

    {
        let server = server.clone();
        let rx = shutdown_rx.clone();
        tasks.spawn(async move {
            server.run(rx).await;
            Ok::<(), anyhow::Error>(())
        });
    }
    serve_agent_protocol(config, tls, &server, rpc_listener, shutdown_rx, tasks, info);
    {
        let rx = shutdown_rx.clone();
        let api = crate::http::agent_api::agent_router(Some(server.clone()), info.clone());
        let how = http_serving(config, tls);
        tasks.spawn(async move {
            crate::http::listener::serve(http_listener, api, rx, how)
                .await
                .context("HTTP API")
        });
    }
    Ok((loopback_dial(rpc_addr), server))
}

/// This machine's host name, which names a server without `name`.
fn host_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "berth-server".to_string())
}

/// The server role's configuration from the agent's.
fn server_config(config: &AgentConfig, data_dir: &std::path::Path) -> ServerConfig {
    let security = &config.security;
    let mut server_config = ServerConfig {
        data_dir: data_dir.to_path_buf(),
        min_heartbeat_ttl: config.min_heartbeat_ttl,
        acl_enabled: security.acl.enabled(),
        // With ACLs or TLS on, a node the servers do not know must prove
        // it may join.
        node_enrollment: security.acl.enabled() || security.tls.rpc_enabled(),
        region: security.effective_region().to_string(),
        register_rate: Some({
            let l = security.limits.effective();
            berth_server::RegisterRate {
                rate: f64::from(l.node_register_rate_per_client),
                burst: l.node_register_burst_per_client,
            }
        }),
        store: config.store.clone(),
        ..ServerConfig::default()
    };
    if let Some(g) = config.heartbeat_grace {
        server_config.heartbeat_grace = g;
    }
    if let Some(n) = config.max_heartbeats_per_second {
        server_config.max_heartbeats_per_second = f64::from(n);
    }
    if let Some(d) = config.default_lost_after {
        server_config.default_lost_after = d;
    }
    server_config
}

/// Serves the agent protocol (the node and CSI volume services, and the
/// HTTP requests client agents forward) on `listener`, over TLS when
/// `tls.rpc` is on, until `shutdown_rx`.
fn serve_agent_protocol(
    config: &AgentConfig,
    tls: Option<&std::sync::Arc<crate::tls::AgentTls>>,
    server: &std::sync::Arc<Server>,
    rpc_listener: tokio::net::TcpListener,
    shutdown_rx: &Shutdown,
    tasks: &mut tokio::task::JoinSet<Result<()>>,
    info: &std::sync::Arc<crate::http::agent_api::AgentInfo>,
) {
    // Keepalive drops the streams of clients whose packets silently
    // vanish, as the clients do on their side.
    let router = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(berth_client::servers::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(berth_client::servers::KEEPALIVE_TIMEOUT))
        .max_concurrent_streams(Some(MAX_RPC_STREAMS_PER_CONNECTION))
        // Every answer names the cluster; a request of another cluster's
        // node is refused before any service sees it; a server that does
        // not lead sends the nodes' requests on to the leader.
        .layer(server.cluster_id_layer().sending_on(
            crate::http::leader_gate::LeaderGate::new(
                server.clone(),
                info.server_tls.get().cloned(),
            ),
            &server.config().identity.name,
        ))
        .add_service(berth_server::node_service(server))
        .add_service(berth_server::csi_volume_service(server))
        // Requests that client agents forward count against this
        // agent's limits too.
        .add_service(crate::http::forward::forward_service(
            info.limits.apply(crate::http::router_with(
                server.clone(),
                info.server_tls.get().cloned(),
            )),
            server,
        ));
    // The accept loop sets TCP_NODELAY on every accepted connection
    // (tonic sets it only on listeners it binds itself): without it a
    // small frame written while an earlier one is unacknowledged waits
    // out the peer's delayed ACK, about 40 ms on Linux, which an alloc
    // update or a claim answer would pay now and then.
    let limit = crate::listener::PerClientLimit::new(
        config.security.limits.effective().rpc_max_conns_per_client,
    );
    let mut rx = shutdown_rx.clone();
    let stop = async move {
        let _ = rx.wait().await;
    };
    match tls.filter(|t| t.rpc).cloned() {
        Some(tls) => {
            let incoming = crate::listener::incoming(rpc_listener, limit, move |s, a, slot| {
                crate::listener::accept_tls(tls.clone(), s, a, slot)
            });
            tasks.spawn(async move {
                router
                    .serve_with_incoming_shutdown(incoming, stop)
                    .await
                    .context("agent protocol server")
            });
        }
        None => {
            let incoming =
                crate::listener::incoming(rpc_listener, limit, crate::listener::accept_plain);
            tasks.spawn(async move {
                router
                    .serve_with_incoming_shutdown(incoming, stop)
                    .await
                    .context("agent protocol server")
            });
        }
    }
}

/// The address a client on this machine dials: a listener on every
/// address is dialled on loopback.
fn loopback_dial(rpc_addr: SocketAddr) -> SocketAddr {
    if rpc_addr.ip().is_unspecified() {
        let lo = match rpc_addr {
            SocketAddr::V4(_) => std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
            SocketAddr::V6(_) => std::net::IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        };
        SocketAddr::new(lo, rpc_addr.port())
    } else {
        rpc_addr
    }
}

/// Binds a client-only agent's HTTP API and serves it on `tasks`.
pub(super) async fn start_client_http(
    config: &AgentConfig,
    tls: Option<&std::sync::Arc<crate::tls::AgentTls>>,
    shutdown_rx: &Shutdown,
    tasks: &mut tokio::task::JoinSet<Result<()>>,
    info: &std::sync::Arc<crate::http::agent_api::AgentInfo>,
) -> Result<()> {
    let http_listener = tokio::net::TcpListener::bind(config.http_addr)
        .await
        .with_context(|| format!("binding the HTTP API to {}", config.http_addr))?;
    let _ = info.http_addr.set(http_listener.local_addr()?);
    let api = crate::http::agent_api::agent_router(None, info.clone());
    let rx = shutdown_rx.clone();
    let how = http_serving(config, tls);
    tasks.spawn(async move {
        crate::http::listener::serve(http_listener, api, rx, how)
            .await
            .context("HTTP API")
    });
    Ok(())
}

/// How the HTTP API is served: over TLS when `tls.http` is on, within
/// the configured limits.
pub(super) fn http_serving(
    config: &AgentConfig,
    tls: Option<&std::sync::Arc<crate::tls::AgentTls>>,
) -> crate::http::listener::HttpServing {
    crate::http::listener::HttpServing {
        tls: tls.filter(|t| t.http).cloned(),
        limits: config.security.limits.effective(),
    }
}
