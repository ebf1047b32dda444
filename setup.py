"""Build script: the Python packages (paravt, paravt_kernels) and the optional native extension.

``kernels/`` is installed as ``paravt_kernels`` (never a bare ``kernels`` import: PyPI's
``kernels`` package, which transformers probes for, would collide).
"""

from setuptools import find_packages, setup

packages = find_packages(include=["paravt", "paravt.*"])
packages += [
    "paravt_kernels" + p[len("kernels") :] for p in find_packages(include=["kernels", "kernels.*"])
]

setup(
    packages=packages,
    package_dir={"paravt": "paravt", "paravt_kernels": "kernels"},
)
