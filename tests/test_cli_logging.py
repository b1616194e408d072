"""The CLI shows the plugins' INFO notes (a head grown, a shipped draft used) as it shows the core's."""

from __future__ import annotations

import logging

import pytest

from speculum.cli import _plugin_packages, main


def test_plugin_notes_are_shown_at_info(capsys):
    if "speculum_mtp" not in _plugin_packages():
        pytest.skip("needs speculum-mtp installed")
    named = logging.getLogger("speculum_mtp")
    before = named.level
    try:
        named.setLevel(logging.NOTSET)
        assert main(["plugins"]) == 0
        assert named.getEffectiveLevel() == logging.INFO
        assert logging.getLogger("speculum_mtp.train").isEnabledFor(logging.INFO)
    finally:
        named.setLevel(before)
