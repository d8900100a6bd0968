# A berth client agent for a first cluster on one machine, beside
# server-plain.hcl: loopback only, no TLS, no ACLs (client.hcl is the one
# for real machines).
#
#   berth agent -config examples/agent/client-plain.hcl -data-dir /tmp/berth/c1 -node worker-1

data_dir = "/var/lib/berth"
name     = "worker-1"

# Its own HTTP API: a second agent on this machine needs another port.
ports {
  http = 4748
}

client {
  enabled = true
  servers = ["127.0.0.1:4647"]
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
