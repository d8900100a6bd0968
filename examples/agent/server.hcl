# A berth server agent: keeps the cluster state and serves the agent
# protocol that clients dial (ports.rpc) and the HTTP API (ports.http).
#
#   berth config validate examples/agent/server.hcl

data_dir  = "/var/lib/berth/server"
name      = "server-1"
log_level = "info"
bind_addr = "0.0.0.0"

ports {
  http = 4747
  rpc  = 4647
}

server {
  enabled                   = true
  min_heartbeat_ttl         = "10s"
  max_heartbeats_per_second = 50
  heartbeat_grace           = "10s"
}
