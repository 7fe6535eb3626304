"""The torch side of the ``dmoe`` distribution model (Decentralized Mixture-of-Experts, Ryabinin &
Gusev 2020; hivemind 1.1.12), shared by the trainers and the expert servers.

* :mod:`ddlscope.moe.experts`: expert blocks (hivemind's ``ffn`` / ``transformer`` or a user
  factory), their sample inputs and server schemas, and the pre-flight shape check;
* :mod:`ddlscope.moe.layers`: :class:`~ddlscope.moe.layers.LocalMixtureOfExperts` (hivemind's
  gating with every expert in-process) and :class:`~ddlscope.moe.layers.DenseExpert` (one expert,
  no gating);
* :mod:`ddlscope.moe.networks`: the networks ``moe_cnn`` and ``moe_lm`` that hold a mixture as
  ``net.moe`` (only the ``dmoe`` strategy builds them);
* :mod:`ddlscope.moe.server`: the expert server process.
"""
