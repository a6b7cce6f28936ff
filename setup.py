"""Builds distopt._core with CMake for pip and python3 -m build (pyproject.toml
has the metadata). The extension is CMake's `distopt_python` target, built
for the interpreter that runs this (-DPython_EXECUTABLE); its .so is copied
into the package.

DISTOPT_CMAKE_BUILD_DIR: a CMake build tree to build in (an existing one
is reused: only what changed is rebuilt); default build-python/cmake.
DISTOPT_CMAKE_ARGS: more -D arguments for a new tree (space-separated).
"""

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
os.makedirs(os.path.join(HERE, "build-python"), exist_ok=True)  # egg_base below must exist


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        given = os.environ.get("DISTOPT_CMAKE_BUILD_DIR")
        tree = os.path.abspath(given or os.path.join(HERE, "build-python", "cmake"))
        if not os.path.exists(os.path.join(tree, "CMakeCache.txt")):
            args = ["-DCMAKE_BUILD_TYPE=Release", "-DDISTOPT_BUILD_TESTS=OFF", "-DDISTOPT_PYTHON=ON"]
            args += os.environ.get("DISTOPT_CMAKE_ARGS", "").split()
            subprocess.run(["cmake", "-S", HERE, "-B", tree, f"-DPython_EXECUTABLE={sys.executable}", *args], check=True)
        elif not given:  # our own tree follows the interpreter that runs this
            subprocess.run(["cmake", "-S", HERE, "-B", tree, f"-DPython_EXECUTABLE={sys.executable}"], check=True,
                           stdout=subprocess.DEVNULL)
        jobs = str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", tree, "--target", "distopt_python", "-j", jobs], check=True)
        built = glob.glob(os.path.join(tree, "python", "distopt", "_core*.so"))
        if len(built) != 1:
            raise RuntimeError(f"expected one distopt/_core*.so under {tree}/python, found {built}")
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        if not built[0].endswith(suffix):
            raise RuntimeError(f"{built[0]} is not for this interpreter ({sys.executable}, {suffix}): configure "
                               f"{tree} with -DPython_EXECUTABLE={sys.executable}, or unset DISTOPT_CMAKE_BUILD_DIR")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built[0], target)


setup(
    ext_modules=[Extension("distopt._core", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    # setuptools' own scratch stays out of CMake's build/.
    options={"build": {"build_base": os.path.join("build-python", "setuptools")},
             "egg_info": {"egg_base": "build-python"}},
)
