"""What the fork server imports once, before it forks any of partrain's local processes.

See `partrain._process.process_context`. A process forked from the server starts with
these modules loaded (in milliseconds, not the seconds a fresh interpreter takes to
import torch) and with SIGINT ignored: every process partrain starts leaves Ctrl-C to
the caller, which stops it (each one's main also says so itself, as under ``spawn``).
"""

import os
import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server keeps this handler for its children

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
