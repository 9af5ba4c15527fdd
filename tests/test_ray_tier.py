"""Every test the Ray tier names (``conftest.RAY_TIER``) exists: a renamed test would otherwise
leave the tier silently, marked ``extended``, and ``make test`` would stop running it."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import RAY_TIER

HERE = Path(__file__).parent


def test_every_test_the_ray_tier_names_exists():
    missing = []
    for node_id in sorted(RAY_TIER):
        file, name = node_id.split("::")
        path = HERE / file
        functions = {n.name for n in ast.walk(ast.parse(path.read_text()))
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))} if path.exists() else set()
        if name.split("[")[0] not in functions:
            missing.append(node_id)
    assert not missing, f"RAY_TIER names tests that do not exist: {missing}"
    assert len(RAY_TIER) >= 20
