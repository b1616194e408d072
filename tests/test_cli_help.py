"""Every command's --help works and every flag says what it does (and its default)."""

from __future__ import annotations

import argparse

import pytest

from speculum.cli import HelpFormatter, build_parser, main


def _parsers():
    """(name, parser) for every command and subcommand, and every trainer's parser."""
    todo = [("speculum", build_parser())]
    while todo:
        name, p = todo.pop()
        yield name, p
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(f"{name} {n}", sp) for n, sp in a.choices.items()]
    from speculum.train.cli import common_arguments, trainers
    for method, spec in trainers().items():
        trainer = spec.create()
        p = argparse.ArgumentParser(prog=f"speculum train {method}", formatter_class=HelpFormatter)
        common_arguments(p)
        trainer.add_arguments(p)
        yield f"speculum train {method}", p


def test_every_flag_has_help_and_its_default_shows():
    missing, no_default = [], []
    for name, p in _parsers():
        for a in p._actions:
            if not a.option_strings or isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
                continue
            if not a.help:
                missing.append(f"{name} {a.option_strings[0]}")
                continue
            if a.default not in (None, False, argparse.SUPPRESS) and a.nargs != 0:
                text = HelpFormatter("x")._get_help_string(a) % {"default": a.default, "prog": "x"}
                if "default" not in text.lower():
                    no_default.append(f"{name} {a.option_strings[0]}")
    assert not missing, f"flags without help: {missing}"
    assert not no_default, f"flags whose default is not shown: {no_default}"


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["train", "--help"], ["train", "-h"],
                                  ["train", "eagle", "--help"], ["serve", "--help"], ["bench", "offline", "--help"],
                                  ["plugins", "--help"]])
def test_help_exits_zero(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own --help
        rc = exc.code
    assert rc in (0, None)
    out = capsys.readouterr().out
    assert "usage" in out.lower()
