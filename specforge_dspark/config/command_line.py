"""The argument parser every command uses: its usage names the command as it is run
(`python -m MODULE`), its help says what the command does, shows each option's default and
ends with an example."""

from __future__ import annotations

import argparse


def _shown(action: argparse.Action) -> bool:
    return bool(action.option_strings) and action.default not in (
        None,
        False,
        [],
        argparse.SUPPRESS,
    )


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if _shown(action) and "%(default)" not in text:
            text = f"{text} (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if action.help is None and _shown(action):  # its default, even without a sentence
            action.help = "(default: %(default)s)"
        return action


def command_parser(module: str, doc: str | None, *examples: str) -> argparse.ArgumentParser:
    """A parser for `python -m module` (`module` itself when it is a command line):
    `doc` is the description, the examples (each a full command line) the epilog."""
    return _Parser(
        prog=module if " " in module else f"python -m {module}",
        description=doc,
        epilog="example:\n" + "\n".join(f"  {e}" for e in examples) if examples else None,
        formatter_class=_Formatter,
    )
