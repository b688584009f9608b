"""Strategies: how one training loop runs on many processes. See `base.Strategy`."""

from .base import Strategy, available, get_strategy, parse_options, register

__all__ = ["Strategy", "available", "get_strategy", "parse_options", "register"]
