"""Fixtures shared by the MTP plugin's tests: a tiny random target and its parts."""

from __future__ import annotations

from speculum.testing import target_fixtures

target, parts = target_fixtures()
