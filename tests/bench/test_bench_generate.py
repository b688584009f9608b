"""`partrain bench generate` (issue 52, Measure): it runs, states its four goals, and its baselines do what they say.

The full run takes minutes and is run by hand; here the toy size runs end to end once
over HTTP (a ``partrain serve`` process; its figures are noise and are not checked, only
the goals block's names and form, and that no request was lost). The rest guards what the
figures rest on, without timing anything: the request-level batching baseline answers
each caller with its own greedy continuation (float64, against the one-at-a-time loop), the
Hugging Face twin computes the GPT's function (else its answers could not be checked), the
load drivers send every request once and count failures, and a run whose greedy answers
disagree with the sequential loop's does not exit 0. Start with
`test_toy_run_reports_the_four_goals`.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

import partrain.bench.generate as bench_generate
from partrain.bench._generate_baselines import (
    Request,
    Run,
    StaticBatching,
    greedy_answer,
    hf_twin,
    make_requests,
)
from partrain.bench._generate_load import closed_loop, open_loop
from partrain.cli import main
from partrain.models.gpt import GPT
from partrain.serve.generation import GPTRunner
from tests.bench.goals_block import run_and_check

GOALS = {"generate.vs_sequential", "generate.vs_static", "generate.ttft_p99_over_p50", "generate.vs_hf"}


def _toy_gpt(dtype: torch.dtype = torch.float64) -> GPT:
    torch.manual_seed(3)
    return GPT(vocab_size=256, n_layer=2, n_head=2, n_embd=32, block_size=64).to(dtype).eval()


@pytest.mark.timeout(120)
def test_toy_run_reports_the_four_goals(tmp_path, capsys):
    out, data = run_and_check("generate", GOALS, tmp_path, capsys)
    assert "static batching (Batcher)" in out
    for goal, entry in data["goals"].items():
        if goal == "generate.vs_hf" and entry["value"] is None:  # without transformers: said, not measured
            assert "hf: transformers is not installed" in out
            continue
        assert entry["value"] is not None, goal
    assert data["goals"]["generate.ttft_p99_over_p50"]["op"] == "<="
    assert data["checks"]["generate.failed_requests"]["value"] == 0.0  # no request refused, lost or cut short
    assert data["checks"]["generate.greedy_mismatch_pct"]["value"] is not None


def test_a_run_whose_answers_differ_from_the_sequential_loops_does_not_exit_0(tmp_path, capsys, monkeypatch):
    real = bench_generate.sequential

    def wrong(model, requests):  # noqa: ANN001, ANN202 - the reference, every answer's first token changed
        run = real(model, requests)
        run.answers = {i: ((a[0] + 1) % 256, *a[1:]) for i, a in run.answers.items()}
        return run

    monkeypatch.setattr(bench_generate, "sequential", wrong)
    out_file = tmp_path / "generate.json"
    assert main(["bench", "generate", "--toy", "--in-process", "--no-hf", "--json", str(out_file)]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()  # progress lines, then the one error line; no traceback
    assert "Traceback" not in captured.err and "greedy answers differ from the sequential loop's" in err[-1]
    assert "hf: skipped (--no-hf)" in captured.out
    data = json.loads(out_file.read_text())  # the figures are not lost with the verdict
    assert data["checks"]["generate.greedy_mismatch_pct"]["met"] is False
    assert data["goals"]["generate.vs_hf"]["value"] is None


def test_request_level_batching_answers_each_caller_with_its_own_greedy_continuation():
    model = _toy_gpt()
    requests = [Request((5, 9, 200, 1), 7), Request(tuple(range(20, 33)), 2), Request((77,), 12),
                Request((3, 3, 3), 1), Request(tuple(range(100, 109)), 5)]
    runner = GPTRunner(model)
    runner.allocate(1)
    expected = [greedy_answer(runner, r) for r in requests]
    static = StaticBatching(model, max_batch=4)  # five callers: at least two batches
    try:
        async def callers() -> list[list[int]]:
            return await asyncio.gather(*(static.generate(r) for r in requests))

        answers = asyncio.run(callers())
    finally:
        static.close()
    assert answers == expected
    assert [len(a) for a in answers] == [r.max_tokens for r in requests]  # cut to its own length


def test_the_hugging_face_twin_computes_the_gpts_function():
    pytest.importorskip("transformers")
    model = _toy_gpt()
    twin = hf_twin(model).to(torch.float64)
    ids = torch.tensor([[1, 50, 7, 255, 0, 9], [3, 3, 3, 3, 3, 3]])
    with torch.no_grad():
        assert torch.allclose(twin(ids).logits, model(ids), atol=1e-10, rtol=0)


def test_requests_are_a_fixed_list_within_their_ranges():
    first, again = make_requests(50, (4, 16), (2, 9), 256, seed=7), make_requests(50, (4, 16), (2, 9), 256, seed=7)
    assert first == again != make_requests(50, (4, 16), (2, 9), 256, seed=8)
    assert all(4 <= len(r.prompt) <= 16 and 2 <= r.max_tokens <= 9 for r in first)
    assert all(0 <= t < 256 for r in first for t in r.prompt)


def test_closed_loop_sends_every_request_once_and_counts_failures_and_short_answers():
    requests = [Request((i,), 3) for i in range(10)]
    sent: list[int] = []

    async def generate(request: Request) -> list[int]:
        sent.append(request.prompt[0])
        await asyncio.sleep(0)  # give the other callers a turn, as a network wait would
        if request.prompt[0] == 4:
            raise ConnectionError("refused")
        return [0] * (2 if request.prompt[0] == 7 else 3)

    run = asyncio.run(closed_loop(generate, requests, clients=3))
    assert sorted(sent) == list(range(10))
    assert (run.errors, run.short, len(run.answers), run.tokens) == (1, 1, 9, 8 * 3 + 2)
    assert run.first_error == "ConnectionError: refused"


def test_open_loop_streams_every_arrival_and_times_its_first_token():
    requests = [Request((i,), 2) for i in range(3)]

    async def stream(request: Request):  # noqa: ANN202
        yield [request.prompt[0]]
        yield [request.prompt[0]]
        yield []  # a last event that adds no token

    result = asyncio.run(open_loop(stream, requests, count=7, rate=2000.0))
    assert isinstance(result.run, Run) and len(result.ttft) == 7 and len(result.tpot) == 7
    assert all(t >= 0 for t in result.ttft)
    assert result.run.tokens == 14 and result.run.answers == {i: (i, i) for i in range(3)}  # cycled over the list
