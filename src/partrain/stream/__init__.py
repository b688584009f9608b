"""Online training on a live stream: predict and train on whatever arrived while the last step ran.

`OnlineTrainer` takes items from any thread or event loop (`OnlineTrainer.submit`,
`OnlineTrainer.consume` for an iterator, `OnlineTrainer.aconsume` for an async
one) and trains on them in dequeue-all batches on the project's one dynamic
batcher (`partrain.batching.Batcher`). `MqttSource` (the ``stream`` extra,
paho-mqtt) feeds it from an MQTT broker and answers predictions on a reply topic.
See docs/streaming.md.
"""

from .options import LOSSES, MinBatchPolicy, parse_lr_schedule
from .trainer import (
    DuplicateItem,
    OnlineTrainer,
    Prediction,
    StepRecord,
    StreamStats,
    TrainerClosed,
)

__all__ = [
    "LOSSES",
    "DuplicateItem",
    "MinBatchPolicy",
    "OnlineTrainer",
    "Prediction",
    "StepRecord",
    "StreamStats",
    "TrainerClosed",
    "parse_lr_schedule",
]


def __getattr__(name: str):  # noqa: ANN202 - lazy: paho-mqtt is an optional extra
    if name in ("MqttSource", "MqttConfig"):
        from . import mqtt

        return getattr(mqtt, name)
    raise AttributeError(f"module 'partrain.stream' has no attribute {name!r}")
