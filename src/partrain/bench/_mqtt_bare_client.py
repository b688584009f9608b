"""The MQTT consumer a user writes by hand: the floor of ``partrain bench stream``'s MQTT section.

Not library code. It imports neither partrain nor torch (a hand-written client
has no reason to), so the benchmark runs it by its path, as its own process::

    python _mqtt_bare_client.py HOST PORT TOPIC_FILTER REPLY_PREFIX

paho-mqtt with its defaults (MQTT 3.1.1, a clean session, 20 messages in
flight; only the version 2 callback signatures are chosen, as paho 2 asks): it
subscribes with QoS 1, ``json.loads`` each message and publishes one JSON reply,
``{"id": its id, "prediction": [sum of its x]}``, on REPLY_PREFIX + its topic with
QoS 1. It prints ``bare client: subscribed on mqtt://HOST:PORT`` once the broker
confirmed the subscription (the benchmark waits for that line) and runs until
SIGTERM.
"""

from __future__ import annotations

import json
import sys

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion


def main(host: str, port: int, topic_filter: str, reply_prefix: str) -> None:
    client = mqtt.Client(CallbackAPIVersion.VERSION2)

    def on_connect(c: mqtt.Client, userdata: object, flags: object, reason: object, properties: object) -> None:
        c.subscribe(topic_filter, qos=1)

    def on_subscribe(c: mqtt.Client, userdata: object, mid: int, reasons: object, properties: object) -> None:
        print(f"bare client: subscribed on mqtt://{host}:{port}", flush=True)

    def on_message(c: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        item = json.loads(message.payload)
        reply = {"id": item.get("id"), "prediction": [sum(item["x"])]}
        c.publish(reply_prefix + message.topic, json.dumps(reply), qos=1)

    client.on_connect, client.on_subscribe, client.on_message = on_connect, on_subscribe, on_message
    client.connect(host, port)
    client.loop_forever()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
