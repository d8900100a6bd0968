# A berth server agent for a first cluster on one machine: loopback only,
# no TLS, no ACLs (server.hcl is the one for real machines).
#
#   berth agent -config examples/agent/server-plain.hcl -data-dir /tmp/berth/s1

data_dir = "/var/lib/berth"
name     = "server-1"

ports {
  http = 4747
  rpc  = 4647
}

server {
  enabled = true
}
