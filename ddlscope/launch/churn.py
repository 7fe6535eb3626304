"""Carry out a swarm's churn schedule: peers that join late, leave, are killed and rejoin.

The launcher (:class:`~ddlscope.launch.local.LocalLauncher`) asks :class:`ChurnSchedule` every
half second which actions are due (``collaborative.churn``,
:class:`~ddlscope.distribution.collaborative.ChurnEvent`) and does them:

- ``join`` / ``rejoin``: start the peer's worker process with the multiaddrs of the peers alive
  then as initial peers (a rejoin continues the peer's step count and appends to its log);
- ``leave``: SIGUSR1 to the peer, which ends at its next step and exits like a finished peer (a
  peer still starting up gets it once it trains);
- ``kill``: SIGKILL to the peer's whole process group (its p2pd and averagers die with it).

Every action is stored as an event of the peer (``peer_join``, ``peer_rejoin``, ``peer_leave``,
``peer_kill``, with ``at_s``, the scheduled time, and ``elapsed_s``, when it was done, both in seconds
since the swarm's first step); an action whose peer
already ended is stored as ``churn_skipped``, and actions still pending when the swarm has
emptied as ``churn_cancelled``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddlscope.distribution.collaborative import ChurnEvent

ACTIONS = ("join", "leave", "kill", "rejoin")


@dataclass(frozen=True)
class ChurnAction:
    """One due action: ``kind`` (one of :data:`ACTIONS`) for ``peer`` at ``at_s`` seconds."""

    peer: int
    kind: str
    at_s: float


@dataclass
class ChurnSchedule:
    """The actions of a run's churn events, handed out once each when due.

    Args:
        events: the run's ``collaborative.churn`` entries.
    """

    events: list[ChurnEvent]
    _pending: list[ChurnAction] = field(default_factory=list)

    def __post_init__(self) -> None:
        for e in self.events:
            times = {"join": e.join_at_s if e.join_at_s > 0 else None, "leave": e.leave_at_s,
                     "kill": e.kill_at_s, "rejoin": e.rejoin_at_s}
            self._pending += [ChurnAction(e.peer, kind, t) for kind, t in times.items() if t is not None]
        self._pending.sort(key=lambda a: (a.at_s, ACTIONS.index(a.kind), a.peer))

    def late_peers(self) -> set[int]:
        """Peers that do not start with the run (``join_at_s > 0``)."""
        return {e.peer for e in self.events if e.join_at_s > 0}

    def due(self, elapsed_s: float) -> list[ChurnAction]:
        """The actions due at ``elapsed_s`` seconds since the start, in time order; each is handed out once."""
        now = [a for a in self._pending if a.at_s <= elapsed_s]
        self._pending = self._pending[len(now):]
        return now

    def defer(self, action: ChurnAction) -> None:
        """Hand ``action`` out again at the next :meth:`due` (its peer was not ready for it yet)."""
        self._pending.insert(0, action)

    def cancel(self) -> list[ChurnAction]:
        """Drop and return every action still pending."""
        left, self._pending = self._pending, []
        return left

    @property
    def pending(self) -> bool:
        """Some action is still to come."""
        return bool(self._pending)
