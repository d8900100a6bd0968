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
        # Found on PATH.
        command = "hostpath-plugin"
        args = [
          "--endpoint=${CSI_ENDPOINT}",
          "--node-id=${BERTH_NODE_ID}",
          "--state-dir=${BERTH_ALLOC_DIR}/data",
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
