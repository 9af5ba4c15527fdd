"""The runnable examples in the docstrings of every module of the installed package.

The modules are found by their import names (``chronostream``,
``chronostream.slices``, ``chronostream.containers``, ``chronostream.master``),
so each is imported once under the name users and the runtime use, never a
second time under a path-derived name.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import chronostream

LAYERS = ("chronostream", "chronostream.slices", "chronostream.containers", "chronostream.master")


def _modules() -> list[str]:
    names = []
    for layer in LAYERS:
        pkg = importlib.import_module(layer)
        names.append(layer)
        # The face's own directory only: in a source checkout its path also holds the checkout
        # root, where the layers are found by their own names below.
        path = pkg.__path__[:1]
        # Subpackages too (the simulator, chronostream.sim).
        names.extend(m.name for m in pkgutil.walk_packages(path, layer + ".") if not m.name.endswith(".__main__"))
    return sorted(set(names))


MODULES = _modules()


def test_every_layer_has_modules():
    """The walk finds the modules of each layer (an empty walk would pass every doctest vacuously)."""
    for layer in LAYERS[1:]:
        assert sum(m.startswith(layer + ".") for m in MODULES) >= 5, (layer, MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str):
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    report: list[str] = []
    for test in finder.find(module, name):
        runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
