"""What the fork server imports once, before it forks any of partrain's local processes.

See `partrain._process.process_context`. A process forked from the server starts with
these modules loaded (in milliseconds, not the seconds a fresh interpreter takes to
import torch) and with SIGINT ignored: every process partrain starts leaves Ctrl-C to
the caller, which stops it (each one's main also says so itself, as under ``spawn``).
"""

import os
import select
import signal
import threading

signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server keeps this handler for its children


def _end_with_the_starter() -> None:
    """In the fork server only: exit as soon as the process that started it has.

    multiprocessing's server ends when every holder of its "alive" pipe has closed it: the
    starter, but also each child it forked, which the server does not watch while it imports
    (seconds of torch) and which in turn only learn of the starter's death from the server's.
    A launcher killed by SIGKILL or the OOM killer then left a server importing torch, or
    waiting on its children. A thread waits on the starter's pidfd (no polling); its end
    ends the server, and with it the children's parent sentinel (`_process.watch_parent`).
    """
    try:
        with open("/proc/self/cmdline", "rb") as f:
            if b"from multiprocessing.forkserver import main" not in f.read():
                return  # imported elsewhere (a test of what the server imports)
        starter = os.getppid()
        fd = os.pidfd_open(starter)
    except (OSError, AttributeError):  # not Linux 5.3+: multiprocessing's own rule alone
        return
    if os.getppid() != starter or starter == 1:  # the starter died before the watch began
        os._exit(0)

    def watch() -> None:
        select.select([fd], [], [])
        os._exit(0)

    threading.Thread(target=watch, name="partrain-starter-watch", daemon=True).start()


_end_with_the_starter()

# CUDA must stay uninitialised here: a process forked after the driver's initialisation cannot
# use CUDA. Nothing below asks for a device (`tests/test_start_method.py` checks it); should an
# import ever call torch.cuda.is_available(), NVML answers it instead of the driver.
_NVML = "PYTORCH_NVML_BASED_CUDA_CHECK"
_own_nvml = _NVML not in os.environ
os.environ.setdefault(_NVML, "1")

import torch  # noqa: E402, F401
import torch._dynamo  # noqa: E402, F401 - an optimizer's first construction imports it: 2 s of CPU per process
import torch.distributed  # noqa: E402, F401

import partrain.pool  # noqa: E402, F401

if _own_nvml:
    del os.environ[_NVML]
