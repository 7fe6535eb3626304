"""Is training input-bound with a given data pipeline, and which pipeline to use.

Training consumes ``batch_size / compute_step_s`` samples/s (compute = forward + backward +
optimizer). A pipeline that delivers fewer samples/s than that makes training wait for data:
it is *input-bound* (Isenko et al., SIGMOD 2022, "Where Is My Training Bottleneck?", compare a
preprocessing pipeline's throughput with the model's training throughput in the same way).

What training then achieves is estimated from the two rates: with loader workers (>= 1) loading
overlaps compute, so ``min(loader, training)``; with 0 workers the batch is loaded in the training
process between steps, so the times add: ``1 / (1 / loader + 1 / training)``. Both assume the
loader keeps the speed measured alone, which is optimistic when its workers share cores with training.
"""

from __future__ import annotations

import dataclasses

from ddlscope.datapipe.caches import PREPROCESSED, STRATEGIES


@dataclasses.dataclass
class OptionResult:
    """One (strategy, loader workers) option, measured.

    Attributes:
        strategy: one of ``STRATEGIES``; workers: DataLoader worker processes.
        samples_per_s: loader throughput measured alone (samples/s).
        storage_bytes, storage_location, build_s, online_augmentation: see
            :class:`ddlscope.datapipe.caches.StrategyData`.
        input_bound: ``samples_per_s < training_samples_per_s`` (None until judged).
        expected_training_samples_per_s: what training would reach with this loader (see module doc).
    """

    strategy: str
    workers: int
    samples_per_s: float
    storage_bytes: int
    storage_location: str
    build_s: float
    online_augmentation: bool
    input_bound: bool | None = None
    expected_training_samples_per_s: float | None = None


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """The option to use, and one sentence saying why; ``input_bound`` is True when none keeps up."""

    strategy: str
    workers: int
    input_bound: bool
    explanation: str


def training_samples_per_s(batch_size: int, compute_step_s: float) -> float:
    """Samples/s training consumes: ``batch_size / compute_step_s``.

    Raises:
        ValueError: batch_size < 1 or compute_step_s <= 0.
    """
    if batch_size < 1 or not compute_step_s > 0:
        raise ValueError(f"need batch_size >= 1 and compute_step_s > 0, got {batch_size} and {compute_step_s}")
    return batch_size / compute_step_s


def is_input_bound(loader_samples_per_s: float, training_samples_per_s: float) -> bool:
    """True when the loader delivers fewer samples/s than training consumes."""
    return loader_samples_per_s < training_samples_per_s


def expected_training_samples_per_s(loader_samples_per_s: float, training_samples_per_s: float,
                                    workers: int) -> float:
    """Training samples/s with this loader: ``min`` of the rates with workers >= 1, the harmonic
    combination ``1 / (1/loader + 1/training)`` with 0 workers (loading and compute take turns)."""
    if workers == 0:
        return 1.0 / (1.0 / loader_samples_per_s + 1.0 / training_samples_per_s)
    return min(loader_samples_per_s, training_samples_per_s)


def judge(options: list[OptionResult], training_samples_per_s: float) -> None:
    """Fill in ``input_bound`` and ``expected_training_samples_per_s`` of every option, in place."""
    for option in options:
        option.input_bound = is_input_bound(option.samples_per_s, training_samples_per_s)
        option.expected_training_samples_per_s = expected_training_samples_per_s(
            option.samples_per_s, training_samples_per_s, option.workers)


def _describe(option: OptionResult) -> str:
    return f"{option.strategy} with {option.workers} loader worker{'s' if option.workers != 1 else ''}"


def recommend(options: list[OptionResult], training_samples_per_s: float) -> Recommendation:
    """The cheapest option that is not input-bound; if every option is, the fastest one.

    Cheapest: strategies in the order of ``STRATEGIES`` (no preparation, then a RAM cache rebuilt
    per training start, then a disk cache built once, then a 4x larger preprocessed copy without
    online augmentation), then fewer loader workers (they take cores from training).

    Raises:
        ValueError: no options.
    """
    if not options:
        raise ValueError("no options to recommend from")
    judge(options, training_samples_per_s)
    need = f"the {training_samples_per_s:,.0f} samples/s training consumes"
    by_cost = sorted(options, key=lambda o: (STRATEGIES.index(o.strategy), o.workers))
    chosen = next((o for o in by_cost if not o.input_bound), None)
    if chosen is None:
        fastest = max(options, key=lambda o: o.samples_per_s)
        return Recommendation(fastest.strategy, fastest.workers, True,
                              f"No option keeps up with {need}; the fastest, {_describe(fastest)} "
                              f"({fastest.samples_per_s:,.0f} samples/s), loses the least time, and training "
                              "stays input-bound (more loader cores or a lighter pipeline would help).")
    if chosen is by_cost[0] or chosen.strategy == by_cost[0].strategy:
        why = (f"{_describe(chosen)} delivers {chosen.samples_per_s:,.0f} samples/s, at least {need}, "
               "so no cache or preprocessed copy is worth its build time or storage"
               + (f" (with 0 workers loading takes turns with compute: about "
                  f"{chosen.expected_training_samples_per_s:,.0f} samples/s)." if chosen.workers == 0 else "."))
    else:
        cheaper = [o for o in by_cost if STRATEGIES.index(o.strategy) < STRATEGIES.index(chosen.strategy)]
        best_cheaper = max(cheaper, key=lambda o: o.samples_per_s)
        why = (f"The cheaper {best_cheaper.strategy} reaches at most {best_cheaper.samples_per_s:,.0f} samples/s, "
               f"below {need}; {_describe(chosen)} keeps up ({chosen.samples_per_s:,.0f} samples/s) "
               f"for {chosen.storage_bytes / 1e6:,.1f} MB in {chosen.storage_location} and "
               f"{chosen.build_s:.1f} s to build"
               + (", but it gives up online augmentation." if chosen.strategy == PREPROCESSED
                  and any(o.online_augmentation for o in options) else "."))
    return Recommendation(chosen.strategy, chosen.workers, False, why)
