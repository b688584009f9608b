"""`harness.server_process`: a server subprocess found at the URL it announced, and always stopped.

The serve benchmark starts every server through it (``--port 0``: no port chosen
here that another process could take first). A tiny standard-library HTTP server
stands in for a model server, so this costs a Python start-up, not a torch import.
"""

from __future__ import annotations

import os
import re
import sys

import httpx
import pytest

from partrain.bench.harness import server_process

ANNOUNCE = re.compile(r"listening at (?P<url>http://\S+)")
SERVER = ("import http.server\n"
          "s = http.server.HTTPServer(('127.0.0.1', 0), http.server.SimpleHTTPRequestHandler)\n"
          "print('noise first: http://not-this-one', flush=True)\n"
          "print(f'listening at http://127.0.0.1:{s.server_port}/', flush=True)\n"
          "s.serve_forever()\n")


def test_server_is_reached_at_its_announced_url_and_stopped_after(tmp_path):
    with server_process("toy server", [sys.executable, "-c", SERVER], ANNOUNCE, ready_path="/",
                        start_timeout=60) as server:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", server.url)  # trailing slash dropped
        assert httpx.get(server.url + "/", timeout=10, trust_env=False).status_code == 200
        process = server.process
    assert process.poll() is not None  # stopped on leaving the block


def test_a_server_that_exits_before_announcing_is_reported_with_its_output():
    command = [sys.executable, "-c", "import sys; print('cannot load the model', file=sys.stderr); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"(?s)exited with status 3 before it was ready.*cannot load the model"):
        with server_process("broken server", command, ANNOUNCE, start_timeout=60):
            pass


def test_servers_start_together_and_one_that_fails_stops_the_others(tmp_path):
    import contextlib

    from partrain.bench.harness import start_servers

    with contextlib.ExitStack() as stack:
        servers = start_servers(stack, [server_process(f"toy {i}", [sys.executable, "-c", SERVER], ANNOUNCE,
                                                       ready_path="/", start_timeout=60) for i in range(3)])
        assert len({s.url for s in servers}) == 3
        processes = [s.process for s in servers]
        assert all(p.poll() is None for p in processes)
    assert all(p.poll() is not None for p in processes)  # stopped with the stack

    broken = [sys.executable, "-c", "import sys; sys.exit(3)"]
    pid_file = tmp_path / "toy.pid"
    toy = [sys.executable, "-c", f"import os; open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n" + SERVER]
    with pytest.raises(RuntimeError, match="broken exited with status 3"):
        with contextlib.ExitStack() as stack:
            start_servers(stack, [server_process("toy", toy, ANNOUNCE, start_timeout=60),
                                  server_process("broken", broken, ANNOUNCE, start_timeout=60)])
    # the toy server that did start was stopped (and reaped) when the broken one's error left the stack
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)
