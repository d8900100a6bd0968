# An image-backed volume of the hostpath plugin (an ext4 image file on a
# loop device), handed to tasks as a raw block device. For
# `berth volume create`; the nodes need losetup and e2fsprogs.
id        = "disk"
name      = "disk"
type      = "csi"
plugin_id = "hostpath"

capacity_min = "64MiB"
capacity_max = "1GiB"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "block-device"
}

capability {
  access_mode     = "single-node-reader-only"
  attachment_mode = "block-device"
}

parameters {
  backing = "image"
}
