"""A load test spread over client processes (`ClientProcesses`) counts like one process does.

The shares are checked by hand (how clients, requests and rates are dealt out),
the merge of reports against a hand sum, and a run over two processes against the
fake OIP server of `test_loadtest`, whose faults are chosen by request id: each
process numbers its own requests from 0, so every expected count is known exactly.
"""

from __future__ import annotations

import json
import weakref
from collections import Counter

import pytest

from partrain.errors import UsageError
from partrain.serve.loadtest import LoadConfig, LoadReport, prepare
from partrain.serve.loadtest.processes import ClientProcesses, _share, split

pytest.importorskip("uvicorn")


def test_split_deals_out_evenly_larger_shares_first():
    assert split(10, 4) == [3, 3, 2, 2]
    assert split(2, 4) == [1, 1, 0, 0]
    assert split(8, 1) == [8]
    assert sum(split(1001, 7)) == 1001


def test_each_process_gets_its_share_of_a_closed_and_an_open_loop():
    closed = LoadConfig(url="http://127.0.0.1:1", concurrency=5, requests=11, connections=9)
    shares = [_share(closed, i, 3) for i in range(3)]
    assert [(s.concurrency, s.requests, s.connections) for s in shares] == [(2, 4, None), (2, 4, None),
                                                                            (1, 3, None)]
    few = LoadConfig(url="http://127.0.0.1:1", concurrency=1, duration=1.0)
    assert _share(few, 0, 2).concurrency == 1 and _share(few, 1, 2) is None  # nothing for it to do
    opened = LoadConfig(url="http://127.0.0.1:1", rate=300.0, duration=2.0, seed=5)
    shares = [_share(opened, i, 3) for i in range(3)]
    assert [s.rate for s in shares] == [100.0, 100.0, 100.0]
    assert [s.seed for s in shares] == [5, 6, 7]  # independent arrival times: their sum is Poisson at 300/s
    assert sum(s.connections for s in shares) == 256


def test_merged_report_adds_counts_pools_latencies_and_takes_the_longest_run():
    a = LoadReport("closed loop, concurrency 3", 2.0, 10, [0.1] * 8, Counter({"timeout": 2}), duplicates=0,
                   missing=0, id_mismatches=1, checked=8, wrong=1, first_wrong="sample 2: off")
    b = LoadReport("closed loop, concurrency 2", 2.5, 6, [0.3] * 6, Counter({"timeout": 1, "HTTP 503": 1}),
                   missing=1, first_error="request 4: HTTP 503")
    m = LoadReport.merge([a, b])
    assert m.mode == "closed loop, concurrency 5 over 2 processes"
    assert (m.sent, m.ok, m.failed, m.elapsed) == (16, 14, 4, 2.5)
    assert m.errors == Counter({"timeout": 3, "HTTP 503": 1})
    assert (m.lost, m.checked, m.wrong) == (2, 8, 1)
    assert m.first_wrong == "sample 2: off" and m.first_error == "request 4: HTTP 503"
    assert m.throughput == 14 / 2.5 and m.percentile(50) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="at least one report"):
        LoadReport.merge([])


def _clients(url: str, processes: int):
    cfg = LoadConfig(url=url, model="tiny", samples=8, timeout=5.0, concurrency=1, requests=1)
    _, samples, checker = prepare(cfg, check="tests.serve.test_loadtest:tiny_model")
    wrong = prepare(cfg, check="tests.serve.test_loadtest:other_model")[2]
    return ClientProcesses(processes, samples, {"model": checker, "other": wrong})


def test_two_processes_account_for_every_request_and_check_every_answer(serve):
    url = serve({"wrong": 4, "swap": 5})
    with _clients(url, 2) as clients:
        report, cpu = clients.run(LoadConfig(url=url, model="tiny", concurrency=3, requests=20, timeout=5.0),
                                  "model")
        assert report.mode == "closed loop, concurrency 3 over 2 processes"
        assert (report.sent, report.ok, report.failed, report.missing, report.duplicates) == (20, 20, 0, 0, 0)
        # 10 requests each, ids 0..9 in each process: wrong numbers for 0, 4, 8; another's id for 0, 5
        assert report.wrong == 2 * 3 and report.id_mismatches == 2 * 2 and report.checked == 20
        assert 0.0 < cpu

        again, _ = clients.run(LoadConfig(url=url, model="tiny", concurrency=2, requests=6, timeout=5.0), "other")
        assert (again.sent, again.ok, again.wrong) == (6, 6, 6)  # another model's numbers: every answer wrong

        opened, _ = clients.run(LoadConfig(url=url, model="tiny", rate=400.0, requests=10, timeout=5.0))
        assert (opened.sent, opened.ok, opened.checked) == (10, 10, 0)
        assert opened.mode.endswith("in each of 2 processes")


def test_bad_input_is_refused_before_any_process_runs_and_a_dead_process_is_an_error_not_a_hang(serve):
    url = serve()
    with _clients(url, 2) as clients:
        with pytest.raises(UsageError, match="Expected a checker among"):
            clients.run(LoadConfig(url=url, model="tiny", concurrency=2, requests=2), "nope")
        with pytest.raises(UsageError, match="Expected a model name"):
            clients.run(LoadConfig(url=url, concurrency=2, requests=2))
        report, _ = clients.run(LoadConfig(url=url, model="tiny", concurrency=2, requests=4))
        assert report.ok == 4  # the processes still serve after a refused run

        clients._procs[1].kill()
        clients._procs[1].join(timeout=10)
        with pytest.raises(RuntimeError, match="partrain-loadtest-1 exited"):
            clients.run(LoadConfig(url=url, model="tiny", concurrency=2, requests=4))
        with pytest.raises(RuntimeError, match="no more runs after .*partrain-loadtest-1 exited"):
            clients.run(LoadConfig(url=url, model="tiny", concurrency=2, requests=4))


def test_close_releases_the_queues_and_the_barrier_at_once_and_twice_is_harmless(serve):
    """Their semaphores are released inside `close` (with Ctrl-C held: a finalizer cut by a signal
    leaves the resource tracker warning of a leaked semaphore), not when the frames holding the
    object are collected."""
    url = serve()
    clients = _clients(url, 2)
    clients.run(LoadConfig(url=url, model="tiny", concurrency=2, requests=2))
    held = [weakref.ref(clients._barrier), weakref.ref(clients._results), *map(weakref.ref, clients._commands)]
    clients.close(now=True)
    assert [ref() for ref in held] == [None] * len(held)  # while `clients` is still referenced here
    clients.close()
    with pytest.raises(RuntimeError, match="no more runs after the processes were closed"):
        clients.run(LoadConfig(url=url, model="tiny", concurrency=2, requests=2))


def test_cli_spreads_the_load_and_still_fails_on_wrong_answers(serve, tmp_path, capsys):
    from partrain.cli import main

    url = serve({"wrong": 3})
    out = tmp_path / "load.json"
    code = main(["loadtest", f"{url}/v2/models/tiny", "-c", "4", "-n", "12", "--processes", "2", "--binary",
                 "--check", "tests.serve.test_loadtest:tiny_model", "--json", str(out)])
    text = capsys.readouterr().out
    # 6 requests per process, ids 0..5 in each: 0 and 3 get wrong numbers
    assert code == 1 and "closed loop, concurrency 4 over 2 processes: 12 requests" in text and "4 WRONG" in text
    figures = json.loads(out.read_text())
    assert (figures["sent"], figures["ok"], figures["wrong"], figures["lost"]) == (12, 12, 4, 0)
    assert main(["loadtest", url, "--model", "tiny", "--processes", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("partrain loadtest: error: Expected at least one client process. "
                                               "Received: --processes 0")
