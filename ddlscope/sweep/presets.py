"""Ready-made grids: thesis 000's experiments scaled to this machine, and one sized for a laptop.

Each preset is a function of the number of cores this process may use and returns grid data in
the format of :mod:`ddlscope.sweep.grid` (``base`` and ``axes`` tables).

- ``thesis-baseline``: Table 5.1 (ResNet-18 on one node; batch size 32/64/128 x learning rate
  0.001/0.01/0.1, 4 repeats) with the final version's GAS axis (1, 2): 72 cells.
- ``thesis-collaborative``: Table 5.2 (144 runs on 16 vCPUs): 2 peers x 8 vCPUs over batch size
  x learning rate x target batch size 10,000/5,000/2,500/1,250/625 x local updates, and 4/8/16
  peers x 4/2/1 vCPUs at target batch size 1,250 over batch size x learning rate x local updates.
  Peer counts are kept where they divide this machine's cores (on 2 cores: only 2 peers, 90 cells).
- ``dmoe``: the Decentralized Mixture-of-Experts (seed 003) on 2 trainers: experts (grid 2x2 and
  4x4) x k_best (1, 2, 4) x expert servers (1, 2), next to the same network with its experts
  in-process (``dmoe.placement = "local"``) and the dense equivalent. Emulated links (bandwidth,
  latency) are not an axis yet: every server runs on this machine's loopback.
- ``local``: a small study that ends in under an hour on 2 cores (estimated with
  :mod:`ddlscope.experiments.estimate`): baselines over batch size, learning rate and GAS (2 repeats),
  2 peers over learning rate, target batch size and local updates, and a matchmaking-time axis.

Scaling (thesis -> here): the thesis used 16 vCPUs and a budget of 320,000 samples shared by all
peers (seeds README). Here the budget is 320,000 x cores / 16 (so a run takes about as long as in
the thesis if a core is as fast) and the baseline gets all cores; target batch sizes, batch sizes
and learning rates are the thesis's. Hivemind settings are the thesis's fixed ones (matchmaking
10 s, averaging timeout 300 s, no compression). Data: the bundled digits at MNIST geometry.
"""

from __future__ import annotations

from typing import Any, Callable

from ddlscope.errors import UserError

THESIS_VCPUS = 16
THESIS_SAMPLE_BUDGET = 320_000
THESIS_BATCH_SIZES = [32, 64, 128]
THESIS_LEARNING_RATES = [0.001, 0.01, 0.1]
THESIS_TARGET_BATCH_SIZES = [10_000, 5_000, 2_500, 1_250, 625]
LOCAL_SAMPLE_BUDGET = 3_200


def _scaled_budget(cores: int) -> int:
    return max(THESIS_SAMPLE_BUDGET * cores // THESIS_VCPUS, max(THESIS_BATCH_SIZES) * THESIS_VCPUS)


def thesis_baseline(cores: int) -> dict[str, Any]:
    """Table 5.1 + GAS axis on all ``cores`` (72 cells). See the module docstring for the scaling."""
    return {"base": dict(strategy="single", model="resnet18", dataset="digits", vcpus_per_peer=cores,
                         sample_budget=_scaled_budget(cores)),
            "axes": dict(batch_size=THESIS_BATCH_SIZES, learning_rate=THESIS_LEARNING_RATES,
                         gradient_accumulation_steps=[1, 2], repeats=4)}


def thesis_collaborative(cores: int) -> dict[str, Any]:
    """Table 5.2 scaled to ``cores`` (144 cells on 16 cores, 90 on 2).

    Raises:
        UserError: fewer than 2 cores (two peers need a core each).
    """
    if cores < 2:
        raise UserError(f"preset thesis-collaborative needs at least 2 cores (one per peer); this machine gives {cores}")
    total = cores - cores % 2
    common = dict(batch_size=THESIS_BATCH_SIZES, learning_rate=THESIS_LEARNING_RATES,
                  **{"collaborative.use_local_updates": [False, True]})
    axes = [dict(common, peers=[2], total_vcpus=total,
                 **{"collaborative.target_batch_size": THESIS_TARGET_BATCH_SIZES})]
    more_peers = [p for p in (4, 8, 16) if p <= cores and cores % p == 0]
    if more_peers:
        axes.append(dict(common, peers=more_peers, total_vcpus=cores, **{"collaborative.target_batch_size": [1_250]}))
    return {"base": dict(strategy="collaborative", model="resnet18", dataset="digits",
                         sample_budget=_scaled_budget(cores),
                         collaborative=dict(matchmaking_time_s=10.0, averaging_timeout_s=300.0,
                                            gradient_compression="none")),
            "axes": axes}


def local(cores: int) -> dict[str, Any]:
    """About 26 cells that end in under an hour on 2 cores (ResNet-18 on digits, budget 3,200).

    Raises:
        UserError: fewer than 2 cores.
    """
    if cores < 2:
        raise UserError(f"preset local needs at least 2 cores (two peers); this machine gives {cores}")
    total = cores - cores % 2
    collab = {"peers": [2], "total_vcpus": total, "batch_size": [32]}
    return {"base": dict(strategy="single", model="resnet18", dataset="digits", sample_budget=LOCAL_SAMPLE_BUDGET,
                         eval_every_steps=25, loader_workers=1,
                         collaborative=dict(matchmaking_time_s=2.0, averaging_timeout_s=60.0)),
            "axes": [
                dict(batch_size=[32, 64], learning_rate=[0.01, 0.1], gradient_accumulation_steps=[1, 2], repeats=2,
                     vcpus_per_peer=[cores]),
                dict(collab, learning_rate=[0.01, 0.1], **{"collaborative.target_batch_size": [128, 512],
                                                           "collaborative.use_local_updates": [False, True]}),
                dict(collab, learning_rate=[0.01], **{"collaborative.target_batch_size": [512],
                                                      "collaborative.matchmaking_time_s": [0.5, 5.0]}),
            ]}


DMOE_SAMPLE_BUDGET = 1_600


def dmoe(cores: int) -> dict[str, Any]:
    """Decentralized MoE: experts x k_best x servers on 2 trainers, with local and dense baselines (19 cells).

    Raises:
        UserError: fewer than 2 cores (a core per trainer; the expert servers share them).
    """
    if cores < 2:
        raise UserError(f"preset dmoe needs at least 2 cores (one per trainer); this machine gives {cores}")
    grids = [[2, 2], [4, 4]]
    return {"base": dict(strategy="dmoe", model="moe_cnn", dataset="digits", peers=2, vcpus_per_peer=1,
                         sample_budget=DMOE_SAMPLE_BUDGET, batch_size=32, eval_every_steps=10),
            "axes": [
                {"dmoe.grid_size": grids, "dmoe.k_best": [1, 2, 4], "dmoe.servers": [1, 2]},
                {"dmoe.placement": ["local"], "dmoe.grid_size": grids, "dmoe.k_best": [1, 2, 4]},
                {"dmoe.placement": ["dense"]},
            ]}


PRESETS: dict[str, Callable[[int], dict[str, Any]]] = {
    "thesis-baseline": thesis_baseline,
    "thesis-collaborative": thesis_collaborative,
    "local": local,
    "dmoe": dmoe,
}


def preset_grid(name: str, cores: int) -> dict[str, Any]:
    """The grid data of preset ``name`` for a machine with ``cores`` cores.

    Raises:
        UserError: unknown preset (the message lists them), or too few cores for it.
    """
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; allowed: {', '.join(PRESETS)}")
    return PRESETS[name](cores)


def describe_presets() -> dict[str, str]:
    """Preset name -> the first line of its docstring."""
    return {n: (f.__doc__ or "").strip().splitlines()[0] for n, f in PRESETS.items()}
