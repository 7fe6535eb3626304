"""Networks between a run's peers: loopback by default, or emulated links (:mod:`ddlscope.network.emulated`)."""
