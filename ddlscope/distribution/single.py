"""``single``: one worker on one device, the baseline every speedup is measured against (thesis 002 ch. 4)."""

from __future__ import annotations

from ddlscope.distribution import DistributionModel, register
from ddlscope.modeling.cluster import ClusterSpec
from ddlscope.modeling.collectives import exposed_loading_s
from ddlscope.modeling.memory import MemoryEstimate, replicas
from ddlscope.modeling.prediction import Prediction, Setting, make_prediction
from ddlscope.modeling.profile import WorkloadProfile


def predict_single(profile: WorkloadProfile, cluster: ClusterSpec, s: Setting, scale: float = 1.0) -> Prediction:
    """One device: the measured forward, backward and optimizer step at the batch, plus exposed data loading.

    Thesis 002 ch. 4 extrapolates a few measured batches to the epoch; here the step is read
    off the profile at the batch size (interpolated between measured sizes) and multiplied by
    batches per epoch = ``epoch_samples / batch_size``. ``scale``: factor on every compute time.
    """
    step = profile.step_at(s.batch_size)
    parts = {"forward_s": step.forward_s * scale, "backward_s": step.backward_s * scale,
             "optimizer_s": step.optimizer_s * scale}
    parts["data_load_s"] = exposed_loading_s(profile, s.batch_size, s.loader_workers, sum(parts.values()))
    return make_prediction(s, parts, s.batch_size, inputs={"step_s": step.step_s, "compute_scale": scale})


def memory_single(profile: WorkloadProfile, s: Setting) -> list[MemoryEstimate]:
    """The full replica (notation of :mod:`ddlscope.modeling.memory`): ``params = P + Bf``,
    ``grads = G``, ``optimizer = O``, ``activations = A(b)``, no communication buffers."""
    return replicas(profile, s, 0, "full replica")


MODEL = register(DistributionModel(
    name="single",
    summary="one worker, one device: the baseline",
    strategy="single:SingleStrategy",
    launcher="process",
    measures="step parts (data loading, forward, backward, optimizer)",
    predicts="the profiled step at the batch plus exposed data loading (thesis 002 ch. 4)",
    order=0,
    min_workers=1,
    max_workers=1,
    baseline=True,
    cost_model=predict_single,
    memory_model=memory_single,
))
