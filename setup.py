"""Build script: the Python package ``paravt`` and the optional native extension.

``kernels/`` (the package ``paravt_kernels``) is its own distribution, ``paravt-kernels``
(``kernels/pyproject.toml``), which ``paravt`` depends on (``pyproject.toml``): this
distribution does not ship those files, so that one distribution owns them. ``make install``
installs both editable (``pip install -e ./kernels -e .``). ``paravt_startup`` is a
top-level, stdlib-only module (the torchvision fix and its interpreter start-up hook, which
``make install`` enables with ``python -m paravt_startup``).
"""

from setuptools import find_packages, setup

packages = find_packages(include=["paravt", "paravt.*"])


def _native_extension() -> tuple[list, dict]:
    """``paravt._C`` (csrc/): CPU ops always, CUDA ops when torch itself has CUDA.

    Skipped with ``PARAVT_SKIP_EXT=1`` or when torch is not importable; a failed build warns
    loudly and the install continues (paravt.vision.pack then falls back to the torch path).
    ``PARAVT_FORCE_EXT=1`` turns a failed build into an error instead.
    """
    import os
    import sys

    if os.environ.get("PARAVT_SKIP_EXT", "0") == "1":
        print("paravt: PARAVT_SKIP_EXT=1, not building paravt._C", file=sys.stderr)
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("paravt: torch not importable at build time, not building paravt._C", file=sys.stderr)
        return [], {}
    cpu = ["csrc/bindings.cpp", "csrc/pack_vision_cpu.cpp"]
    cxx = ["-O3", "-std=c++20", "-ffp-contract=off", "-fopenmp"]
    with_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if with_cuda and os.environ.get("PARAVT_SKIP_CUDA", "0") != "1":
        ext = cpp_extension.CUDAExtension(
            "paravt._C",
            cpu + ["csrc/pack_vision_cuda.cpp", "csrc/cuda/pack_kernels.cu"],
            include_dirs=[os.path.abspath("csrc")],
            define_macros=[("PARAVT_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--fmad=false"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = cpp_extension.CppExtension(
            "paravt._C",
            cpu,
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args=cxx,
            extra_link_args=["-fopenmp"],
        )

    class OptionalBuildExt(cpp_extension.BuildExtension):
        def run(self) -> None:
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any compiler failure must not block install
                if os.environ.get("PARAVT_FORCE_EXT", "0") == "1":
                    raise
                bar = "!" * 78
                print(
                    f"{bar}\nparavt: building the native extension paravt._C FAILED ({exc}).\n"
                    "paravt will use the slower pure-torch pack_vision path. Fix the compiler\n"
                    f"error above, or set PARAVT_SKIP_EXT=1 to silence this.\n{bar}",
                    file=sys.stderr,
                )

    return [ext], {"build_ext": OptionalBuildExt.with_options(use_ninja=True)}


ext_modules, cmdclass = _native_extension()

setup(
    packages=packages,
    py_modules=["paravt_startup"],
    package_dir={"paravt": "paravt"},
    # The architecture configs of model.config (dimensions only): python -m paravt.plan.
    package_data={"paravt.models": ["arch/*.json"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
