"""Host metrics that must be honest: background CPU counts hivemind-like work only (not torch's
intra-op threads, not DataLoader workers), and TCP bytes that cannot be counted are unknown, not 0."""

from __future__ import annotations

import multiprocessing
import threading
import time

import psutil
import pytest
import torch

from ddlscope.measure import host
from ddlscope.measure.host import BackgroundCpu, HostSampler, TcpByteCounter, background_cpu_s

TICK_S = 0.03
"""Tolerance between two readings of the same kernel counters: a few 10 ms clock ticks."""


def _spin(cpu_s: float) -> None:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def _spin_then_wait(cpu_s: float, done: threading.Event, release: threading.Event) -> None:
    _spin(cpu_s)
    done.set()
    release.wait(60)


class _HivemindLikeProcess(multiprocessing.get_context("fork").Process):
    """A forked child of a Process subclass, as hivemind's DHT and averagers are; it spins, then waits."""

    def __init__(self, cpu_s: float, done, release):
        super().__init__(daemon=True)
        self.cpu_s, self.done, self.release = cpu_s, done, release

    def run(self) -> None:
        _spin(self.cpu_s)
        self.done.set()
        self.release.wait(60)


class _BusyItems(torch.utils.data.Dataset):
    """A dataset whose items cost CPU in the DataLoader worker that loads them."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        _spin(0.15)
        return torch.zeros(1)


def _cpu_s(times) -> float:
    return times.user + times.system


def test_background_cpu_counts_hivemind_like_threads_and_processes_not_torch_or_dataloader():
    """A 2-core peer: torch runs 2 intra-op threads of matmuls on the calling thread, a DataLoader
    worker loads busy items, and a hivemind-like Python thread and forked child spin. Background CPU
    is what the kernel counts for the spinning thread and child, nothing of torch's or the loader's."""
    torch.set_num_threads(2)
    ctx = multiprocessing.get_context("fork")
    loader = iter(torch.utils.data.DataLoader(_BusyItems(), batch_size=1, num_workers=1, multiprocessing_context=ctx))
    before = background_cpu_s()
    loader_pids = host._plain_multiprocessing_children()
    assert len(loader_pids) == 1
    loader_proc = psutil.Process(next(iter(loader_pids)))
    loader_before = _cpu_s(loader_proc.cpu_times())

    child_done, child_release = ctx.Event(), ctx.Event()
    child = _HivemindLikeProcess(0.3, child_done, child_release)
    child.start()
    done, release = threading.Event(), threading.Event()
    spinner = threading.Thread(target=_spin_then_wait, args=(0.3, done, release), daemon=True)
    spinner.start()
    python_tids = {t.native_id for t in threading.enumerate()}
    native_before = {t.id: t.user_time + t.system_time for t in psutil.Process().threads() if t.id not in python_tids}
    try:
        a = torch.randn(384, 384)
        for _ in range(200):  # several CPU-s on torch's intra-op pool
            a = torch.tanh(a @ a)
        for _ in range(4):
            next(loader)
        assert done.wait(60) and child_done.wait(60)
        torch_helpers_s = sum(t.user_time + t.system_time - native_before.get(t.id, 0.0)  # native threads
                              for t in psutil.Process().threads() if t.id not in python_tids)
        spinner_s = next(t.user_time + t.system_time for t in psutil.Process().threads() if t.id == spinner.native_id)
        child_s = _cpu_s(psutil.Process(child.pid).cpu_times())
        loader_s = _cpu_s(loader_proc.cpu_times()) - loader_before
        background = background_cpu_s() - before
    finally:
        release.set()
        child_release.set()
        spinner.join(10)
        child.join(10)
        del loader
    # the workload did what the test is about: torch's other intra-op thread and the loader worked
    assert torch_helpers_s > 0.1, f"torch's intra-op helper threads used only {torch_helpers_s:.2f} CPU-s"
    assert loader_s >= 0.5, f"the DataLoader worker used only {loader_s:.2f} CPU-s"
    assert background == pytest.approx(spinner_s + child_s, abs=TICK_S), (
        f"background {background:.3f} CPU-s vs spinner thread {spinner_s:.3f} + child {child_s:.3f}; torch's "
        f"helper threads used {torch_helpers_s:.3f}, the DataLoader worker {loader_s:.3f}")


def test_background_cpu_leaves_out_the_calling_thread_and_ddlscope_threads():
    before = background_cpu_s()
    _spin(0.2)  # the calling thread's own CPU
    done, release = threading.Event(), threading.Event()
    own = threading.Thread(target=_spin_then_wait, args=(0.2, done, release), name="ddlscope-store-writer", daemon=True)
    own.start()
    try:
        assert done.wait(30)
        own_s = next(t.user_time + t.system_time for t in psutil.Process().threads() if t.id == own.native_id)
        assert own_s >= 0.15  # it did spin (to the tick)
        assert background_cpu_s() - before < TICK_S
    finally:
        release.set()
        own.join(10)


def test_a_kept_reader_lists_the_processes_once_per_rescan_and_counts_them_in_between(monkeypatch):
    """BackgroundCpu (read every training step) lists the tree once per rescan_s: a child that was
    listed is counted in full from its CPU times alone; one started after the listing is counted from
    the next listing on, with its CPU until then."""
    listings = []
    real = host._background_processes
    monkeypatch.setattr(host, "_background_processes", lambda: listings.append(1) or real())
    ctx = multiprocessing.get_context("fork")
    first_done, second_done, release = ctx.Event(), ctx.Event(), ctx.Event()
    first = _HivemindLikeProcess(0.3, first_done, release)
    first.start()
    reader, second = BackgroundCpu(rescan_s=3600), None
    try:
        before = reader()
        assert first_done.wait(60)
        first_s = _cpu_s(psutil.Process(first.pid).cpu_times())
        second = _HivemindLikeProcess(0.3, second_done, release)
        second.start()
        assert second_done.wait(60)
        second_s = _cpu_s(psutil.Process(second.pid).cpu_times())
        for _ in range(9):
            counted = reader() - before
        assert len(listings) == 1
        assert second_s >= 0.25
        assert counted == pytest.approx(first_s, abs=TICK_S), (counted, first_s, second_s)
        reader.rescan_s = 0.0  # the next call lists the tree again: the second child counts with all its CPU
        assert reader() - before == pytest.approx(first_s + second_s, abs=TICK_S)
        assert len(listings) == 2
    finally:
        release.set()
        first.join(10)
        if second is not None:
            second.join(10)


def test_a_negative_rescan_interval_is_refused():
    with pytest.raises(ValueError, match="rescan_s must be >= 0"):
        BackgroundCpu(rescan_s=-1)


def _fake_ss(tmp_path, monkeypatch, script: str) -> None:
    ss = tmp_path / "ss"
    ss.write_text("#!/bin/sh\n" + script)
    ss.chmod(0o755)
    monkeypatch.setattr(host.shutil, "which", lambda name: str(ss) if name == "ss" else None)


SS_OUTPUT = ("ESTAB 0 0 10.0.0.1:5000 10.0.0.2:6000 users:((\"p2pd\",pid={pid},fd=7))\n"
             "\t cubic rto:204 bytes_sent:1200 bytes_acked:1200 bytes_received:3400 segs_out:9\n"
             "ESTAB 0 0 10.0.0.1:5001 10.0.0.3:6001 users:((\"other\",pid=999999,fd=3))\n"
             "\t cubic bytes_sent:50 bytes_acked:50 bytes_received:60\n")


def test_tcp_bytes_counted_from_ss(tmp_path, monkeypatch):
    import os

    _fake_ss(tmp_path, monkeypatch, "cat <<'X'\n" + SS_OUTPUT.format(pid=os.getpid()) + "X\n")
    asked = []
    monkeypatch.setattr(host, "_tcp_sockets", lambda pids: asked.append(pids) or {("10.0.0.1:5000", "10.0.0.2:6000")})
    counter = TcpByteCounter()
    assert counter.totals({os.getpid()}) == (1200, 3400)  # the other process's socket is not the worker's
    assert counter.reason is None
    # ss attributed a socket to the worker, so it can read its processes: psutil's costly list is not read
    assert asked == []


def test_no_tcp_traffic_is_a_measured_zero(tmp_path, monkeypatch):
    _fake_ss(tmp_path, monkeypatch, "exit 0\n")
    monkeypatch.setattr(host, "_tcp_sockets", lambda pids: set())
    assert TcpByteCounter().totals({1}) == (0, 0)


def test_sockets_that_close_while_ss_runs_do_not_make_the_bytes_unknown(tmp_path, monkeypatch):
    import os

    pid = os.getpid()
    _fake_ss(tmp_path, monkeypatch, "cat <<'X'\n" + SS_OUTPUT.format(pid=pid) + "X\n")
    monkeypatch.setattr(host, "_tcp_sockets", lambda pids: {("10.0.0.1:5000", "10.0.0.2:6000")})
    counter = TcpByteCounter()
    assert counter.totals({pid}) == (1200, 3400)
    # the peer shuts down: psutil lists a socket that is gone by the time ss runs, and gone after it
    listed = iter([{("10.0.0.1:5009", "10.0.0.2:6009")}, set()])
    monkeypatch.setattr(host, "_tcp_sockets", lambda pids: next(listed))
    _fake_ss(tmp_path, monkeypatch, "exit 0\n")
    assert counter.totals({pid}) == (1200, 3400)  # what was counted stays counted
    assert counter.reason is None


@pytest.mark.parametrize("case, expected", [
    ("missing", "not installed"),
    ("fails", "exited 1: Cannot open netlink socket"),
    ("hidden", "cannot read their processes"),
    ("old kernel", "no bytes_sent"),
])
def test_tcp_bytes_that_cannot_be_counted_are_unknown_with_a_reason(tmp_path, monkeypatch, case, expected):
    import os

    pid = os.getpid()
    monkeypatch.setattr(host, "_tcp_sockets", lambda pids: {("10.0.0.1:5000", "10.0.0.2:6000")})
    if case == "missing":
        monkeypatch.setattr(host.shutil, "which", lambda name: None)
    elif case == "fails":
        _fake_ss(tmp_path, monkeypatch, "echo 'Cannot open netlink socket' >&2; exit 1\n")
    elif case == "hidden":  # ss lists the socket but not its process
        _fake_ss(tmp_path, monkeypatch, "cat <<'X'\nESTAB 0 0 10.0.0.1:5000 10.0.0.2:6000\n\t bytes_sent:5 bytes_acked:5\nX\n")
    else:
        _fake_ss(tmp_path, monkeypatch, f"cat <<'X'\nESTAB 0 0 10.0.0.1:5000 10.0.0.2:6000 users:((\"p\",pid={pid},fd=1))\n"
                                        "\t bytes_acked:500 bytes_received:70\nX\n")
    counter = TcpByteCounter()
    assert counter.totals({pid}) is None
    assert expected in counter.reason

    samples, notes = [], []
    with HostSampler(samples.append, interval_s=60, network=True, note=lambda **kw: notes.append(kw)):
        pass
    assert samples and all(s["net_sent_bytes"] is None and s["net_recv_bytes"] is None for s in samples)
    assert {n["metric"] for n in notes} == {"net_sent_bytes", "net_recv_bytes"}  # once each
    assert len(notes) == 2 and all(expected in n["reason"] for n in notes)


def test_tcp_sockets_of_this_process_are_found_as_ss_prints_them():
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    try:
        import os

        pair = (f"127.0.0.1:{client.getsockname()[1]}", f"127.0.0.1:{server.getsockname()[1]}")
        assert pair in host._tcp_sockets({os.getpid()})
        counter = TcpByteCounter()
        if counter.ss is None:
            pytest.skip("ss is not installed here")
        client.sendall(b"x" * 1000)
        assert conn.recv(2000)
        sent, received = counter.totals({os.getpid()})
        assert sent >= 1000 and received >= 1000  # both ends are this process
    finally:
        conn.close()
        client.close()
        server.close()


# ---------------------------------------------------------------- unknown bytes through the analysis
def _collab_run(store, nets: list[int | None], reasons: dict[int, str] | None = None) -> str:
    """A 2-step collaborative run whose peer i's last host sample has ``nets[i]`` bytes each way
    (None: not counted), with a :data:`host.UNKNOWN_EVENT` per ``reasons`` entry."""
    run_id = store.create_run("collab", "collaborative", {"peers": len(nets)}, group_name="g")
    for i, net in enumerate(nets):
        store.upsert_worker(run_id, i, status="completed", train_start_time=0.0, train_end_time=10.0, eval_s=0.0)
        for step in range(2):
            store.add_step(run_id, i, dict(step=step, wall_time=float(step), samples=10, forward_s=0.1, backward_s=0.1,
                                           optimizer_s=0.1, step_s=0.3, warmup=0, optimizer_stepped=1))
        store.add_host_sample(run_id, i, dict(wall_time=1.0, net_sent_bytes=net, net_recv_bytes=net))
    for i, reason in (reasons or {}).items():
        for metric in ("net_sent_bytes", "net_recv_bytes"):
            store.add_event(run_id, i, host.UNKNOWN_EVENT, metric=metric, reason=reason)
    store.finish_run(run_id, "completed")
    return run_id


@pytest.fixture
def store(tmp_path):
    from ddlscope.store.db import ResultsStore

    with ResultsStore(tmp_path / "r.db") as s:
        yield s


def test_unknown_network_bytes_are_none_with_the_reason_not_zero(store, tmp_path):
    from ddlscope.analyze.compare import compare, summarize_run
    from ddlscope.analyze.report import summary_rows, write_report

    unknown = summarize_run(store, _collab_run(store, [4_000_000, None], {1: "ss (iproute2) is not installed"}))
    zero = summarize_run(store, _collab_run(store, [0, 0]))  # counted: nothing was sent
    assert unknown.workers[0].net_sent_bytes == 4_000_000 and unknown.workers[1].net_sent_bytes is None
    assert unknown.mean_net_bytes_per_peer is None  # a mean over the counted peer alone would mislead
    assert unknown.net_unknown_reason == "peer 1: ss (iproute2) is not installed"
    assert zero.mean_net_bytes_per_peer == 0 and zero.net_unknown_reason is None
    comparisons = compare(None, [unknown, zero])
    rows = summary_rows(comparisons, None)
    assert [r["net MB/peer"] for r in rows] == ["-", "0.0"]
    assert any("network bytes per peer unknown (peer 1: ss (iproute2) is not installed)" in n for n in comparisons[0].notes)
    assert not any("network" in n for n in comparisons[1].notes)
    write_report(comparisons, tmp_path / "rep")
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "ss (iproute2) is not installed" in md
    worker_row = next(line for line in md.splitlines() if line.startswith(f"| collab | {unknown.run_id} | 1 |"))
    assert "| - | - |" in worker_row  # sent and received MB of the unknown peer


def test_unknown_network_bytes_without_a_stored_reason_or_samples(store):
    from ddlscope.analyze.compare import summarize_run

    s = summarize_run(store, _collab_run(store, [None, 5]))
    assert s.mean_net_bytes_per_peer is None and s.net_unknown_reason == "peer 0: not counted (no reason stored)"
    run_id = store.create_run("bare", "collaborative", {"peers": 1}, group_name="g")
    store.upsert_worker(run_id, 0, status="failed")
    store.finish_run(run_id, "failed")
    assert summarize_run(store, run_id).net_unknown_reason == "peer 0: no host sample stored"


def test_sweep_network_view_leaves_unknown_runs_out_of_the_bars(store, tmp_path, monkeypatch):
    from ddlscope.analyze import sweep_report
    from ddlscope.analyze.compare import summarize_run

    summaries = [summarize_run(store, _collab_run(store, nets, {0: "ss failed", 1: "ss failed"} if None in nets else None))
                 for nets in ([None, None], [1_000_000, 1_000_000], [0, 0])]
    rows = sweep_report.network_table(summaries)
    assert [r["net_bytes_per_peer"] for r in rows] == [None, 2_000_000, 0]
    assert rows[0]["sent_bytes_per_peer"] is None and rows[0]["net_unknown_reason"] == "peer 0: ss failed; peer 1: ss failed"
    drawn = {}

    def bar(ax, xs, heights, *a, **kw):
        drawn["heights"] = list(heights)

    monkeypatch.setattr(sweep_report.plt.Axes, "bar", bar)
    sweep_report._plot_network(rows, tmp_path / "network.png")
    assert sorted(drawn["heights"]) == [0.0, 2.0]  # the unknown run has no bar, the measured 0 has one
