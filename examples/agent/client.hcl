# A berth client agent: one per worker node. It registers with the servers
# below, runs the allocs they place on it and mounts their CSI volumes.
#
#   berth config validate examples/agent/client.hcl

data_dir  = "/var/lib/berth"
name      = "worker-1"
log_level = "info"

# Its own HTTP API: a second agent on this machine needs another port.
ports {
  http = 4748
}

client {
  enabled    = true
  servers    = ["127.0.0.1:4647"]
  node_class = "general"

  meta {
    rack = "r1"
  }

  reserved {
    cpu    = 500  # MHz
    memory = 512  # MB
    disk   = 1024 # MB
  }

  disconnect_startup_grace = "30s"
}

acl {
  enabled = true
}

# Dials the servers over mutual TLS, accepting only a certificate that
# names server.global.berth; serves its own HTTP API over TLS too.
tls {
  rpc       = true
  http      = true
  ca_file   = "/etc/berth.d/tls/berth-agent-ca.pem"
  cert_file = "/etc/berth.d/tls/global-client-berth.pem"
  key_file  = "/etc/berth.d/tls/global-client-berth-key.pem"

  verify_server_hostname = true
  verify_https_client    = true
}

# raw_exec runs a task as root, held to nothing: on only where it is
# needed, as here for the CSI node plugin (examples/jobs/hostpath-plugin.hcl
# mounts volumes on the host, which takes root). Jobs that need no
# privileges use the exec driver, on everywhere.
plugin "raw_exec" {
  config {
    enabled = true
  }
}
