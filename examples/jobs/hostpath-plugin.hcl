# The hostpath CSI plugin, one instance per node. Its task is an ordinary
# raw_exec task; the csi_plugin block makes berth hand it CSI_ENDPOINT, wait
# for the socket, and register the plugin once it answers.
job "hostpath-plugin" {
  type        = "system"
  datacenters = ["dc1"]

  group "plugin" {
    task "plugin" {
      driver = "raw_exec"

      config {
        # Found on PATH. Volumes live in the task's node data dir, which
        # every alloc of this task on the node shares: a new version of the
        # plugin job (or a stop, then a run) finds the volumes of the old one.
        # They are on this node only, so the plugin says so with a topology
        # per node: the servers place a volume's allocs only on the node
        # that holds it. (Storage every node reaches, a --state-dir they all
        # share, needs no --topology.)
        command = "hostpath-plugin"
        args = [
          "--endpoint=${CSI_ENDPOINT}",
          "--node-id=${BERTH_NODE_ID}",
          "--state-dir=${BERTH_NODE_DATA_DIR}",
          "--topology=topology.hostpath.csi/node=${BERTH_NODE_ID}",
        ]
      }

      csi_plugin {
        id        = "hostpath"
        type      = "monolith"
        mount_dir = "/csi"
      }

      resources {
        cpu    = 100
        memory = 64
      }
    }
  }
}
