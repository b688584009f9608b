"""The MQTT section of ``partrain bench stream`` (issue 53) runs end to end and measures its three goals.

The section starts a real mosquitto, ``partrain stream`` and a bare paho client
as processes (`partrain.bench.stream_mqtt`); the toy-size smoke test
(test_smoke.py) does not reach it, so without this test a change to ``partrain
stream``'s options or its reply format would break it unseen. The figures are
noise here and are not checked; that each goal was measured (a value, not null)
is: a reply lost at saturation, where the broker has no queue limit, leaves the
ratio unmeasured. Skipped with the reason where no broker can be had. Start with
`test_quick_run_measures_the_three_mqtt_goals`.
"""

from __future__ import annotations

import json
import math

import pytest

from partrain.bench.stream_mqtt import Run
from partrain.cli import main
from tests import system_packages

MQTT_GOALS = ("stream.mqtt_vs_bare", "stream.mqtt_burst_loss", "stream.mqtt_p99_ms")


@pytest.mark.timeout(300)
def test_quick_run_measures_the_three_mqtt_goals(tmp_path, capsys):
    pytest.importorskip("paho.mqtt.client")
    binary, why = system_packages.mosquitto()
    if binary is None:
        pytest.skip(f"no MQTT broker: {why}")
    out_file = tmp_path / "stream.json"
    assert main(["bench", "stream", "--quick", "--json", str(out_file)]) == 0
    out = capsys.readouterr().out
    assert "MQTT saturation" in out and "MQTT burst" in out and "MQTT fixed rate" in out
    data = json.loads(out_file.read_text())
    for name in MQTT_GOALS:
        assert name in data["goals"], name
        assert data["goals"][name]["value"] is not None, f"{name} not measured"
        assert any(line.startswith(name) for line in out.splitlines()), f"{name} not printed"
    assert data["figures"]["mqtt.saturation.partrain_stream.messages_per_s"]["median"] > 0


def test_a_run_counts_missing_replies_as_lost_and_then_has_no_rate():
    """The burst's loss and the saturation's rate come from one record of publish and reply times."""
    complete = Run(sent=[0.0, 0.1, 0.2, 0.3], arrived=[0.5, 0.6, 0.7, 1.0], acked=0.4)
    assert complete.loss == 0.0 and complete.per_s == pytest.approx(4 / 1.0)
    assert complete.taken_per_s == pytest.approx(4 / 0.4)
    assert complete.latencies() == pytest.approx([0.5, 0.5, 0.5, 0.7])

    partial = Run(sent=[0.0, 0.1, 0.2, 0.3], arrived=[0.5, 0.0, 0.7, 0.0], acked=math.nan)
    assert partial.replied == 2 and partial.loss == 0.5
    assert math.isnan(partial.per_s) and math.isnan(partial.taken_per_s)
    assert partial.latencies() == pytest.approx([0.5, 0.5])
