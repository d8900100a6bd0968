# Writes a few bytes at the start of the "disk" block volume
# (examples/volumes/hostpath-block.hcl) and exits. The task finds the
# device as a device file at ${BERTH_TASK_DIR}/disk.
job "block-writer" {
  type        = "batch"
  datacenters = ["dc1"]

  group "writer" {
    volume "disk" {
      type            = "csi"
      source          = "disk"
      access_mode     = "single-node-writer"
      attachment_mode = "block-device"
    }

    task "write" {
      driver = "raw_exec"

      config {
        command = "/bin/sh"
        args = [
          "-c",
          "printf 'hello from berth' | dd of=${BERTH_TASK_DIR}/disk conv=notrunc,fsync",
        ]
      }

      volume_mount {
        volume      = "disk"
        destination = "disk"
        # How mounts made later on either side reach the other: private
        # (the default), host-to-task or bidirectional.
        propagation_mode = "private"
      }

      resources {
        cpu    = 50
        memory = 32
      }
    }
  }
}
