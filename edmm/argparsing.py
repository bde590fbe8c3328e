"""Argument parsing of every ``edmm`` command: help with defaults, one-line errors.

`ArgumentParser` prints a bad argument as one line, ``PROG: error: MESSAGE (see PROG --help)``,
and exits with status 2 (argparse's usage block is left out); its help shows each option's
default unless the help line already says it. Range checks are argparse types that name the
allowed range (`int_at_least`, `fraction`, `int_list`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, NoReturn


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help, unless the help already names its default
    or there is none to show (None, or a flag that is off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("default" in text or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS):
            return text
        if isinstance(action.default, tuple):
            return text + f" (default: {','.join(map(str, action.default))})"
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors are one line (exit status 2) and whose help
    shows defaults; subcommand parsers made with ``add_subparsers`` are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE (see PROG --help)`` to stderr and exit with 2."""
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from e
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def float_at_least(low: float) -> Callable[[str], float]:
    """An argparse type: a number >= ``low``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from e
        if not value >= low:
            raise argparse.ArgumentTypeError(f"expected a number >= {low:g}, got {value:g}")
        return value
    parse.__name__ = f"number >= {low:g}"
    return parse


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1)."""
    try:
        value = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from e
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {value:g}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated positive integers, at least one."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from e
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def resolve_device(parser: argparse.ArgumentParser, device: str) -> str:
    """``auto``: cuda if torch sees a GPU, else cpu; a CUDA device with none here: an error."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device}: no CUDA device here (torch {torch.__version__}, "
                     "torch.cuda.is_available() is False); use --device cpu or auto")
    if device != "cpu" and not device.startswith("cuda"):
        parser.error(f"--device must be auto, cpu or cuda[:N], got {device!r}")
    return device
