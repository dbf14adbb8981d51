"""bik: deterministic, batch-invariant kernels for LLM inference and training.

On a CPU machine install torch==2.13.0 first (the Makefile does): a bare ``torch``
requirement resolved from scratch pulls the CUDA build and gigabytes of CUDA wheels.
"""

from setuptools import find_packages, setup

setup(
    name="bik",
    version="0.1.0",
    description="Deterministic, batch-invariant kernels for LLM inference and training",
    python_requires=">=3.10",
    packages=find_packages(include=["bik", "bik.*", "rl_harness", "rl_harness.*"]),
    install_requires=["torch", "triton", "numpy"],
    extras_require={"dev": ["pytest", "hypothesis"]},
)
