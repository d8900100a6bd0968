# A volume of the hostpath plugin that lives on one node only, for
# `berth volume create`. Run the plugin with a topology per node, e.g.
# `--topology=topology.hostpath.csi/node=${BERTH_NODE_ID}` in its task's
# args, then put the ID of the node that should hold the volume below.
id        = "data-on-node-a"
name      = "data-on-node-a"
type      = "csi"
plugin_id = "hostpath"

capacity_min = "1MiB"
capacity_max = "100MiB"

capability {
  access_mode     = "single-node-writer"
  attachment_mode = "file-system"
}

# Where the volume may be created, in Nomad's shape. The plugin must create
# it in one of the `required` topologies (the create fails otherwise) and
# should pick the first `preferred` one it can. The servers then place the
# allocs that use the volume only on nodes whose plugin reports a topology
# with every segment of the volume's accessible topology.
#
# `volume register` takes the `required` topologies as where the volume can
# be reached, since no plugin answers for it.
topology_request {
  required {
    topology {
      segments = { "topology.hostpath.csi/node" = "node-a" }
    }
    topology {
      segments = { "topology.hostpath.csi/node" = "node-b" }
    }
  }
  preferred {
    topology {
      segments = { "topology.hostpath.csi/node" = "node-a" }
    }
  }
}
