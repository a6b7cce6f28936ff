"""The README's example: a torch.nn MLP on Fashion-MNIST with distopt's AdamW."""

import os
import pathlib
import subprocess
import sys

import pytest

from distopt.data import fashion_mnist

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_fashion_mnist_reader():
    x, y = fashion_mnist("test")
    assert tuple(x.shape) == (10000, 784) and tuple(y.shape) == (10000,)
    assert 0.0 <= x.min().item() and x.max().item() <= 1.0 and set(y.unique().tolist()) == set(range(10))
    with pytest.raises(ValueError, match="split must be"):
        fashion_mnist("validation")
    with pytest.raises(OSError):
        fashion_mnist("train", root="/nonexistent")


def test_example_trains_to_the_accuracy_torch_reaches():
    out = subprocess.run([sys.executable, str(ROOT / "examples/python/fashion_mnist_mlp.py"), "--epochs", "1"],
                         capture_output=True, text=True, check=True, env=os.environ)
    acc = float(out.stdout.split("test accuracy ")[1].split()[0])
    assert acc > 0.83, out.stdout


def test_sharded_example_under_mpirun():
    """The README's second example: the same loop on 2 processes with ShardedOptimizer (zero1)."""
    import shutil

    from distopt import _core

    mpirun = shutil.which("mpirun")
    if mpirun is None or not _core.mpi_built():
        pytest.skip("no mpirun or a build without MPI")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_btl_vader_single_copy_mechanism="none")
    out = subprocess.run([mpirun, "-np", "2", sys.executable, str(ROOT / "examples/python/fashion_mnist_sharded.py")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    line = [s for s in out.stdout.splitlines() if "test accuracy" in s]
    assert len(line) == 1 and "2 ranks over mpi, adamw zero1" in line[0], out.stdout
    assert float(line[0].split("test accuracy ")[1].split()[0]) > 0.83, out.stdout


def test_gossip_example_under_mpirun(tmp_path):
    """The gossip example: SGP on 2 processes through GossipDataParallel,
    evaluated on the ranks' average, saved and resumed."""
    import shutil

    from distopt import _core

    mpirun = shutil.which("mpirun")
    if mpirun is None or not _core.mpi_built():
        pytest.skip("no mpirun or a build without MPI")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_btl_vader_single_copy_mechanism="none")
    cmd = [mpirun, "-np", "2", sys.executable, str(ROOT / "examples/python/fashion_mnist_gossip.py"), "--checkpoint",
           str(tmp_path / "ckpt")]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    line = [s for s in out.stdout.splitlines() if "test accuracy" in s]
    assert len(line) == 1 and "2 ranks over mpi, sgp with sgd" in line[0], out.stdout
    assert float(line[0].split("test accuracy ")[1].split()[0]) > 0.83, out.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0 and "resumed from" in again.stdout and "test accuracy" not in again.stdout, \
        again.stdout + again.stderr
