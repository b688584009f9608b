"""``partrain stream``: the model spec and output conventions of train/serve, bad input, SIGTERM drain.

The JSON-lines source (``--input``) drives the command without a broker; the
MQTT path of the command is the `MqttSource` of test_mqtt.py. The SIGTERM test
runs the real command in a subprocess, waits (on its Prometheus counter) until
it accepted every item written to its standard input, and checks that the
signal drains them: every accepted item trained on, a final checkpoint holding
them, status 143.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from partrain.checkpoint import load_checkpoint
from partrain.cli import main

from ..waiting import wait_until
from .conftest import free_port

FACTORY = textwrap.dedent("""
    import torch

    def build():
        torch.manual_seed(0)
        return torch.nn.Linear(3, 1)
""")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    (tmp_path / "stream_cli_model.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_items(path, ids, labelled=True) -> None:
    g = torch.Generator().manual_seed(len(ids))
    with open(path, "w") as f:
        for i in ids:
            x = torch.rand(3, generator=g).tolist()
            item = {"x": x, "id": i, **({"y": [sum(x)]} if labelled else {})}
            f.write(json.dumps(item) + "\n")


def test_trains_on_json_lines_writes_curves_and_a_checkpoint_and_resumes(workdir, capsys):
    write_items(workdir / "a.jsonl", list(range(200)))
    assert main(["stream", "stream_cli_model:build", "--input", "a.jsonl", "--out", "run", "--quiet",
                 "--input-shape", "3", "--max-batch", "16", "--min-batch", "16", "--max-wait-ms", "60000"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"200 items accepted: 200 answered \(200 trained on in 13 updates\)", err), err
    assert sorted(os.listdir(workdir / "run")) == ["checkpoint.pt", "curves.png", "metrics.csv"]
    header = (workdir / "run" / "metrics.csv").read_text().splitlines()[0]
    assert header.startswith("time_s,version,items_trained,items_per_s")
    state = load_checkpoint(str(workdir / "run" / "checkpoint.pt"))  # weights_only
    assert state["model_spec"]["name"] == "stream_cli_model:build" and state["stream"]["version"] == 13

    write_items(workdir / "b.jsonl", [*range(190, 200), *range(200, 232)])  # 10 seen before
    assert main(["stream", "stream_cli_model:build", "--input", "b.jsonl", "--out", "run", "--quiet", "--device", "cpu",
                 "--resume", "--max-batch", "16", "--min-batch", "16", "--max-wait-ms", "60000"]) == 0
    err = capsys.readouterr().err
    assert "32 items accepted" in err and "10 duplicates" in err and "model version 15 on cpu" in err, err


@pytest.mark.parametrize("to_file", [True, False], ids=["--output FILE", "standard output"])
def test_each_item_read_gets_its_answer_as_one_json_line_in_order(workdir, capsys, to_file):
    write_items(workdir / "c.jsonl", list(range(40)))
    out = ["--output", "answers.jsonl"] if to_file else []
    assert main(["stream", "stream_cli_model:build", "--input", "c.jsonl", "--out", "run", "--quiet", *out,
                 "--input-shape", "3", "--max-batch", "16", "--min-batch", "16", "--max-wait-ms", "60000"]) == 0
    text = (workdir / "answers.jsonl").read_text() if to_file else capsys.readouterr().out
    answers = [json.loads(line) for line in text.splitlines()]
    assert [a["id"] for a in answers] == list(range(40))
    # batches of 16 (then the 8 left at the end): an item is predicted by the weights before its batch's update
    assert [a["version"] for a in answers] == [0] * 16 + [1] * 16 + [2] * 8
    items = [json.loads(line) for line in (workdir / "c.jsonl").read_text().splitlines()]
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)  # what build() returns, untrained: version 0
    with torch.no_grad():
        want = model(torch.tensor([item["x"] for item in items[:16]]))
    torch.testing.assert_close(torch.tensor([a["prediction"] for a in answers[:16]]), want, atol=1e-6, rtol=0)


BAD = [
    ([], "Expected exactly one source: --mqtt HOST:PORT or --input FILE. Received: neither"),
    (["--mqtt", "127.0.0.1:1883"], "Expected --topic FILTER with --mqtt. Received: no --topic"),
    (["--mqtt", "host:abc", "--topic", "t"], "Expected --mqtt as HOST:PORT (e.g. 127.0.0.1:1883). Received: 'host:abc'"),
    (["--input", "missing.jsonl"], "Expected --input to be a file of JSON lines or '-'. Received: 'missing.jsonl'"),
    (["--mqtt", "127.0.0.1:1", "--topic", "t", "--output", "a.txt"], "Expected --output with --input (MQTT answers "
     "on --reply-topic). Received: --output 'a.txt' with --mqtt"),
    (["--input", "a.jsonl", "--max-batch", "0"], "Expected --max-batch >= 1. Received: --max-batch=0"),
    (["--input", "a.jsonl", "--lr-schedule", "cosine"], "Expected an lr schedule among"),
    (["--input", "a.jsonl", "--min-batch", "8"], "Expected max_wait > 0 seconds with min_batch > 1"),
    (["--input", "a.jsonl", "--input-shape", "3,-1"], "Expected --input-shape without dynamic (-1) dims"),
    (["--input", "a.jsonl", "--input-shape", "-1,3"], "Expected --input-shape without dynamic (-1) dims"),
    (["--input", "a.jsonl", "--device", "gpu"], "Expected a device such as cpu, cuda, cuda:1 or auto. Received: 'gpu'"),
    *([] if torch.cuda.is_available() else [
        (["--input", "a.jsonl", "--device", "cuda"], "Expected a CUDA device for --device cuda. Received: none visible"),
    ]),
]


@pytest.mark.parametrize("args, line", BAD)
def test_bad_input_is_one_line_and_status_2(workdir, capsys, args, line):
    write_items(workdir / "a.jsonl", [0])
    assert main(["stream", "stream_cli_model:build", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("partrain stream: error: ") and line in err[0], err


def test_bad_model_unreachable_broker_and_no_labels_are_one_line(workdir, capsys):
    assert main(["stream", "nosuch.pt", "--input", "-"]) == 2
    assert "Expected MODEL as a checkpoint path or module:factory. Received: 'nosuch.pt'" in capsys.readouterr().err
    port = free_port()  # nothing listens there
    assert main(["stream", "stream_cli_model:build", "--mqtt", f"127.0.0.1:{port}", "--topic", "t", "--quiet",
                 "--connect-timeout", "0.5", "--out", "run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"partrain stream: error: Expected an MQTT broker at 127.0.0.1:{port}. Received: no connection "
                   "within 0.5 s"], err
    write_items(workdir / "u.jsonl", list(range(5)), labelled=False)
    assert main(["stream", "stream_cli_model:build", "--input", "u.jsonl", "--quiet", "--out", "run"]) == 2
    err = capsys.readouterr().err
    assert "error: Expected labelled items to train on. Received: 5 items accepted, 0 failed, no update taken" in err


def test_sigterm_drains_every_accepted_item(workdir):
    pytest.importorskip("prometheus_client")
    httpx = pytest.importorskip("httpx")
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "partrain", "stream", "stream_cli_model:build", "--input", "-", "--out", "run",
               "--metrics-port", "0", "--quiet", "--min-batch", "64", "--max-wait-ms", "600000", "--threads", "1"]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env, cwd=workdir)
    try:
        url = re.search(r"metrics at (\S+)", process.stdout.readline()).group(1)
        write_items(workdir / "items.jsonl", list(range(40)))
        process.stdin.write((workdir / "items.jsonl").read_text())
        process.stdin.flush()  # stdin stays open: the source is still reading when the signal comes

        def accepted() -> float:
            text = httpx.get(url, timeout=5, trust_env=False).text
            found = re.search(r'partrain_stream_items_total\{outcome="accepted"\} (\S+)', text)
            return float(found.group(1)) if found else 0.0

        wait_until(lambda: accepted() == 40, "the command to accept 40 items")
        process.send_signal(signal.SIGTERM)  # 40 < --min-batch: nothing was trained yet
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
    assert process.returncode == 143, err
    assert "40 items accepted: 40 answered (40 trained on in 1 updates)" in err, err
    assert "stopped by SIGTERM" in err
    state = load_checkpoint(str(workdir / "run" / "checkpoint.pt"))
    assert state["stream"]["items_trained"] == 40 and sorted(state["stream"]["trained_ids"]) == list(range(40))


def test_mqtt_end_to_end_with_a_session_kept_by_the_broker(workdir, capsys, broker):
    """The docs' example: messages published while ``partrain stream`` is not running wait in its
    persistent session (same client id) and are trained on, answered, and checkpointed."""
    pytest.importorskip("paho.mqtt.client")
    from .test_mqtt import Replies, client, close

    session = client(broker, "cli-stream")  # the session the command will resume: subscribed, then away
    subscribed = threading.Event()
    session.on_subscribe = lambda *args: subscribed.set()
    session.subscribe("sensors/#", qos=1)
    assert subscribed.wait(20), "no SUBACK"
    close(session)
    replies = Replies(broker)
    publisher = client(broker, "cli-publisher")
    g = torch.Generator().manual_seed(0)
    sent = [publisher.publish("sensors/a", b"not an item", qos=1)]  # first: counted before the 50th item
    for i in range(50):
        x = torch.rand(3, generator=g).tolist()
        sent.append(publisher.publish("sensors/a", json.dumps({"id": i, "x": x, "y": [sum(x)]}), qos=1))
    for info in sent:
        info.wait_for_publish(20)  # the broker has them (PUBACK): queued for the absent session
    close(publisher)
    assert main(["stream", "stream_cli_model:build", "--mqtt", broker.address, "--topic", "sensors/#",
                 "--client-id", "cli-stream", "--reply-topic", "replies/{topic}", "--input-shape", "3",
                 "--max-items", "50", "--out", "run", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "50 items accepted: 50 answered (50 trained on in" in err and "1 malformed" in err, err
    wait_until(lambda: replies.count() == 50, "50 replies")
    close(replies.client)
    assert all(r[0]["version"] >= 0 and len(r[0]["prediction"]) == 1 for r in replies.by_id.values())
    assert load_checkpoint(str(workdir / "run" / "checkpoint.pt"))["stream"]["items_trained"] == 50
