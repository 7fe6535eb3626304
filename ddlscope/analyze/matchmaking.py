"""Matchmaking time analysis of collaborative runs, and a recommended ``matchmaking_time_s``.

It applies to the runs of every distribution model whose averaging groups are formed by
matchmaking: the registry's :attr:`~ddlscope.distribution.DistributionModel.has_matchmaking`
(their config table has ``matchmaking_time_s``; today ``collaborative``, hivemind).

Thesis 000 found that Hivemind's matchmaking time must be tuned to the step time: too short and
peers average alone (the group closes before the others arrive), too long and they idle waiting
for the group to close. This module measures both from the stored steps of collaborative runs:

- a **round** is a global epoch: every peer's step with ``averaging_round = 1`` and the same
  ``global_epoch`` (the epoch after the step) belongs to it;
- a peer's **arrival** at a round is the time it entered the optimizer step: ``wall_time +
  data_load_s + forward_s + backward_s`` of that step; the round's **arrival spread** is the
  latest minus the earliest arrival among the peers that took part (needs >= 2 of them);
- a peer's **wait** in a round is the step's ``averaging_s`` (matchmaking + all-reduce + state
  averaging, the local optimizer's own work excluded);
- **group size** per peer-round is what hivemind reported (1 = the peer averaged alone); the
  **solo share** is the fraction of peer-rounds with group size 1;
- **step time** is the median ``step_s`` of warm-up-free steps without a round; **time per
  global epoch** the median gap between a peer's consecutive round arrivals.

Recommendation rule (ddlscope's, documented in :data:`RULE`): cover the observed spread of the
peers' arrival plus a margin, and never go below a few step times::

    spread = p90 of the rounds' arrival spreads (nearest rank)
    margin = max(0.5 x spread, 1 step time)
    recommended_s = max(spread + margin, 3 x step time)

With a solo share of :data:`SOLO_SHARE_TOO_SHORT` or more, the recommendation is never shorter than
the configured time (a shorter window only makes more peers average alone): below the rule's value
the configured time is too short; at or above it, the solo rounds have another cause (peers
reaching a round at different global epochs, failed matchmaking) and the configured time is kept.
Only with fewer solo rounds can a configured time be too long.

When the recommendation exceeds half of a global epoch, averaging would dominate the epoch: the
output says to raise ``target_batch_size`` instead.

The **partial share** is the fraction of peer-rounds in which one of the peer's rounds (gradients
or parameters) was partial: hivemind dropped a peer's chunks after ``next_chunk_timeout`` and
averaged that part without them (:func:`ddlscope.analyze.swarm.partial_rounds`; a
``partial_average`` event belongs to the peer-round of the global epoch the peer was in when it
was read). hivemind.Optimizer's ``next_chunk_timeout`` is the matchmaking time unless
``collaborative.next_chunk_timeout_s`` sets it, so a shorter matchmaking time also drops chunks
sooner; the output says so when rounds were partial.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from ddlscope import distribution
from ddlscope.store.db import ResultsStore

SPREAD_QUANTILE = 0.9
MARGIN_FRACTION = 0.5
MIN_STEP_TIMES = 3
SOLO_SHARE_TOO_SHORT = 0.2
RULE = (f"recommended_s = max(spread + max({MARGIN_FRACTION} x spread, 1 step time), {MIN_STEP_TIMES} x step time), "
        f"spread = p{int(SPREAD_QUANTILE * 100)} (nearest rank) of the rounds' arrival spreads; with "
        f"{SOLO_SHARE_TOO_SHORT:.0%} or more of peer-rounds solo, never below the configured matchmaking_time_s")


def matchmaking_applies(strategy: str) -> bool:
    """True when runs of ``strategy`` form averaging groups by matchmaking (unknown names: False)."""
    return strategy in distribution.names() and distribution.get(strategy).has_matchmaking


def matchmaking_models() -> tuple[str, ...]:
    """Names of the registered models with matchmaking."""
    return tuple(n for n in distribution.names() if matchmaking_applies(n))


def configured_matchmaking_s(strategy: str, config: dict[str, Any]) -> float:
    """The ``matchmaking_time_s`` a run used: from its stored config (its model's table), else that
    table's default (:data:`ddlscope.distribution.collaborative.DEFAULT_MATCHMAKING_TIME_S` for hivemind).

    Raises:
        KeyError: ``strategy`` has no matchmaking (see :func:`matchmaking_applies`).
    """
    model = distribution.get(strategy)
    default = model.option_default(distribution.MATCHMAKING_OPTION)
    return float(config.get(model.config_table, {}).get(distribution.MATCHMAKING_OPTION, default))


@dataclass
class RoundObservation:
    """One averaging round (global epoch) of one run, as all its peers saw it. Times in seconds;
    ``param_spread``: how far the peers' parameters are apart after it, ``(max - min) / mean |c|``
    of their parameter checksums ``c`` (0: they agree; None: fewer than 2 peers recorded one)."""

    run_id: str
    epoch: int
    peers: list[int]
    group_sizes: list[int | None]
    arrival_spread_s: float | None
    mean_wait_s: float
    param_spread: float | None = None


@dataclass
class MatchmakingAnalysis:
    """Rounds, waits and the recommendation for a set of collaborative runs (see the module docstring).

    Times in seconds; ``solo_share`` and ``failed_share`` are fractions of peer-rounds (0..1).
    """

    run_ids: list[str]
    configured_matchmaking_s: list[float]
    peer_rounds: int
    group_size_counts: dict[int, int]
    solo_share: float | None
    failed_share: float | None
    mean_wait_s: float | None
    max_wait_s: float | None
    step_s: float | None
    epoch_s: float | None
    spread_s: float | None
    recommended_s: float | None
    verdict: str
    partial_share: float | None = None  # None: some run's peers did not count partial rounds
    join_timeout_share: float | None = None  # None: some run's peers did not count join timeouts
    rule: str = RULE
    rounds: list[RoundObservation] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (group size keys as strings)."""
        d = asdict(self)
        d["group_size_counts"] = {str(k): v for k, v in self.group_size_counts.items()}
        return d

    def markdown(self) -> str:
        """The analysis as a Markdown section: inputs, rule, recommendation and per-round table."""
        f = _f
        sizes = ", ".join(f"{k}: {v}" for k, v in sorted(self.group_size_counts.items(), key=lambda kv: str(kv[0])))
        lines = [
            f"Runs: {', '.join(f'`{r}`' for r in self.run_ids)}; configured matchmaking_time_s: "
            f"{', '.join(f'{m:g}' for m in self.configured_matchmaking_s) or '-'}.", "",
            "| peer-rounds | group sizes (size: count) | solo share | failed share | partial share | "
            "join timeout share | mean wait s | max wait s | step s | global epoch s | arrival spread p90 s | "
            "recommended s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            f"| {self.peer_rounds} | {sizes or '-'} | {f(self.solo_share, '.0%')} | {f(self.failed_share, '.0%')} | "
            f"{f(self.partial_share, '.0%')} | {f(self.join_timeout_share, '.0%')} | "
            f"{f(self.mean_wait_s)} | {f(self.max_wait_s)} | {f(self.step_s, '.3f')} | {f(self.epoch_s)} | "
            f"{f(self.spread_s, '.3f')} | {f(self.recommended_s)} |", "",
            f"**Recommendation**: {self.verdict}", "", f"Rule: {self.rule}.", "",
        ]
        if self.rounds:
            lines += ["Parameter spread: how far the peers' parameters are apart after the round, (max - min) / mean "
                      "of their parameter checksums (0 when they agree; Moshpit-style groups bring it down over rounds).",
                      "", "| run | epoch | peers | group sizes | arrival spread s | mean wait s | parameter spread |",
                      "|---|---|---|---|---|---|---|"]
            lines += [f"| {r.run_id} | {r.epoch} | {len(r.peers)} | {r.group_sizes} | {f(r.arrival_spread_s, '.3f')} | "
                      f"{r.mean_wait_s:.2f} | {f(r.param_spread, '.2e')} |" for r in self.rounds]
        return "\n".join(lines) + "\n"


def _f(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def nearest_rank(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1): the ceil(q x n)-th smallest value.

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("nearest_rank of no values")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def recommend_matchmaking_s(spread_s: float | None, step_s: float) -> float:
    """``matchmaking_time_s`` by :data:`RULE`; with no spread observed, ``MIN_STEP_TIMES`` step times."""
    floor = MIN_STEP_TIMES * step_s
    if spread_s is None:
        return floor
    return max(spread_s + max(MARGIN_FRACTION * spread_s, step_s), floor)


def rounds_of_run(run_id: str, steps: list[dict], checksums: dict[tuple[int, int], float] | None = None
                  ) -> list[RoundObservation]:
    """Group a run's round steps by global epoch (see the module docstring for arrival and wait).

    Args:
        checksums: ``(worker_index, epoch) -> parameter checksum`` after the round (the
            ``averaging_round`` events' ``param_checksum``), for each round's ``param_spread``.
    """
    by_epoch: dict[int, list[dict]] = {}
    for s in steps:
        if s["averaging_round"] and s["global_epoch"] is not None:
            by_epoch.setdefault(int(s["global_epoch"]), []).append(s)
    out = []
    for epoch, rows in sorted(by_epoch.items()):
        arrivals = [_arrival(s) for s in rows]
        out.append(RoundObservation(
            run_id=run_id, epoch=epoch, peers=[s["worker_index"] for s in rows],
            group_sizes=[s["averaging_group_size"] for s in rows],
            arrival_spread_s=max(arrivals) - min(arrivals) if len(rows) >= 2 else None,
            mean_wait_s=statistics.fmean(s["averaging_s"] or 0.0 for s in rows),
            param_spread=param_spread([(checksums or {}).get((s["worker_index"], epoch)) for s in rows])))
    return out


def param_spread(checksums: list[float | None]) -> float | None:
    """``(max - min) / mean |c|`` of the known checksums; None with fewer than 2 (or all zero)."""
    known = [c for c in checksums if c is not None]
    scale = statistics.fmean(abs(c) for c in known) if len(known) >= 2 else 0.0
    return (max(known) - min(known)) / scale if scale > 0 else None


def round_checksums(events: list[dict]) -> dict[tuple[int, int], float]:
    """``(worker_index, epoch) -> param_checksum`` from a run's ``averaging_round`` events."""
    import json

    out = {}
    for e in events:
        if e["kind"] == "averaging_round" and e["worker_index"] is not None:
            detail = json.loads(e["detail_json"] or "{}")
            if detail.get("param_checksum") is not None and detail.get("epoch") is not None:
                out[(e["worker_index"], int(detail["epoch"]))] = float(detail["param_checksum"])
    return out


def _arrival(step: dict) -> float:
    return step["wall_time"] + (step["data_load_s"] or 0.0) + (step["forward_s"] or 0.0) + (step["backward_s"] or 0.0)


def _epoch_gaps(steps: list[dict]) -> list[float]:
    """Seconds between a peer's consecutive round arrivals, for every peer."""
    gaps = []
    for w in sorted({s["worker_index"] for s in steps}):
        times = [_arrival(s) for s in steps if s["worker_index"] == w and s["averaging_round"]]
        gaps += [b - a for a, b in zip(times, times[1:])]
    return gaps


def analyze_matchmaking(store: ResultsStore, run_ids: list[str]) -> MatchmakingAnalysis:
    """Measure rounds, group sizes and waits of collaborative runs and recommend a matchmaking time.

    Runs are pooled: their arrival spreads, waits, step times and epoch gaps form one sample (use
    one run, or runs of one setup). Runs of models without matchmaking are ignored.

    Raises:
        KeyError: an unknown run id.
    """
    rounds, peer_rows, step_times, gaps, configured, used = [], [], [], [], set(), []
    # (run, peer, epoch) of the peer-rounds with a partial round, and with a join request that timed out
    partial: set[tuple[str, int, int]] | None = set()
    stalled: set[tuple[str, int, int]] | None = set()
    for run_id in run_ids:
        cfg = store.run_config(run_id)  # KeyError for an unknown run
        strategy = store.run(run_id)["strategy"]
        if not matchmaking_applies(strategy):
            continue
        used.append(run_id)
        configured.add(configured_matchmaking_s(strategy, cfg))
        steps = store.rows("steps", run_id)
        events = store.rows("events", run_id)
        rounds += rounds_of_run(run_id, steps, round_checksums(events))
        mine = [s for s in steps if s["averaging_round"]]
        peer_rows += [dict(s, run_id=run_id) for s in mine]
        partial = _peer_rounds_with(run_id, events, mine, partial, "partial_average")
        stalled = _peer_rounds_with(run_id, events, mine, stalled, "join_timeout")
        step_times += [s["step_s"] for s in steps if not s["warmup"] and not s["averaging_round"] and s["step_s"]]
        gaps += _epoch_gaps(steps)
    sizes = Counter(s["averaging_group_size"] for s in peer_rows)
    known = [s for s in peer_rows if s["averaging_group_size"] is not None]
    waits = [s["averaging_s"] or 0.0 for s in peer_rows]
    spreads = [r.arrival_spread_s for r in rounds if r.arrival_spread_s is not None]
    step_s = statistics.median(step_times) if step_times else None
    spread_s = nearest_rank(spreads, SPREAD_QUANTILE) if spreads else None
    analysis = MatchmakingAnalysis(
        run_ids=used, configured_matchmaking_s=sorted(configured), peer_rounds=len(peer_rows),
        group_size_counts=dict(sorted(sizes.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))),
        solo_share=sum(1 for s in known if s["averaging_group_size"] == 1) / len(known) if known else None,
        failed_share=sum(1 for s in peer_rows if s["averaging_succeeded"] == 0) / len(peer_rows) if peer_rows else None,
        mean_wait_s=statistics.fmean(waits) if waits else None, max_wait_s=max(waits) if waits else None,
        step_s=step_s, epoch_s=statistics.median(gaps) if gaps else None, spread_s=spread_s,
        recommended_s=None, verdict="", rounds=rounds,
        partial_share=_share_of(peer_rows, partial), join_timeout_share=_share_of(peer_rows, stalled))
    analysis.recommended_s = _recommended(analysis)
    analysis.verdict = _verdict(analysis)
    return analysis


def _peer_rounds_with(run_id: str, events: list[dict], rounds: list[dict], found: set[tuple[str, int, int]] | None,
                      kind: str) -> set[tuple[str, int, int]] | None:
    """``found`` with ``(run_id, peer, epoch)`` of the run's ``kind`` events (``partial_average`` or
    ``join_timeout``) added; None where ``found`` is None or a peer of ``rounds`` did not count them (its
    ``strategy_details`` do not say so)."""
    import json

    from ddlscope.analyze.swarm import rounds_with

    if found is None or any(rounds_with(events, w, kind) is None for w in {s["worker_index"] for s in rounds}):
        return None
    return found | {(run_id, e["worker_index"], json.loads(e["detail_json"] or "{}").get("epoch"))
                    for e in events if e["kind"] == kind}


def _share_of(peer_rows: list[dict], found: set[tuple[str, int, int]] | None) -> float | None:
    """The fraction of ``peer_rows`` (round steps with ``run_id``) whose ``(run, peer, epoch)`` is in ``found``."""
    if found is None or not peer_rows:
        return None
    return sum((s["run_id"], s["worker_index"], s["global_epoch"]) in found for s in peer_rows) / len(peer_rows)


def _too_solo(a: MatchmakingAnalysis) -> bool:
    return a.solo_share is not None and a.solo_share >= SOLO_SHARE_TOO_SHORT


def _recommended(a: MatchmakingAnalysis) -> float | None:
    """:func:`recommend_matchmaking_s`, raised to the configured time when the solo share is high (module docstring)."""
    if a.step_s is None:
        return None
    value = recommend_matchmaking_s(a.spread_s, a.step_s)
    if _too_solo(a) and a.configured_matchmaking_s:
        value = max(value, max(a.configured_matchmaking_s))
    return value


def _verdict(a: MatchmakingAnalysis) -> str:
    """One paragraph: the recommended value and what the measurements say about the current one."""
    if not a.run_ids:
        return "no runs with matchmaking: nothing to analyze."
    if a.recommended_s is None or not a.peer_rounds:
        return "no averaging rounds were recorded; run longer or with a smaller target_batch_size."
    basis = (f"arrival spread p90 {a.spread_s:.2f} s" if a.spread_s is not None
             else "no round was reached by two peers, so only the step-time floor applies")
    rule_s = recommend_matchmaking_s(a.spread_s, a.step_s)
    current = max(a.configured_matchmaking_s) if a.configured_matchmaking_s else None
    if current is not None and _too_solo(a) and current >= rule_s:
        lone = sum(1 for r in a.rounds if len(r.peers) == 1)
        text = (f"keep matchmaking_time_s at {current:g} s, do not shorten it: {a.solo_share:.0%} of peer-rounds "
                f"averaged alone although it already covers the rule's {rule_s:.1f} s ({basis}; step time "
                f"{a.step_s:.3f} s), so a longer or shorter window is not the cause: {lone} of {len(a.rounds)} rounds "
                f"were reached by one peer only (peers at different global epochs), or matchmaking failed.")
    else:
        text = f"set matchmaking_time_s to about {a.recommended_s:.1f} s ({basis}; step time {a.step_s:.3f} s)."
        if current is not None and _too_solo(a):
            text += f" The configured {current:g} s is too short: {a.solo_share:.0%} of peer-rounds averaged alone."
        elif current is not None and current > 2 * a.recommended_s:
            text += (f" The configured {current:g} s is too long: peers waited {a.mean_wait_s:.2f} s per round on "
                     f"average, about {current - a.recommended_s:.1f} s more than needed.")
        elif current is not None and current < a.recommended_s and a.solo_share is not None:
            text += (f" The configured {current:g} s is shorter and still works: {a.solo_share:.0%} of peer-rounds "
                     f"averaged alone; the rule's value adds margin for slower arrivals.")
        elif current is not None:
            text += f" The configured {current:g} s is in range."
    if a.partial_share:
        text += (f" {a.partial_share:.0%} of peer-rounds were partial: hivemind dropped chunks that did not arrive "
                 "within next_chunk_timeout and averaged those parts without them. Unless "
                 "collaborative.next_chunk_timeout_s sets it, that timeout is the matchmaking time, so a shorter "
                 "matchmaking time drops more; set next_chunk_timeout_s above the longest wait for a chunk (on a "
                 "200/20 Mbit/s pair 5 s carried whole rounds, which took twice as long: docs/swarms.md).")
    if a.join_timeout_share:
        text += (f" {a.join_timeout_share:.0%} of peer-rounds began late because a join request went unanswered "
                 "for hivemind's request_timeout (3 s): two peers asked each other to lead at once, as where their "
                 "matchmaking starts together when a parameter round frees a slow link (docs/swarms.md).")
    if a.epoch_s is not None and a.recommended_s > 0.5 * a.epoch_s:
        text += (f" It exceeds half a global epoch ({a.epoch_s:.2f} s): averaging dominates; raise "
                 f"target_batch_size rather than lengthening matchmaking.")
    return text


def print_matchmaking(a: MatchmakingAnalysis, console=None) -> None:
    """Print the analysis to a terminal with rich: a summary table, the recommendation, the rule and
    the per-round table (what :meth:`MatchmakingAnalysis.markdown` writes, rendered, not raw Markdown).

    Args:
        console: a :class:`rich.console.Console`; default one on stdout at the terminal's width.
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    f = _f
    console.print(f"runs: {', '.join(a.run_ids) or '-'}; configured matchmaking_time_s: "
                  f"{', '.join(f'{m:g}' for m in a.configured_matchmaking_s) or '-'}")
    summary = Table(title="matchmaking")
    cols = ["peer-rounds", "group sizes (size: count)", "solo share", "failed share", "partial share",
            "join timeout share", "mean wait s", "max wait s", "step s", "global epoch s", "arrival spread p90 s",
            "recommended s"]
    for col in cols:
        summary.add_column(col, justify="right", overflow="fold")
    sizes = ", ".join(f"{k}: {v}" for k, v in sorted(a.group_size_counts.items(), key=lambda kv: str(kv[0])))
    summary.add_row(str(a.peer_rounds), sizes or "-", f(a.solo_share, ".0%"), f(a.failed_share, ".0%"),
                    f(a.partial_share, ".0%"), f(a.join_timeout_share, ".0%"), f(a.mean_wait_s), f(a.max_wait_s),
                    f(a.step_s, ".3f"), f(a.epoch_s), f(a.spread_s, ".3f"), f(a.recommended_s))
    console.print(summary)
    console.print(f"[bold]recommendation[/bold]: {escape(a.verdict)}")
    console.print(f"rule: {escape(a.rule)}.")
    if a.rounds:
        rounds = Table(title="rounds (parameter spread: (max - min) / mean of the peers' parameter checksums after it)")
        for col in ("run", "epoch", "peers", "group sizes", "arrival spread s", "mean wait s", "parameter spread"):
            rounds.add_column(col, justify="left" if col == "run" else "right", overflow="fold")
        for r in a.rounds:
            rounds.add_row(r.run_id, str(r.epoch), str(len(r.peers)), escape(str(r.group_sizes)),
                           f(r.arrival_spread_s, ".3f"), f"{r.mean_wait_s:.2f}", f(r.param_spread, ".2e"))
        console.print(rounds)
