# A berth server agent: keeps the cluster state and serves the agent
# protocol that clients dial (ports.rpc) and the HTTP API (ports.http).
#
#   berth config validate examples/agent/server.hcl
#
# The certificates come from `berth tls`, run once in /etc/berth.d/tls:
#
#   berth tls ca create
#   berth tls cert create -server
#   berth tls cert create -client    # for each client agent
#   berth tls cert create -cli       # for the CLI

data_dir  = "/var/lib/berth"
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

acl {
  enabled = true
}

# Mutual TLS on both ports: clients must present a certificate of the CA,
# and so must the CLI (BERTH_CACERT, BERTH_CLIENT_CERT, BERTH_CLIENT_KEY).
tls {
  rpc       = true
  http      = true
  ca_file   = "/etc/berth.d/tls/berth-agent-ca.pem"
  cert_file = "/etc/berth.d/tls/global-server-berth.pem"
  key_file  = "/etc/berth.d/tls/global-server-berth-key.pem"

  verify_server_hostname = true
  verify_https_client    = true
}
