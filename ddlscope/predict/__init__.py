"""Profile, predict, recommend, validate (thesis 002 ch. 4-8, and better).

- :mod:`.profile`: a short measurement of a workload on one device (per-layer forward/backward
  seconds, parameter/activation bytes, optimizer step, data loading) -> :class:`WorkloadProfile`.
- :mod:`.memory`: peak memory per worker for each distribution model, from fake tensors.
- :mod:`.cluster`: the cluster description (TOML) -> :class:`ClusterSpec`; :mod:`.devices`: known
  device kinds and scaling a profile to another device; :mod:`.calibrate`: microbenchmarks that
  measure a cluster description among local workers.
- :mod:`.costs`: the cost model of every distribution model, with the thesis's closed forms
  (eq. 5.1, 6.1, 6.2) kept as named reference models.
- :mod:`.recommend`: rank the distribution models, never recommending one that does not fit.
- :mod:`.validate`: predictions next to real runs; error, recommendation correctness, regret.
"""
