# Writes a file into the "data" CSI volume and exits.
job "writer" {
  type        = "batch"
  datacenters = ["dc1"]

  group "writer" {
    volume "data" {
      type            = "csi"
      source          = "data"
      access_mode     = "single-node-writer"
      attachment_mode = "file-system"
    }

    task "write" {
      driver = "raw_exec"

      config {
        command = "/bin/sh"
        args    = ["-c", "echo 'hello from berth' > ${BERTH_TASK_DIR}/data/hello"]
      }

      volume_mount {
        volume      = "data"
        destination = "data"
      }

      resources {
        cpu    = 50
        memory = 32
      }
    }
  }
}
