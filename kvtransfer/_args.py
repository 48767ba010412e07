"""Argument types shared by the ``kvtransfer`` commands: a bad value is one usage line, never a traceback."""

from __future__ import annotations

import argparse
import copy

__all__ = ["HelpFormatter", "deprecated_alias", "description", "non_negative_int", "on_off", "positive_float",
           "positive_int"]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def on_off(text: str) -> tuple:
    """``on``, ``off`` or both, comma separated, in the order given (``--layerwise``)."""
    values = tuple(dict.fromkeys(v.strip() for v in text.split(",")))
    if not values or set(values) - {"on", "off"}:
        raise argparse.ArgumentTypeError(f"expected on, off or on,off, got {text!r}")
    return values


def description(doc: str) -> str:
    """A command's ``--help`` description: its module docstring's first paragraph, without
    reStructuredText's double backquotes."""
    return doc.split("\n\n")[0].replace("``", "")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default (also for a flag without help text), unless its help
    already says it or the default is None or False."""

    @staticmethod
    def _shows_default(action) -> bool:
        return bool(action.option_strings) and not any(action.default is v for v in (None, False, argparse.SUPPRESS))

    def _format_action(self, action):
        if action.help is None and self._shows_default(action):
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or not self._shows_default(action):
            return text
        return super()._get_help_string(action)


def deprecated_alias(ap: argparse.ArgumentParser, old: str, target: argparse.Action) -> None:
    """``old`` as a hidden flag that sets ``target``'s value (the action ``add_argument``
    returned), with a warning on stderr."""
    import sys

    new = target.option_strings[0]

    class Alias(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            print(f"{parser.prog}: warning: {old} is deprecated; use {new}", file=sys.stderr)
            setattr(namespace, target.dest, values)

    ap.add_argument(old, dest=target.dest, type=target.type, action=Alias, default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS)
