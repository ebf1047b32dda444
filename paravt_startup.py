"""PyPI's CUDA torchvision made importable on CPU torch, in every process of the environment.

PyPI's torchvision wheels are CUDA builds; on a CPU torch (the pinned CPU install of ``make
install``) their ``_C`` extension cannot load, and ``import torchvision`` then fails in its
``register_fake("torchvision::nms")`` with "operator torchvision::nms does not exist".
transformers imports torchvision whenever it is installed (fast image processors, the Qwen3-VL
video processor, even ``from_pretrained`` of Qwen3-VL), so one such wheel breaks every model load.
:func:`define_torchvision_ops` defines the schemas of the two ops torchvision's Python side
registers fake kernels for; nothing calls them (paravt uses torchvision only through
transformers' processors: resize/normalise, pure torch). It acts only when the installed
torchvision is a CUDA build (``+cuXXX`` in its version file) and torch has no CUDA; a CPU or
matching CUDA torchvision is left untouched, and ops that exist already are never redefined.

Two ways in, one implementation:

- in-process: ``import paravt`` calls it (``paravt._compat``), before transformers is imported;
- every other process (a user's own script, vLLM's model-inspection subprocess, ...):
  ``make install`` runs ``python -m paravt_startup``, which writes ``paravt_startup.pth`` into
  the environment's site-packages. Its one line calls :func:`install` at interpreter start-up,
  which only appends a finder to ``sys.meta_path``; the fix runs when torchvision is first
  *imported* (just before its ``__init__`` executes). Start-up imports nothing but ``sys``, and
  a process that never imports torchvision pays nothing else; a lookup that does not import
  (``importlib.util.find_spec``, as transformers' availability probes do) does not import torch.

This module is top-level and imports only the standard library: the start-up hook must not run
``paravt/__init__`` (nor import torch) in every process.
"""

import sys

PTH_NAME = "paravt_startup.pth"
# site.py executes .pth lines that start with "import". The guard keeps start-up silent when
# paravt has been uninstalled but the .pth (written outside pip's records) is left behind.
PTH_LINE = (
    "import sys; exec('try:\\n import paravt_startup\\nexcept ImportError:\\n pass\\n"
    "else:\\n paravt_startup.install()')\n"
)

_TV_LIBRARY = None  # keeps the op definitions alive for the life of the process


def torchvision_is_cuda_build(origin: str | None = None) -> bool:
    """True when torchvision (its ``__init__.py`` at ``origin``, else found) is a CUDA build."""
    import os

    if origin is None:
        import importlib.util

        spec = importlib.util.find_spec("torchvision")
        origin = None if spec is None else spec.origin
    if origin is None:
        return False
    try:
        with open(os.path.join(os.path.dirname(origin), "version.py")) as f:
            text = f.read()
    except OSError:
        return False
    return "+cu" in text and "+cpu" not in text


def define_torchvision_ops(origin: str | None = None) -> bool:
    """Make a CUDA torchvision importable on CPU torch; True when the fix is (or was) applied.

    ``origin``: torchvision's ``__init__.py`` when the caller knows it (the start-up hook).
    """
    global _TV_LIBRARY
    if _TV_LIBRARY is not None:
        return True
    if not torchvision_is_cuda_build(origin):
        return False
    import torch

    if torch.version.cuda is not None:
        return False
    try:
        lib = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except RuntimeError:
        # The namespace or the ops exist already (another library applied the same fix, or
        # torchvision registered them itself): nothing left to do, and import must not fail.
        return False
    _TV_LIBRARY = lib
    return True


class _FixFirstLoader:
    """torchvision's own loader, with :func:`define_torchvision_ops` run before its code."""

    def __init__(self, loader: object) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> object:  # get_resource_reader, is_package, ...
        return getattr(self._loader, name)

    def create_module(self, spec: object) -> object:
        return self._loader.create_module(spec)

    def exec_module(self, module: object) -> None:
        # From here on torchvision carries its real loader (nobody sees this wrapper again).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        _remove_hook()
        try:
            define_torchvision_ops(getattr(module, "__file__", None))
        except Exception as exc:  # noqa: BLE001 - torchvision's own import error then says more
            print(f"paravt_startup: torchvision op fix failed: {exc!r}", file=sys.stderr)
        self._loader.exec_module(module)


class _TorchvisionHook:
    """A ``sys.meta_path`` finder that finds nothing itself: it wraps the loader of the real
    ``torchvision`` spec (found by the finders after it) so that the fix runs on import."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        if fullname != "torchvision":
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _TorchvisionHook) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _FixFirstLoader(spec.loader)
                return spec
        return None


def _remove_hook() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _TorchvisionHook)]


def install() -> None:
    """Run the fix when torchvision is first imported (called by ``paravt_startup.pth``)."""
    if "torchvision" in sys.modules or any(isinstance(f, _TorchvisionHook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _TorchvisionHook())


def write_pth(site_dir: str | None = None) -> str:
    """Write ``paravt_startup.pth`` into ``site_dir`` (default: this interpreter's purelib)."""
    import os
    import sysconfig

    site_dir = site_dir or sysconfig.get_paths()["purelib"]
    path = os.path.join(site_dir, PTH_NAME)
    with open(path, "w") as f:
        f.write(PTH_LINE)
    return path


if __name__ == "__main__":
    print(f"paravt_startup: wrote {write_pth()}")
    # Every process imports this module at start-up: cache its bytecode now, so that processes
    # run with PYTHONDONTWRITEBYTECODE=1 (they only read caches) do not compile it each time.
    import py_compile

    py_compile.compile(__file__, doraise=False)
