"""Tests of the dmoe torch side: experts, the local mixture (against hivemind 1.1.12's gating and
beam search), the moe networks, the python-docs corpus and the per-position losses."""

from __future__ import annotations

import functools
import math
import textwrap
import types

import pytest
import torch
from torch import nn

from ddlscope.distribution.dmoe import DMoEConfig
from ddlscope.errors import UserError
from ddlscope.moe.experts import args_schema, check_expert, expert_sample_input, expert_seed, make_expert
from ddlscope.moe.layers import DenseExpert, LocalMixtureOfExperts, grid_uids
from ddlscope.moe.networks import MOE_NETWORKS, build_moe_network, network_family_ok
from ddlscope.workloads import text
from ddlscope.workloads.step import IGNORE_INDEX, correct_samples, flatten_sequence, loss_function


class Scale(nn.Module):
    """Expert ``x -> factor * x + shift`` (distinct, checkable outputs per expert)."""

    def __init__(self, factor: float, shift: float = 0.0):
        super().__init__()
        self.factor = nn.Parameter(torch.tensor(float(factor)))
        self.shift = shift

    def forward(self, x, *args):
        return self.factor * x + self.shift


def _scale_experts(grid):
    return {uid: Scale(1.0 + i, shift=float(i)) for i, uid in enumerate(grid_uids(grid))}


# ---------------------------------------------------------------- the local mixture


def test_grid_uids_follow_the_config():
    cfg = DMoEConfig(grid_size=[2, 3, 2], k_best=2)
    assert grid_uids(cfg.grid_size) == cfg.expert_uids()
    assert grid_uids([2, 2])[:3] == ["expert.0.0", "expert.0.1", "expert.1.0"]


def test_local_moe_equals_a_hand_computation():
    grid, k = (2, 3), 2
    moe = LocalMixtureOfExperts(4, grid, _scale_experts(grid), k_best=k)
    with torch.no_grad():
        moe.proj.weight.copy_(torch.arange(20.0).view(5, 4).sin())
        moe.proj.bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.5, -0.4]))
    x = torch.randn(6, 4)
    out = moe(x)

    uids = grid_uids(grid)
    expected, load = [], dict.fromkeys(uids, 0)
    for row in x:
        s = moe.proj(row).tolist()
        scores = {f"expert.{i}.{j}": s[i] + s[2 + j] for i in range(2) for j in range(3)}
        best = sorted(scores, key=scores.get, reverse=True)[:k]
        z = [math.exp(scores[u]) for u in best]
        weights = [w / sum(z) for w in z]
        expected.append(sum(w * moe.experts[u.replace(".", "_")](row) for w, u in zip(weights, best)))
        for u in best:
            load[u] += 1
        assert sorted(best) == sorted(moe.chosen_uids()[len(expected) - 1])
    assert torch.allclose(out, torch.stack(expected), atol=1e-6)
    assert moe.last_load == load and sum(load.values()) == 6 * k


def test_gradient_reaches_the_gate_and_only_the_chosen_experts():
    grid = (2, 2)
    moe = LocalMixtureOfExperts(3, grid, _scale_experts(grid), k_best=2)
    with torch.no_grad():  # row 0 prefers index 0 of dimension 0; dimension 1 always prefers index 1
        moe.proj.weight.zero_()
        moe.proj.bias.copy_(torch.tensor([5.0, 0.0, 0.0, 9.0]))
    out = moe(torch.randn(4, 3))
    out.pow(2).sum().backward()
    assert moe.chosen_uids() == [["expert.0.1", "expert.1.1"]] * 4
    assert moe.proj.weight.grad is not None and moe.proj.bias.grad.abs().sum() > 0
    grads = {uid: moe.experts[uid.replace(".", "_")].factor.grad for uid in moe.uids}
    assert grads["expert.0.0"] is None and grads["expert.1.0"] is None
    assert grads["expert.0.1"] != 0 and grads["expert.1.1"] != 0
    assert moe.last_load == {"expert.0.0": 0, "expert.0.1": 4, "expert.1.0": 0, "expert.1.1": 4}


def test_sequence_input_gates_on_the_mean_and_passes_extra_arguments_per_sample():
    class MaskAware(nn.Module):
        def __init__(self, tag: float):
            super().__init__()
            self.tag = tag

        def forward(self, x, mask):  # [n, T, H], [n, T]: adds the sample's count of masked positions
            return x + self.tag + mask.sum(1, dtype=x.dtype)[:, None, None]

    grid = (3,)
    moe = LocalMixtureOfExperts(4, grid, {u: MaskAware(10.0 * i) for i, u in enumerate(grid_uids(grid))}, k_best=1)
    x = torch.randn(5, 7, 4)
    mask = torch.zeros(5, 7, dtype=torch.bool)
    mask[torch.arange(5), torch.arange(5)] = True
    mask[4] = True  # sample 4 has 7 masked positions
    out = moe(x, mask)
    chosen = moe.last_choice[:, 0]
    assert torch.equal(chosen, moe.proj(x.mean(1)).argmax(1))  # gate on the mean over the sequence
    expected = x + 10.0 * chosen[:, None, None] + mask.sum(1)[:, None, None]  # k_best = 1: weight 1
    assert torch.allclose(out, expected)


def test_bad_expert_set_and_k_are_refused():
    with pytest.raises(ValueError, match="missing"):
        LocalMixtureOfExperts(4, (2, 2), {"expert.0.0": nn.Identity()}, k_best=1)
    with pytest.raises(ValueError, match="k_best"):
        LocalMixtureOfExperts(4, (2,), _scale_experts((2,)), k_best=3)


def test_expert_scores_equal_hivemind_compute_expert_scores():
    from hivemind.moe import RemoteMixtureOfExperts

    grid = (3, 2, 2)
    moe = LocalMixtureOfExperts(5, grid, _scale_experts(grid), k_best=3)
    grid_scores = moe.proj(torch.randn(4, 5)).split_with_sizes(grid, dim=-1)
    mine = moe.expert_scores(grid_scores)
    # hivemind's method only reads self.beam_search.uid_prefix and each expert's uid
    remote_like = types.SimpleNamespace(beam_search=types.SimpleNamespace(uid_prefix="expert."))
    every_expert = [[types.SimpleNamespace(uid=u) for u in moe.uids]] * 4
    theirs = RemoteMixtureOfExperts.compute_expert_scores(remote_like, list(grid_scores), every_expert)
    assert torch.allclose(mine, theirs)


def test_choice_and_output_equal_hivemind_beam_search_over_a_dht():
    """All experts declared alive in a real DHT: hivemind's beam search picks the experts the local
    mixture picks, and hivemind's weighting (compute_expert_scores, softmax) gives the same output."""
    hivemind = pytest.importorskip("hivemind")
    from hivemind.moe import RemoteMixtureOfExperts
    from hivemind.moe.client.beam_search import MoEBeamSearcher
    from hivemind.moe.server.dht_handler import declare_experts
    from hivemind.utils import get_dht_time

    torch.manual_seed(3)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        for grid, k in (((3, 4), 3), ((5,), 2), ((2, 2, 3), 4)):
            uids = grid_uids(grid)
            assert all(declare_experts(dht, uids, expiration_time=get_dht_time() + 60).values())
            moe = LocalMixtureOfExperts(6, grid, _scale_experts(grid), k_best=k)
            x = torch.randn(12, 6)
            out = moe(x)
            grid_scores = moe.proj(x).split_with_sizes(grid, dim=-1)
            searcher = MoEBeamSearcher(dht, "expert.", grid)
            # batch_find_best_experts minus its last step (making RemoteExpert stubs, which needs a
            # p2p replica in this process that hivemind cannot close cleanly): ExpertInfo(uid, peer)
            found = dht.run_coroutine(functools.partial(
                MoEBeamSearcher._batch_find_best_experts, prefix=searcher.uid_prefix, beam_size=k,
                batch_grid_scores=[s.detach().numpy() for s in grid_scores], negative_caching=True, num_workers=None))
            assert [sorted(e.uid for e in row) for row in found] == [sorted(r) for r in moe.chosen_uids()]
            remote_like = types.SimpleNamespace(beam_search=searcher)
            weights = torch.softmax(RemoteMixtureOfExperts.compute_expert_scores(remote_like, list(grid_scores), found), 1)
            expected = torch.stack([sum(w * moe.experts[e.uid.replace(".", "_")](x[b]) for w, e in zip(weights[b], row))
                                    for b, row in enumerate(found)])
            assert torch.allclose(out, expected, atol=1e-5)
    finally:
        dht.shutdown()


def test_dense_expert_applies_one_expert_to_every_sample():
    block = nn.Linear(4, 4)
    dense = DenseExpert(block)
    x = torch.randn(3, 4)
    assert torch.equal(dense(x), block(x)) and dense.last_load == {"dense": 3}
    dense(x).sum().backward()
    assert block.weight.grad is not None


# ---------------------------------------------------------------- experts


def _factory_module(tmp_path, monkeypatch, body: str) -> str:
    (tmp_path / "h1_user_experts.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "h1_user_experts"


def test_builtin_experts_and_schemas():
    assert isinstance(make_expert("ffn", 32), nn.Module)
    x, mask = expert_sample_input("transformer", 2, 16)
    assert x.shape == (2, 128, 16) and x.dtype == torch.float32 and mask.shape == (2, 128) and not mask.any()
    check_expert("ffn", 32)
    check_expert("transformer", 16)
    ffn, = args_schema("ffn", 32)
    seq, pad = args_schema("transformer", 16)
    assert ffn.shape == (None, 32) and seq.shape == (None, 128, 16) and seq.dtype == torch.float32
    assert pad.shape == (None, 128) and pad.dtype == torch.bool


def test_user_factory_expert(tmp_path, monkeypatch):
    module = _factory_module(tmp_path, monkeypatch, """
        import torch
        def good(h):
            return torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.Tanh())
        def wrong_shape(h):
            return torch.nn.Linear(h, h + 1)
        def not_a_module(h):
            return h
        def fails(h):
            raise RuntimeError("no GPU here")
        VALUE = 3
    """)
    block = make_expert(f"{module}:good", 8)
    assert block(torch.randn(2, 8)).shape == (2, 8)
    assert [t.shape for t in expert_sample_input(f"{module}:good", 5, 8)] == [(5, 8)]
    check_expert(f"{module}:good", 8)
    with pytest.raises(UserError, match=r"dmoe.expert = .*wrong_shape.* maps inputs of shape \[2, 8\] float32 to "
                                        r"\[2, 9\]; allowed: an output of the first input's shape \[2, 8\]"):
        check_expert(f"{module}:wrong_shape", 8)
    for target, message in ((f"{module}:not_a_module", "returned int, not a torch.nn.Module"),
                            (f"{module}:fails", "raised RuntimeError: no GPU here"),
                            (f"{module}:VALUE", "has no callable 'VALUE'"),
                            (f"{module}:missing", "has no callable 'missing'"),
                            ("h1_no_such_module:f", "cannot import 'h1_no_such_module' .ModuleNotFoundError"),
                            ("no_colon", "allowed: ffn, transformer or 'package.module:factory'")):
        with pytest.raises(UserError, match=f"dmoe.expert = .*{message}"):
            make_expert(target, 8)


def test_expert_seed_gives_the_same_expert_everywhere():
    torch.manual_seed(expert_seed(7, "expert.1.0"))
    a = make_expert("ffn", 8)
    torch.manual_seed(expert_seed(7, "expert.1.0"))
    b = make_expert("ffn", 8)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert expert_seed(7, "expert.1.0") != expert_seed(7, "expert.0.1") - 1


# ---------------------------------------------------------------- networks


def _grads_everywhere(net: nn.Module, skip: str = "moe.experts") -> list[str]:
    return [n for n, p in net.named_parameters() if p.grad is None and not n.startswith(skip)]


@pytest.mark.parametrize("family, shape", [("mnist", (1, 28, 28)), ("digits", (1, 28, 28)), ("cifar10", (3, 32, 32))])
@pytest.mark.parametrize("placement", ["local", "dense"])
def test_moe_cnn_forward_backward(family, shape, placement):
    torch.manual_seed(0)
    d = DMoEConfig(placement=placement, hidden_dim=16, grid_size=[2, 3], k_best=2)
    net = build_moe_network("moe_cnn", family, 10, d)
    x, y = torch.randn(5, *shape), torch.randint(0, 10, (5,))
    logits = net(x)
    assert logits.shape == (5, 10)
    loss_function()(logits, y).backward()
    assert not _grads_everywhere(net)
    if placement == "local":
        assert isinstance(net.moe, LocalMixtureOfExperts) and net.moe.proj.weight.grad is not None
        assert sum(net.moe.last_load.values()) == 5 * 2 and len(net.moe.uids) == 6
    else:
        assert isinstance(net.moe, DenseExpert)


@pytest.mark.parametrize("placement", ["local", "dense"])
def test_moe_lm_forward_backward(placement):
    torch.manual_seed(0)
    d = DMoEConfig(placement=placement, expert="transformer", hidden_dim=16, grid_size=[3], k_best=2)
    net = build_moe_network("moe_lm", "text", 256, d)
    dataset = text.python_docs("test")
    x, y = (torch.stack(t) for t in zip(dataset[0], dataset[1]))
    logits = net(x)
    assert logits.shape == (2, 128, 256)
    loss = loss_function()(logits, y)
    assert abs(loss.item() - math.log(256)) < 1.0  # near uniform at the start
    loss.backward()
    assert not _grads_everywhere(net) and net.embed.weight.grad[text.MASK_TOKEN].abs().sum() > 0


def test_networks_refuse_what_does_not_fit():
    assert network_family_ok("moe_cnn", "mnist", "ffn") is None and network_family_ok("moe_lm", "text") is None
    assert "allowed: moe_cnn, moe_lm" in network_family_ok("resnet18", "mnist")
    assert "use model = 'moe_lm'" in network_family_ok("moe_cnn", "text")
    assert "allowed families: mnist, digits, cifar10" in network_family_ok("moe_cnn", "imagenet")
    with pytest.raises(UserError, match="dmoe.expert = 'transformer' does not fit model = 'moe_cnn'.*allowed: 'ffn'"):
        build_moe_network("moe_cnn", "mnist", 10, DMoEConfig(expert="transformer", placement="local"))
    with pytest.raises(UserError, match="dmoe.expert = 'ffn' does not fit model = 'moe_lm'.*allowed: 'transformer'"):
        build_moe_network("moe_lm", "text", 256, DMoEConfig(expert="ffn", placement="local"))
    with pytest.raises(UserError, match="model = 'moe_lm' does not take a dataset of family 'mnist'"):
        build_moe_network("moe_lm", "mnist", 10, DMoEConfig(expert="transformer", placement="local"))
    with pytest.raises(UserError, match="dmoe.placement = 'remote'"):
        build_moe_network("moe_cnn", "mnist", 10, DMoEConfig(placement="remote"))
    assert MOE_NETWORKS == ("moe_cnn", "moe_lm")


def test_a_given_mixture_is_used_as_the_moe_layer():
    mixture = DenseExpert(nn.Identity())
    net = build_moe_network("moe_cnn", "mnist", 10, DMoEConfig(placement="remote"), mixture=mixture)
    assert net.moe is mixture and net(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_seeded_local_experts_start_as_the_servers_and_leave_the_trunk_alone():
    d = DMoEConfig(placement="local", hidden_dim=8, grid_size=[2, 2], k_best=2)
    nets = []
    for seed in (5, 6):
        torch.manual_seed(0)
        nets.append(build_moe_network("moe_cnn", "mnist", 10, d, seed=seed))
    first, other = nets
    for uid in d.expert_uids():
        torch.manual_seed(expert_seed(5, uid))
        server_copy = make_expert("ffn", 8)
        local = first.moe.experts[uid.replace(".", "_")]
        assert all(torch.equal(p, q) for p, q in zip(local.parameters(), server_copy.parameters()))
    same = [n for n, p in first.named_parameters() if torch.equal(p, dict(other.named_parameters())[n])]
    assert {n.split(".")[0] for n in same} == {"trunk", "head", "moe"}
    assert "moe.proj.weight" in same and not [n for n in same if n.endswith("ffn.weight")]


# ---------------------------------------------------------------- the python-docs corpus


def test_python_docs_splits():
    from ddlscope.workloads.datasets import DATASETS, open_dataset
    from ddlscope.workloads.preprocessing import eval_transform, train_transform

    train, spec = open_dataset("python-docs", None, "train")
    test, _ = open_dataset("python-docs", None, "test")
    assert spec == DATASETS["python-docs"] and spec.family == "text" and spec.num_classes == 256
    assert spec.sample_shape == (128,) and spec.train_size == len(train) and 8 * len(test) < len(train) < 10 * len(test)
    assert len(test) == len(text.corpus_split("test")) // 128
    x, y = train[0]
    assert train_transform(spec)(x) is x and eval_transform(spec)(x) is x


@pytest.mark.parametrize("split", ["train", "test"])
def test_python_docs_windows_mask_bytes_and_keep_the_rest(split):
    data, dataset = text.corpus_split(split), text.python_docs(split)
    for i in (0, 1, len(dataset) - 1):
        x, y = dataset[i]
        original = torch.tensor(list(data[i * 128:(i + 1) * 128]))
        masked = x == text.MASK_TOKEN
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (128,)
        assert int(masked.sum()) == text.MASKED_PER_WINDOW
        assert torch.equal(y[masked], original[masked]) and (y[~masked] == IGNORE_INDEX).all()
        assert torch.equal(x[~masked], original[~masked])


def test_python_docs_masks_fixed_for_test_and_drawn_for_train():
    a, b = text.python_docs("test"), text.python_docs("test")
    assert all(torch.equal(a[i][0], b[i][0]) for i in range(5))
    train = text.python_docs("train")
    torch.manual_seed(1)
    first = train[3][0]
    torch.manual_seed(1)
    assert torch.equal(train[3][0], first)  # reproducible under the loop's seed
    assert not all(torch.equal(train[3][0], first) for _ in range(3))  # a new draw at every access


# ---------------------------------------------------------------- per-position losses and accuracy


def test_sequence_loss_accuracy_and_evaluation_count_scored_positions():
    from torch.utils.data import DataLoader, TensorDataset

    from ddlscope.strategies.base import Strategy
    from ddlscope.train.evaluation import evaluate

    logits = torch.randn(2, 3, 5)
    y = torch.tensor([[1, IGNORE_INDEX, 4], [IGNORE_INDEX, IGNORE_INDEX, 0]])
    flat_logits, flat_y = flatten_sequence(logits, y)
    assert flat_logits.shape == (6, 5) and flat_y.shape == (6,)
    scored = [(0, 0), (0, 2), (1, 2)]
    by_hand = [-torch.log_softmax(logits[b, t], 0)[y[b, t]] for b, t in scored]
    assert torch.allclose(loss_function()(logits, y), torch.stack(by_hand).mean())
    assert torch.allclose(loss_function("sum")(logits, y), torch.stack(by_hand).sum())
    hits = sum(int(logits[b, t].argmax() == y[b, t]) for b, t in scored)
    assert correct_samples(logits, y) == pytest.approx(2 * hits / 3)
    class_logits, labels = torch.randn(4, 5), torch.tensor([0, 1, 2, 3])
    assert correct_samples(class_logits, labels) == int((class_logits.argmax(1) == labels).sum())

    class Fixed(nn.Module):  # returns the prepared logits of the samples it is given (by index)
        def forward(self, index):
            return logits[index]

    loader = DataLoader(TensorDataset(torch.arange(2), y), batch_size=1)
    accuracy, mean_loss, seen = evaluate(Fixed(), loader, torch.device("cpu"))
    assert seen == 2 and accuracy == pytest.approx(hits / 3)
    assert mean_loss == pytest.approx(torch.stack(by_hand).mean().item(), rel=1e-5)

    model = nn.Sequential(nn.Embedding(7, 5))
    xs = torch.randint(0, 7, (2, 3))
    result = Strategy(None, None).forward_backward(model, xs, y, loss_function()).resolve()
    expected_hits = sum(int(model(xs)[b, t].argmax() == y[b, t]) for b, t in scored)
    assert result.samples == 2 and result.correct / result.samples == pytest.approx(expected_hits / 3)
    assert model[0].weight.grad is not None
