# A berth client agent: one per worker node. It registers with the servers
# below, runs the allocs they place on it and mounts their CSI volumes.
#
#   berth config validate examples/agent/client.hcl

data_dir  = "/var/lib/berth/client"
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
