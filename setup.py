"""Build script: the Python packages (paravt, paravt_kernels) and the optional native extension."""

from setuptools import setup

setup()
