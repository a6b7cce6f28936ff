"""Installing like a Python package (docs/python.md, "Installing"): pip from
a clone, a wheel, and `cmake --install`, each into a fresh place, then a
training step from there.

The builds reuse the suite's CMake tree (DISTOPT_BUILD_DIR, set by ctest)
through setup.py's DISTOPT_CMAKE_BUILD_DIR, so nothing is compiled twice;
run by hand, point DISTOPT_BUILD_DIR at a configured tree."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
STEP = """
import sys, torch, distopt
import distopt.torch.optim as optim
from distopt.torch.distributed import ShardedOptimizer
assert distopt.__file__.startswith(sys.argv[1]), distopt.__file__
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = optim.AdamW(model.parameters(), lr=1e-2)
model(torch.randn(8, 4)).pow(2).sum().backward()
opt.step()
sharded = ShardedOptimizer(torch.nn.Linear(4, 2).parameters(), "lamb", "zero2")
print("trained", distopt.__version__)
"""


def _build_dir():
    d = os.environ.get("DISTOPT_BUILD_DIR")
    if not d:
        pytest.skip("DISTOPT_BUILD_DIR (a configured CMake tree) is set by ctest")
    return d


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only what was installed
    env.update(extra)
    return env


def _run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _venv(path):
    # Debian's torch and numpy from the system site: pip runs offline.
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(path)])
    return os.path.join(path, "bin", "python")


def test_pip_install_from_a_clone_into_a_venv(tmp_path):
    python = _venv(tmp_path / "venv")
    _run([python, "-m", "pip", "install", "--no-build-isolation", "--no-index", REPO],
         env=_env(DISTOPT_CMAKE_BUILD_DIR=_build_dir()), cwd=tmp_path)
    r = _run([python, "-c", STEP, str(tmp_path / "venv")], env=_env(), cwd=tmp_path)
    assert "trained 0.3.0" in r.stdout


def test_a_wheel_installs_into_a_venv(tmp_path):
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), REPO],
         env=_env(DISTOPT_CMAKE_BUILD_DIR=_build_dir()), cwd=REPO)
    wheels = os.listdir(tmp_path / "dist")
    assert len(wheels) == 1 and wheels[0].startswith("distopt-0.3.0-") and wheels[0].endswith(".whl"), wheels
    python = _venv(tmp_path / "venv")
    _run([python, "-m", "pip", "install", "--no-index", str(tmp_path / "dist" / wheels[0])], env=_env())
    r = _run([python, "-c", STEP, str(tmp_path / "venv")], env=_env(), cwd=tmp_path)
    assert "trained 0.3.0" in r.stdout


def test_cmake_install_says_where_the_interpreter_does_not_look(tmp_path):
    prefix = tmp_path / "prefix"
    r = _run(["cmake", "--install", _build_dir(), "--prefix", str(prefix), "--component", "python"])
    lines = [ln for ln in r.stdout.splitlines() if "does not search" in ln]
    assert len(lines) == 1, r.stdout
    path = lines[0].split("export PYTHONPATH=")[1].split("$")[0]
    assert path.startswith(str(prefix)) and os.path.isdir(os.path.join(path, "distopt"))
    r = _run([sys.executable, "-c", STEP, path], env=_env(PYTHONPATH=path), cwd=tmp_path)
    assert "trained 0.3.0" in r.stdout
