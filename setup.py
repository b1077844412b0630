"""pip's build step for the dmuon package (metadata in pyproject.toml): builds libdmuon_c with CMake and
puts it inside the package. DMUON_BUILD_DIR reuses an existing CMake build folder (default: build-pip,
configured without tests); DMUON_JOBS sets the build's parallel jobs (default 2)."""

import os
import pathlib
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent


def build_library():
    build = pathlib.Path(os.environ.get("DMUON_BUILD_DIR", ROOT / "build-pip"))
    if not (build / "CMakeCache.txt").exists():
        subprocess.check_call(["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                               "-DDMUON_BUILD_TESTS=OFF"])
    subprocess.check_call(["cmake", "--build", str(build), "--target", "dmuon_c", "-j", os.environ.get("DMUON_JOBS", "2")])
    return build / "python" / "dmuon" / "libdmuon_c.so"


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        shutil.copy2(build_library(), pathlib.Path(self.build_lib) / "dmuon" / "libdmuon_c.so")


class BinaryDistribution(Distribution):
    """The package carries a native library: the wheel is platform-specific."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibrary}, distclass=BinaryDistribution,
      options={"build": {"build_base": str(ROOT / "build-pip" / "setuptools")}})
