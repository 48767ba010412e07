"""Argument types shared by the ``kvtransfer`` commands: a bad value is one usage line, never a traceback."""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter", "deprecated_alias", "description", "non_negative_int", "positive_float", "positive_int"]


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


def description(doc: str) -> str:
    """A command's ``--help`` description: its module docstring's first paragraph, without the
    reStructuredText markup (````code````)."""
    return doc.split("\n\n")[0].replace("``", "")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default, unless its help already says it or it has none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS)) \
                or not action.option_strings:
            return text
        return super()._get_help_string(action)


def deprecated_alias(ap: argparse.ArgumentParser, old: str, new: str) -> None:
    """``old`` as a hidden flag that sets ``new``'s value, with a warning on stderr."""
    import sys

    target = next(a for a in ap._actions if new in a.option_strings)

    class Alias(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            print(f"{parser.prog}: warning: {old} is deprecated; use {new}", file=sys.stderr)
            setattr(namespace, target.dest, values)

    ap.add_argument(old, dest=target.dest, type=target.type, action=Alias, default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS)
