"""The measuring side of the predictor: workload profiles (:mod:`.profile`), the cluster's
calibration (:mod:`.calibrate`) and the short hivemind swarm it times (:mod:`.swarm`).

Everything here runs torch on the local device; what it produces is described by the
torch-free data classes of :mod:`ddlscope.modeling`.
"""
