"""The ``speculum`` CLI run after an in-process patch: the shared tail of the A/B wrappers
(``head_kernels.py``, ``unfold.py``), which undo an optimisation in the same process and
then run ``speculum <args>`` so before and after run in one device call."""

from __future__ import annotations

import sys


def run_cli(args: list[str]) -> None:
    """``speculum <args>`` in this process; exits with its status."""
    from speculum.cli import main
    sys.argv = ["speculum", *args]
    sys.exit(main())
