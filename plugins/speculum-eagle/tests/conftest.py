"""Fixtures shared by the EAGLE plugin's tests: a tiny random target and its parts."""

from __future__ import annotations

from speculum.testing import target_fixtures

# 4 layers: EAGLE-3's default aux layers (2, L//2, L-3) exist and avoid the last one
target, parts = target_fixtures(num_layers=4)
