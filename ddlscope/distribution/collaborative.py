"""``collaborative``: peers of a hivemind swarm accumulate a target batch size, then average
(``hivemind.Optimizer``; thesis 000, DeDLOC — Diskin et al. 2021).

Its config table is ``[collaborative]`` (:class:`CollaborativeConfig`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ddlscope.distribution import DistributionModel, register

if TYPE_CHECKING:
    from ddlscope.config import RunConfig

DEFAULT_MATCHMAKING_TIME_S = 10.0
"""Thesis 000's fixed matchmaking time: the one default everywhere (runs, predictions, recommendations)."""


class CollaborativeConfig(BaseModel):
    """Settings of ``hivemind.Optimizer`` for the ``collaborative`` distribution model (``[collaborative]``).

    Defaults follow thesis 000 (matchmaking_time 10 s, averaging_timeout 300 s, no gradient
    compression) except where a field says otherwise.
    """

    model_config = ConfigDict(extra="forbid")

    target_batch_size: int = Field(256, ge=1, description="samples all peers accumulate per global epoch (TBS)")
    use_local_updates: bool = Field(False, description="step the local optimizer every batch and average parameters (LU)")
    matchmaking_time_s: float = Field(DEFAULT_MATCHMAKING_TIME_S, gt=0,
                                      description="seconds peers wait to form an averaging group")
    averaging_timeout_s: float = Field(300.0, gt=0, description="give up an averaging round after this many seconds")
    gradient_compression: Literal["none", "float16", "scaled-float16", "uniform8bit"] = "none"
    average_state_every: int = Field(1, ge=1, description="average parameters and optimizer state every N global epochs")
    listen_host: str = Field("127.0.0.1", description="address peers listen on; loopback unless you ask")
    join_timeout_s: float = Field(60.0, gt=0, description="a peer that cannot join the swarm in this time fails")
    initial_peers: list[str] = Field(default_factory=list, description="multiaddrs of a running swarm or bootstrap peer to join")


def check_target_batch(cfg: "RunConfig") -> None:
    """The target batch size holds at least one optimizer step of a peer.

    Raises:
        ValueError: ``target_batch_size < batch_size x gradient_accumulation_steps``.
    """
    per_step = cfg.batch_size * cfg.gradient_accumulation_steps
    if cfg.collaborative.target_batch_size < per_step:
        raise ValueError(
            f"collaborative.target_batch_size = {cfg.collaborative.target_batch_size} is below one optimizer "
            f"step of a peer (batch_size x gradient_accumulation_steps = {per_step}); allowed: >= {per_step}")


def _global_batch(batch_size: int, workers: int, options: Mapping[str, Any]) -> int:
    return int(options.get("target_batch_size", CollaborativeConfig.model_fields["target_batch_size"].default))


def _cost(profile, cluster, setting, compute_scale: float = 1.0):
    from ddlscope.predict.costs import predict_collaborative

    return predict_collaborative(profile, cluster, setting, compute_scale)


def _memory(profile, setting):
    from ddlscope.predict.memory import predict_memory

    return predict_memory(profile, "collaborative", setting.workers, setting.batch_size,
                          use_local_updates=setting.use_local_updates)


MODEL = register(DistributionModel(
    name="collaborative",
    summary="hivemind peers accumulate a target batch size, then average gradients or parameters",
    strategy="collaborative:CollaborativeStrategy",
    launcher="swarm",
    measures="averaging rounds (group size, success, wait), hivemind's background CPU, TCP bytes per peer",
    predicts="time to accumulate the target batch + butterfly all-reduce (hivemind's LP) + calibrated overhead",
    order=50,
    min_workers=1,
    config_table="collaborative",
    config_class=CollaborativeConfig,
    check_config=check_target_batch,
    global_batch=_global_batch,
    cost_model=_cost,
    memory_model=_memory,
))
