# A volume of the hostpath plugin, for `berth volume create`.
id        = "data"
name      = "data"
type      = "csi"
plugin_id = "hostpath"

capacity_min = "1MiB"
capacity_max = "100MiB"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}

capability {
  access_mode     = "single-node-reader-only"
  attachment_mode = "file-system"
}
