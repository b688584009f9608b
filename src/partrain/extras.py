"""Which optional extra brings which third-party module, and the one line a missing one gets.

The base install (``pip install partrain``) runs every command that needs no extra:
``partrain --help``, ``partrain train``, ``population``, ``compare`` and every command's
``--help``. A command that needs an extra imports it only when it runs; when the import
fails, the user reads one line naming the extra and the command that installs it, not a
traceback from inside partrain::

    partrain serve: error: this command needs the 'serve' extra (No module named
    'prometheus_client'): pip install 'partrain[serve]'
"""

from __future__ import annotations

from .errors import UsageError

# top-level module name -> the smallest extra of pyproject.toml that installs it
MODULE_EXTRAS = {
    "starlette": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "httpx": "serve",
    "h11": "serve",
    "orjson": "serve",
    "sniffio": "serve",
    "gymnasium": "rl",
    "safetensors": "rl",
    "paho": "stream",
    "h5py": "h5py",
    "ray": "ray",
    "litserve": "bench",
    "stable_baselines3": "rl-bench",
    "tensorboard": "tensorboard",
    "transformers": "hf",
}
# the modules each extra installs beyond MODULE_EXTRAS' own (pyproject.toml: rl = serve + ...)
_INCLUDES = {"rl": ("serve",), "rl-bench": ("rl", "serve"), "stream": (), "bench": ("serve",)}
_ALSO = {"stream": ("prometheus_client",)}


def provides(extra: str, module: str) -> bool:
    """Whether installing ``extra`` installs the top-level ``module``."""
    own = MODULE_EXTRAS.get(module)
    return (own == extra or module in _ALSO.get(extra, ())
            or any(provides(inner, module) for inner in _INCLUDES.get(extra, ())))


class MissingExtra(UsageError):
    """A command needs a module that only an optional extra installs."""

    def __init__(self, extra: str, module: str) -> None:
        self.extra = extra
        self.module = module
        super().__init__(f"this command needs the '{extra}' extra (No module named '{module}'): "
                         f"{install_hint(extra)}")


def install_hint(extra: str) -> str:
    """``pip install 'partrain[serve]'``: what installs ``extra``."""
    return f"pip install 'partrain[{extra}]'"


def require(extra: str) -> None:
    """Raise `MissingExtra` unless every module ``extra`` installs can be imported.

    For a command whose extra is needed by other processes it starts (a benchmark's server)
    rather than by itself: they would each fail later, with the line in their own output.
    """
    import importlib.util

    for module in sorted(m for m in set(MODULE_EXTRAS) | set(_ALSO.get(extra, ())) if provides(extra, m)):
        if importlib.util.find_spec(module) is None:
            raise MissingExtra(extra, module)


def needs(extra: str) -> str:
    """The sentence a command's ``--help`` ends with when the command needs ``extra``."""
    return f"Needs the '{extra}' extra: {install_hint(extra)}."


def missing_extra(exc: BaseException, command_extra: str | None = None) -> MissingExtra | None:
    """The `MissingExtra` that ``exc`` (a failed import) means, or None when it is no such import.

    Only a module that one of partrain's extras installs counts: a missing module of the
    user's own (their model's import) stays the error it is. ``command_extra`` is the extra
    the command declares (``rl`` for ``partrain rl``): it is named when it installs the
    missing module, so the user installs everything the command needs at once.
    """
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    if command_extra is not None and provides(command_extra, top):
        return MissingExtra(command_extra, exc.name)
    extra = MODULE_EXTRAS.get(top)
    return MissingExtra(extra, exc.name) if extra else None
