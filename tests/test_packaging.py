"""What ``pip install .`` puts into site-packages: one importable name, ``chronostream``.

The layers keep their top-level directories in the repository (``slices/``,
``containers/``, ``master/``) and install as subpackages of ``chronostream``;
``benchmarks/``, ``examples/`` and ``tests/`` are not installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import chronostream as cs

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_holds_only_the_chronostream_package(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("chronostream", "slices", "containers", "master", "benchmarks", "examples"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    wheel, = (tmp_path / "dist").glob("chronostream-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"chronostream", f"chronostream-{cs.__version__}.dist-info"}, tops
    for layer in ("slices", "containers", "master"):
        assert f"chronostream/{layer}/__init__.py" in names
    assert "chronostream/slices/group.py" in names and "chronostream/master/actor.py" in names
    assert "chronostream/sim/queries.py" in names
    assert "chronostream/py.typed" in names
    assert "chronostream/master/dashboard.html" in names  # (the job serves it: master.ray_http)
    top_level = zipfile.ZipFile(wheel).read(f"chronostream-{cs.__version__}.dist-info/top_level.txt").decode()
    assert top_level.split() == ["chronostream"]


def test_the_cli_says_its_version():
    done = subprocess.run([sys.executable, "-m", "chronostream", "--version"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"chronostream {cs.__version__}"


def test_the_layers_import_by_the_installed_names():
    import chronostream.containers.core as core
    import chronostream.master.actor as actor
    import chronostream.slices.group as group

    for module in (core, actor, group):
        assert module.__name__.startswith("chronostream.")
    assert "slices" not in sys.modules and "master" not in sys.modules and "containers" not in sys.modules
