"""What the fork server imports once, before it forks any of partrain's local processes.

See `partrain._process.process_context`. A process forked from the server starts with
these modules loaded (in milliseconds, not the seconds a fresh interpreter takes to
import torch) and with SIGINT ignored: every process partrain starts leaves Ctrl-C to
the caller, which stops it (each one's main also says so itself, as under ``spawn``).
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server keeps this handler for its children

import torch  # noqa: E402, F401
import torch._dynamo  # noqa: E402, F401 - an optimizer's first construction imports it: 2 s of CPU per process
import torch.distributed  # noqa: E402, F401

import partrain.pool  # noqa: E402, F401
