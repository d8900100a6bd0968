# Mounts the "data" CSI volume read-only and succeeds only if it finds what
# the writer job left there.
job "reader" {
  type        = "batch"
  datacenters = ["dc1"]

  group "reader" {
    volume "data" {
      type            = "csi"
      source          = "data"
      read_only       = true
      access_mode     = "single-node-reader-only"
      attachment_mode = "file-system"
    }

    task "read" {
      driver = "raw_exec"

      config {
        command = "/bin/sh"
        args    = ["-c", "test \"$(cat ${BERTH_TASK_DIR}/data/hello)\" = \"hello from berth\""]
      }

      volume_mount {
        volume      = "data"
        destination = "data"
        read_only   = true
      }

      resources {
        cpu    = 50
        memory = 32
      }
    }
  }
}
