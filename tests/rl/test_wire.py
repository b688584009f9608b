"""What travels between actors and the learner, and how an actor loads it.

The blobs are safetensors written through the library's numpy writer (dtypes numpy has)
or its torch writer (bfloat16): both must be the format any safetensors reader reads,
round trip bit for bit, and a malformed or dishonest segment must get one 400 line.
"""

from __future__ import annotations

import http.client
import math
import socket
import threading

import pytest
import safetensors.torch
import torch
from torch import nn

from partrain.errors import UsageError
from partrain.rl import ActorCritic, Learner
from partrain.rl.client import Connection, load_weights
from partrain.rl.wire import decode_segment, decode_weights, encode_segment, encode_weights
from partrain.serve.protocol import ProtocolError


def segment(steps: int = 3, envs: int = 2, version: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"obs": torch.randn(steps + 1, envs, 4, generator=g),
            "actions": torch.randint(0, 2, (steps, envs), generator=g),
            "logp": torch.rand(steps, envs, generator=g).log(), "rewards": torch.rand(steps, envs, generator=g),
            "dones": (torch.rand(steps, envs, generator=g) < 0.3).float(),
            "versions": torch.full((steps, envs), version, dtype=torch.int64)}


def test_weights_round_trip_bit_for_bit_and_any_safetensors_reader_reads_them():
    state = {"w": torch.randn(3, 5, dtype=torch.float64), "b": torch.randn(5), "count": torch.tensor(7),
             "mask": torch.tensor([True, False]), "half": torch.randn(4).half(),
             "strided": torch.randn(4, 6)[:, ::2]}  # not contiguous
    blob = encode_weights(state, 12)
    tensors, version = decode_weights(blob)
    assert version == 12
    assert tensors.keys() == state.keys()
    for name, t in state.items():
        assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name
    # the reference reader (safetensors' own torch loader) sees the same tensors
    reference = safetensors.torch.load(blob)
    assert all(torch.equal(reference[k], state[k]) for k in state)


def test_bfloat16_weights_take_the_torch_writer_and_reader():
    state = {"w": torch.randn(3, 4).bfloat16(), "b": torch.randn(4)}
    tensors, version = decode_weights(encode_weights(state, 3))
    assert version == 3
    assert tensors["w"].dtype == torch.bfloat16 and torch.equal(tensors["w"], state["w"])
    assert torch.equal(tensors["b"], state["b"])


def test_a_segment_round_trips_with_its_version_returns_and_actor():
    sent = segment()
    got = decode_segment(encode_segment(sent, [12.0, 30.5], "actor-7"), (4,), 2)
    assert (got.version, got.episode_returns, got.actor, got.frames) == (5, [12.0, 30.5], "actor-7", 6)
    for name, t in sent.items():
        assert got.tensors[name].dtype == t.dtype and torch.equal(got.tensors[name], t), name


@pytest.mark.parametrize("change, expected", [
    (lambda s: s["obs"].__setitem__((1, 0, 2), math.nan), "Expected finite values in 'obs'"),
    (lambda s: s["rewards"].__setitem__((0, 1), math.inf), "Expected finite values in 'rewards'"),
    (lambda s: s["actions"].__setitem__((2, 1), 2), "Expected actions in 0..1. Received: values 0..2"),
    (lambda s: s["actions"].__setitem__((0, 0), -1), "Expected actions in 0..1. Received: values -1..1"),
    (lambda s: s.__setitem__("obs", s["obs"].bfloat16()), "Expected 'obs' of dtype torch.float32. "
                                                         "Received: torch.bfloat16"),
    (lambda s: s.__setitem__("logp", s["logp"].double()), "Expected 'logp' of dtype torch.float32"),
    (lambda s: s.__setitem__("obs", s["obs"][:, :, :3].contiguous()), "Expected 'obs' of shape [4, 2, 4]"),
])
def test_a_bad_segment_gets_one_line_saying_what_was_expected(change, expected):
    bad = segment()
    change(bad)
    with pytest.raises(ProtocolError, match=expected.replace("[", r"\[").replace(".", r"\.")):
        decode_segment(encode_segment(bad, []), (4,), 2)


def test_metadata_that_lies_about_the_version_is_refused():
    blob = safetensors.torch.save(segment(version=5), metadata={"version": "4", "actor": "x"})
    with pytest.raises(ProtocolError, match="Expected metadata version = min\\(versions\\). Received: 4 and 5"):
        decode_segment(blob, (4,), 2)
    with pytest.raises(ProtocolError, match="Expected a safetensors body. Received: 9 bytes"):
        decode_segment(b"not a one", (4,), 2)


def test_load_weights_copies_into_the_models_own_tensors_and_refuses_another_model():
    torch.manual_seed(0)
    model, source = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), nn.Sequential(nn.Linear(3, 4),
                                                                                      nn.BatchNorm1d(4))
    source(torch.randn(8, 3))  # running statistics and the batch count move
    before = [id(p) for p in model.parameters()]
    state, _ = decode_weights(encode_weights(source.state_dict(), 1))
    load_weights(model, state)
    assert [id(p) for p in model.parameters()] == before  # in place: an optimizer or a view keeps working
    for name, t in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    with pytest.raises(RuntimeError, match="Missing key"):
        load_weights(model, {"0.weight": state["0.weight"]})
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_weights(model, {**state, "0.bias": torch.zeros(5)})


def test_a_learner_serialises_a_version_as_it_publishes_once_actors_pull():
    torch.manual_seed(0)
    learner = Learner(ActorCritic(4, 2, hidden=8), obs_shape=(4,), num_actions=2)
    learner.publish()
    assert learner.cached_weights() is None  # nobody pulled: nothing serialised ahead
    version, blob = learner.weights()  # an actor pulls
    assert version == 1 and learner.cached_weights() == (1, blob)
    with torch.no_grad():
        next(learner.model.parameters()).add_(1.0)
    assert learner.publish() == 2
    cached = learner.cached_weights()  # ready before anyone asks, and it is the new weights
    assert cached is not None and cached[0] == 2
    state, v = decode_weights(cached[1])
    assert v == 2 and all(torch.equal(state[k], t) for k, t in learner.model.state_dict().items())
    assert learner.weights() == cached


def test_a_connection_refuses_a_url_it_cannot_speak_to_in_one_line():
    for url in ("ftp://127.0.0.1:1", "127.0.0.1:8000"):
        with pytest.raises(UsageError, match="Expected a learner URL such as http://127.0.0.1:8000. Received"):
            Connection(url, {}, 1.0)


def _one_shot_server(answers: list[bool]) -> tuple[str, threading.Thread, list[int]]:
    """A raw HTTP/1.1 server on 127.0.0.1: connection k reads one request, answers it (keep-alive
    implied) when ``answers[k]``, then closes, as a server does with a connection idle too long."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(30)
    served: list[int] = []

    def run() -> None:
        with listener:
            for k, answer in enumerate(answers):
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(30)
                    data = b""
                    while b"\r\n\r\n" not in data:
                        data += conn.recv(4096)
                    served.append(k)
                    if answer:
                        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", thread, served


def test_a_connection_the_server_closed_while_idle_is_replaced_once_but_a_fresh_failure_is_raised():
    url, thread, served = _one_shot_server([True, True, False])
    conn = Connection(url, {}, 30.0)
    assert conn.request("GET", "/a").content == b"ok"
    # the server closed that kept-alive connection: the request goes out again on a new one
    assert conn.request("POST", "/b", content=b"x").content == b"ok"
    # a new connection that fails is the caller's to handle (its retries, its deadline)
    conn.close()
    with pytest.raises((http.client.HTTPException, OSError)):
        conn.request("GET", "/c")
    thread.join(30)
    assert served == [0, 1, 2]
