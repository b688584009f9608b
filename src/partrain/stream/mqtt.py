"""`MqttSource`: items from an MQTT broker into an `OnlineTrainer`, predictions back on a reply topic.

paho-mqtt (the ``stream`` extra) speaks MQTT 5 to the broker. The delivery
contract, and why it holds:

- **No accepted item is lost.** Subscriptions use QoS 1 and messages are
  acknowledged by hand (``manual_ack``) only once the trainer accepted the item
  (or it was counted malformed or duplicate). A message the trainer did not take
  (closing, a full queue) is not acknowledged: the broker delivers it again to
  the next session. The session is persistent (a fixed client id,
  ``clean_session=False``; under MQTT 5 ``clean_start=False`` and ``session_expiry``
  seconds), so a disconnect keeps the subscriptions and the messages queued meanwhile.
- **Disconnects are survived.** paho reconnects on its own (``reconnect_delay``
  growing from the minimum to the maximum); the subscriptions are renewed on
  every connect (a broker restarted without persistence forgot them). `start`
  returns once the broker confirmed the subscription (its SUBACK), not at the
  connection: a message published in between is not delivered (a test under
  load published 13 in that gap and none arrived). Replies
  published while disconnected wait in paho's queue (QoS 1) and go out on
  reconnect.
- **No duplicate training on redelivered messages where they can be told apart.**
  QoS 1 is at-least-once: after a lost acknowledgement the broker sends a
  message again. A payload that carries an ``id`` is trained on once (the
  trainer's ``dedup_window`` of ids, kept in its checkpoints too); a payload
  without one cannot be told from a new message and may be trained on twice.
- **Malformed payloads are counted and skipped** with one log line each; they
  never reach the trainer and never stop the loop.

Flow control: ``on_message`` runs in paho's network thread and hands the item
to `OnlineTrainer.submit`; with overflow ``"block"`` a full queue holds that
thread, so paho stops reading and the broker queues (back-pressure reaches the
broker instead of memory).

**The broker's own limits.** A broker keeps a bounded queue per session: mosquitto drops
QoS 1 messages beyond ``max_queued_messages`` (default 1000) waiting for a client, beyond
the ``max_inflight_messages`` (default 20) it has sent and not yet had acknowledged. Those
messages were never delivered, so never accepted: the guarantees above hold, but a burst
faster than the client drains can lose part of it at the broker. The source watches the
broker's ``$SYS/broker/publish/messages/dropped`` counter (mosquitto publishes it every
``sys_interval`` seconds, 10 by default; a broker without it is simply not watched) and
logs, once per increase, how many were dropped and which settings to raise.

**Protocol.** MQTT 3.1.1 by default, as paho's own: paho parses each MQTT 5 message's
properties in Python, which cost it about a third of its time per message (``bench stream``:
partrain over a bare client went from about 0.75 to about 0.97 messages/s on a quiet
machine). Replies go to ``reply_topic``; the persistent session (``clean_session=False``)
lasts as long as the broker keeps it. ``protocol="5"`` answers a message's response topic
and echoes its correlation data, and the session expires after ``session_expiry``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import UsageError, error_line
from .codec import Codec, Decoded, MalformedPayload, encode_answer
from .trainer import DuplicateItem, OnlineTrainer, TrainerClosed

log = logging.getLogger("partrain.stream")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``HOST``: port 1883) for ``--mqtt``."""
    host, sep, port_text = text.rpartition(":") if ":" in text else (text, "", "1883")
    host = host.strip("[]") if sep else text
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not host or not 0 < port < 65536:
        raise UsageError(f"Expected --mqtt as HOST:PORT (e.g. 127.0.0.1:1883). Received: {text!r}")
    return host, port


@dataclass(frozen=True)
class MqttConfig:
    """Where to connect and what to subscribe to.

    ``reply_topic``: where predictions go, ``{topic}`` standing for the item's own
    topic (e.g. ``"{topic}/prediction"``); under MQTT 5 a message's response topic wins
    over it; None and no response topic: no reply.
    """

    host: str
    port: int = 1883
    topics: tuple[str, ...] = ("stream/#",)
    qos: int = 1
    reply_topic: str | None = None
    client_id: str = "partrain-stream"
    keepalive: int = 30
    session_expiry: int = 3600  # seconds the broker keeps the session (subscriptions, queued messages)
    reconnect_delay: tuple[float, float] = (0.1, 5.0)
    username: str | None = None
    password: str | None = None
    #: ``"3.1.1"`` or ``"5"`` (see the module docstring)
    protocol: str = "3.1.1"
    #: watch the broker's count of dropped messages (mosquitto's $SYS topic) and say how to avoid drops
    watch_drops: bool = True


#: the broker's count of messages it dropped since it started (mosquitto)
DROPPED_TOPIC = "$SYS/broker/publish/messages/dropped"
#: what to raise when the broker drops: the line the log writes
DROP_HINT = ("raise the broker's per-client queue for bursts (mosquitto.conf: max_queued_messages, default 1000, "
             "0 = no limit; max_inflight_messages, default 20; or max_queued_bytes)")


class MqttSource:
    """Feed ``trainer`` from an MQTT broker: `start`, then `stop` (which drains the replies)."""

    def __init__(self, trainer: OnlineTrainer, config: MqttConfig, codec: Codec | None = None):
        try:
            import paho.mqtt.client as mqtt
            from paho.mqtt.enums import CallbackAPIVersion
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties
        except ImportError:
            raise UsageError("Expected paho-mqtt for MQTT streams (pip install 'partrain[stream]'). "
                             "Received: not installed") from None
        if config.protocol not in ("5", "3.1.1"):
            raise UsageError(f"Expected an MQTT protocol '5' or '3.1.1'. Received: {config.protocol!r}")
        if config.qos not in (1, 2):
            raise UsageError(f"Expected --qos 1 or 2 (QoS 0 can lose accepted items). Received: {config.qos}")
        if not config.topics:
            raise UsageError("Expected at least one --topic. Received: none")
        self.trainer = trainer
        self.config = config
        self.codec = codec or Codec()
        self._mqtt = mqtt
        self._properties = (Properties, PacketTypes)
        self.connected = threading.Event()  # set once connected and subscribed (the broker's SUBACK)
        self._subscribe_mid: int | None = None
        self.connects = 0  # successful connections (1 + reconnects)
        self.replies_failed = 0
        self._accepting = True
        self._lock = threading.Lock()
        self._replies: dict[int, Any] = {}  # mid -> MQTTMessageInfo, until published
        self._replies_pending = 0
        self._early: set[int] = set()  # mids acknowledged before _reply registered them
        self._first_error: str | None = None
        #: the broker's dropped-messages counter when first seen, and the count last reported
        self.dropped_at_start: int | None = None
        self.dropped_reported = 0
        self._v5 = config.protocol == "5"
        client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=config.client_id,
                             protocol=mqtt.MQTTv5 if self._v5 else mqtt.MQTTv311, manual_ack=True,
                             **({} if self._v5 else {"clean_session": False}))
        client.max_queued_messages_set(0)  # replies queue without bound while disconnected
        low, high = config.reconnect_delay
        client.reconnect_delay_set(min_delay=low, max_delay=high)  # type: ignore[arg-type]
        if config.username is not None:
            client.username_pw_set(config.username, config.password)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_subscribe = self._on_subscribe
        client.on_publish = self._on_publish
        self.client = client

    # ---------------------------------------------------------------- lifecycle

    def start(self, timeout: float = 10.0) -> MqttSource:
        """Connect (paho's thread reconnects from then on); `UsageError` if no broker answers in ``timeout``."""
        Properties, PacketTypes = self._properties
        if self._v5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.config.session_expiry
            self.client.connect_async(self.config.host, self.config.port, self.config.keepalive,
                                      clean_start=False, properties=props)
        else:
            self.client.connect_async(self.config.host, self.config.port, self.config.keepalive)
        self.client.loop_start()
        if not self.connected.wait(timeout):
            self.client.loop_stop()
            why = f" ({self._first_error})" if self._first_error else ""
            raise UsageError(f"Expected an MQTT broker at {self.config.host}:{self.config.port}. "
                             f"Received: no connection within {timeout:g} s{why}")
        return self

    def pause(self) -> None:
        """Take no more items: later messages stay unacknowledged (the broker keeps them)."""
        self._accepting = False

    def stop(self, timeout: float = 10.0) -> int:
        """Stop taking items, wait (bounded) for the replies still to publish, disconnect.

        Call `OnlineTrainer.close` between `pause` and `stop` so that the drained
        items' replies are published; returns how many replies were not sent.
        """
        self.pause()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._replies_pending == 0 and not self._replies:
                    break
            time.sleep(0.01)  # polling the reply queue (bounded by timeout)
        with self._lock:
            unsent = self._replies_pending + len(self._replies)
        self.client.disconnect()
        self.client.loop_stop()
        return unsent

    def __enter__(self) -> MqttSource:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---------------------------------------------------------------- paho callbacks (its thread)

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        if reason.is_failure:
            self._first_error = self._first_error or str(reason)
            log.warning("MQTT broker refused the connection: %s", reason)
            return
        self.connects += 1
        _, self._subscribe_mid = client.subscribe([(topic, self.config.qos) for topic in self.config.topics])
        if self.config.watch_drops:
            client.subscribe(DROPPED_TOPIC, 0)  # statistics: at most once is enough

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any, properties: Any) -> None:
        # connected once the broker confirms the subscription: a message published before it would not be
        # delivered, so `start` returns only then
        if mid != self._subscribe_mid:
            return
        refused = [str(r) for r in reasons if r.is_failure]
        if refused:
            self._first_error = self._first_error or f"the broker refused the subscription: {refused[0]}"
            log.warning("MQTT broker refused the subscription to %s: %s", ", ".join(self.config.topics), refused[0])
            return
        if self.connects > 1:
            log.info("reconnected to %s:%d", self.config.host, self.config.port)
        self.connected.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        self.connected.clear()
        if self._accepting:
            log.warning("disconnected from the MQTT broker (%s); reconnecting", reason)

    def _on_dropped(self, client: Any, userdata: Any, message: Any) -> None:
        """The broker's dropped-messages counter (paho's thread): one warning per increase."""
        try:
            count = int(message.payload)
        except ValueError:
            return
        if self.dropped_at_start is None:  # the retained value: drops before this run are not ours to report
            self.dropped_at_start = count
            return
        new = count - self.dropped_at_start - self.dropped_reported
        if new > 0:
            self.dropped_reported += new
            log.warning("the broker dropped %d messages since this run started (%d in all): messages beyond its "
                        "queue for a slow client are lost before delivery; %s", self.dropped_reported, count,
                        DROP_HINT)

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        if message.topic == DROPPED_TOPIC and self.config.watch_drops:  # the broker's statistics, not an item
            self._on_dropped(client, userdata, message)
            return
        if not self._accepting:
            return  # not acknowledged: redelivered to the next session
        try:
            item = self.codec.decode(message.payload)
        except MalformedPayload as exc:
            self._malformed(message, str(exc))
            return
        reply_to = self._reply_topic(message)
        if reply_to is None:
            on_answer = _ignore
        else:
            with self._lock:  # counted before the answer can come (the trainer's thread may answer at once)
                self._replies_pending += 1
            item_id = item.item_id
            correlation = (getattr(getattr(message, "properties", None), "CorrelationData", None)
                           if self._v5 else None)

            def on_answer(prediction: Any, error: BaseException | None) -> None:
                self._reply(prediction, error, reply_to, item_id, correlation)
        if self._submit(message, item, on_answer):
            client.ack(message.mid, message.qos)
        elif reply_to is not None:
            with self._lock:  # not taken: no answer will come
                self._replies_pending -= 1

    def _submit(self, message: Any, item: Decoded, on_answer: Any) -> bool:
        """Hand the item over (True: accepted); acknowledge what is settled here (malformed, duplicate)."""
        try:
            self.trainer.submit(item.x, item.y, weight=item.weight, id=item.item_id, on_answer=on_answer)
            return True
        except DuplicateItem:
            log.debug("duplicate id %r on %s skipped", item.item_id, message.topic)
            self.client.ack(message.mid, message.qos)
        except UsageError as exc:  # the item does not fit the model's inputs or the first label
            self._malformed(message, str(exc))
        except TrainerClosed:
            pass  # not acknowledged: the broker keeps it for the next session
        except Exception as exc:  # noqa: BLE001 - QueueFull: not acknowledged, redelivered later
            log.warning("message on %s not taken: %s", message.topic, error_line(exc))
        return False

    def _malformed(self, message: Any, why: str) -> None:
        self.trainer.count_malformed()
        log.warning("malformed message on %s skipped: %s", message.topic, why)
        self.client.ack(message.mid, message.qos)

    def _reply_topic(self, message: Any) -> str | None:
        props = getattr(message, "properties", None) if self._v5 else None
        topic = getattr(props, "ResponseTopic", None) if props is not None else None
        if topic:
            return str(topic)
        if self.config.reply_topic:
            return self.config.reply_topic.replace("{topic}", message.topic)
        return None

    def _reply(self, prediction: Any, error: BaseException | None, topic: str, item_id: Any,
               correlation: bytes | None) -> None:
        """The item's answer (trainer's loop thread): publish the prediction, or the error, as JSON."""
        props = None
        if correlation:
            Properties, PacketTypes = self._properties
            props = Properties(PacketTypes.PUBLISH)
            props.CorrelationData = correlation
        payload = encode_answer(prediction, error, item_id)
        try:
            info = self.client.publish(topic, payload, qos=self.config.qos, properties=props)
        except Exception as exc:  # noqa: BLE001 - a reply that cannot be queued is counted, never raised
            with self._lock:
                self._replies_pending -= 1
                self.replies_failed += 1
            log.warning("reply to %s not sent: %s", topic, error_line(exc))
            return
        with self._lock:
            self._replies_pending -= 1
            if info.mid in self._early:  # its acknowledgement came before this line
                self._early.discard(info.mid)
            else:
                self._replies[info.mid] = info  # sent or queued (while disconnected): wait for its PUBACK

    def _on_publish(self, client: Any, userdata: Any, mid: int, reason: Any, properties: Any) -> None:
        with self._lock:
            if self._replies.pop(mid, None) is None:
                self._early.add(mid)


def _ignore(prediction: Any, error: BaseException | None) -> None:
    """The answer of an item nobody is to be told about (no reply topic)."""


def topics_of(values: Sequence[str] | None) -> tuple[str, ...]:
    """The ``--topic`` values, each checked (no empty topic)."""
    topics = tuple(values or ())
    for t in topics:
        if not t or "\x00" in t:
            raise UsageError(f"Expected an MQTT topic filter like sensors/#. Received: {t!r}")
    return topics
