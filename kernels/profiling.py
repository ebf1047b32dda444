"""Measurement helpers for the kernel benchmarks.

``peak_cpu_alloc_bytes`` measures what torch's CPU allocator hands out: it runs ``fn`` under
``torch.profiler`` with ``profile_memory=True``, which records one signed event per CPU
allocation (+bytes) and free (-bytes), sorts them by time and returns the peak of their
running sum: the largest amount of *additional* torch memory live at any moment during
``fn`` (tensors that exist before the call are not counted; tensors ``fn`` frees that were
allocated before are, as negative steps). ``tracemalloc`` cannot do this (torch allocates
outside Python's allocator) and process RSS is blurred by the allocator's caching.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def peak_cpu_alloc_bytes(fn: Callable[[], object]) -> int:
    """Peak additional bytes allocated by torch on the CPU while ``fn()`` runs.

    Garbage is collected first: tensors left in reference cycles by an earlier call (the
    Triton interpreter leaves its launch buffers so) would otherwise be freed during ``fn``
    and count as negative steps (a run of the previous ``linear_logprob`` backward read
    16 MiB, below its own 32 MiB weight gradient)."""
    import gc

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort()
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return peak


def median_seconds(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def report_ratios(
    benchmark: object,
    title: str,
    shape: str,
    baseline: str,
    seconds: tuple[float, float],
    peak_bytes: tuple[int, int],
) -> dict[str, object]:
    """The benchmarks' one report of ours against a baseline measured in the same run:
    ``seconds`` / ``peak_bytes`` are ``(ours, baseline)``. Puts the times, peaks and their
    ratios (ours / baseline, lower is better) in ``benchmark.extra_info`` (pytest-benchmark's
    JSON) and prints them; returns them."""
    (t_ours, t_base), (m_ours, m_base) = seconds, peak_bytes
    info: dict[str, object] = {
        "shape": shape,
        "baseline": baseline,
        "ours_s": t_ours,
        "baseline_s": t_base,
        "time_ratio": t_ours / t_base,
        "ours_peak_mib": m_ours / 2**20,
        "baseline_peak_mib": m_base / 2**20,
        "mem_ratio": m_ours / m_base,
    }
    benchmark.extra_info.update(info)  # type: ignore[attr-defined]
    print(
        f"\n{title} vs {baseline}: "
        + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())
    )
    return info


# aten ops that launch no kernel on a GPU (allocation, views, metadata): not counted.
NO_KERNEL_OPS = frozenset(
    "aten::" + n
    for n in (
        "empty", "empty_strided", "empty_like", "view", "_unsafe_view", "reshape", "as_strided",
        "select", "slice", "unbind", "detach", "detach_", "alias", "t", "transpose", "expand",
        "unsqueeze", "squeeze", "permute", "contiguous", "lift_fresh", "to", "resolve_conj",
        "resolve_neg", "result_type", "is_nonzero", "_reshape_alias", "numpy_T", "item",
        "_local_scalar_dense", "size", "stride", "lift_fresh_copy", "set_",
    )
)  # fmt: skip


@dataclasses.dataclass
class LaunchCount:
    """What ``count_launches`` measured for one call of ``fn``: the Triton kernels launched
    (names, in order), the torch ops that run a kernel (outermost ``aten::`` ops outside the
    Triton launches, less ``NO_KERNEL_OPS``), and the tensor arguments of each Triton launch
    (``(name, ((numel, bytes) of each tensor argument))``)."""

    triton: list[str]
    torch_ops: list[str]
    triton_args: list[tuple[str, tuple[tuple[int, int], ...]]]

    def tensor_bytes(self, numel: int) -> int:
        """Bytes of the Triton launches' tensor arguments that have ``numel`` elements (the
        per-token streams of a packed batch of ``numel`` tokens), summed over launches."""
        return sum(b for _, args in self.triton_args for k, b in args if k == numel)

    @property
    def total(self) -> int:
        """Kernel launches per call: Triton launches + torch ops that run a kernel."""
        return len(self.triton) + len(self.torch_ops)


def count_launches(fn: Callable[[], object]) -> LaunchCount:
    """Run ``fn()`` once and count the kernel launches it makes (CPU or GPU).

    Triton launches are recorded by the ``lazy_jit`` wrapper (``_triton_utils.record_launches``:
    each launch, compiled or interpreted, appends its kernel name); torch ops by
    ``torch.profiler``: the outermost ``aten::`` op of each call that runs work (one per op
    the code calls: ``aten::sum``'s internal fill is not counted again), outside the Triton
    launches' ranges (the interpreter's own copies); the ops that launch nothing on a GPU
    (``NO_KERNEL_OPS``: allocations, views, a no-op ``to``) are looked into, not counted.
    Used by
    ``tests/test_kernels_policy_loss.py`` (<= 4 per call) and ``bench/gpu_kernels.py``."""
    from ._triton_utils import record_launches

    with profile(activities=[ProfilerActivity.CPU]) as prof, record_launches() as log:
        fn()
    ops: list[str] = []

    def walk(ev, inside_triton: bool) -> None:
        inside = inside_triton or ev.name.startswith("triton::")
        if inside:
            return
        if ev.name.startswith("aten::") and ev.name not in NO_KERNEL_OPS:
            ops.append(ev.name)  # the op the caller ran; its own sub-ops are its kernel(s)
            return
        for c in ev.cpu_children:  # e.g. aten::to -> aten::_to_copy, or a custom op's body
            walk(c, inside)

    for ev in prof.events():
        if ev.cpu_parent is None:
            walk(ev, False)
    return LaunchCount([name for name, _ in log], ops, list(log))


def sm90_registers(
    specs: list[tuple[object, dict[str, str], dict[str, object], int]],
) -> list[dict[str, int]]:
    """Registers per thread (and spill bytes) of ``lazy_jit`` kernels compiled for sm_90 by
    Triton's own ptxas, without a GPU: one ``{"registers", "local_bytes", "stack_bytes"}``
    per ``(kernel, types, constexprs, num_warps)`` of ``specs``.

    ``types`` maps non-constexpr arguments to Triton signature types (``"*fp32"``, ``"i64"``,
    ``"fp32"``, ...), ``constexprs`` gives the rest. Registers decide how many programs fit
    on an SM (65,536 registers per SM); a compile also rejects what the interpreter accepts
    (non-constexpr globals). The compiles run in one child process without
    ``TRITON_INTERPRET``: in a process that has run the interpreter, Triton's language
    module can be left patched (a compile then failed now and then in a test run). Used by
    ``tests/test_kernels_policy_loss.py`` and ``bench/gpu_kernels.py``. Raises
    ``RuntimeError`` when Triton ships no ``cuobjdump`` or a compile fails."""
    import json
    import os
    import subprocess
    import sys

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        raise RuntimeError(f"no {tool}: this Triton build ships no NVIDIA tools")
    job = [
        {"module": k.fn.__module__, "name": k.fn.__name__, "types": t, "constexprs": c,  # type: ignore[attr-defined]
         "num_warps": w}
        for k, t, c, w in specs
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import json, sys\n"
        "from paravt_kernels.profiling import _sm90_compile\n"
        "print(json.dumps([_sm90_compile(**j) for j in json.loads(sys.argv[1])]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, json.dumps(job)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"sm_90 compile failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _sm90_compile(
    module: str, name: str, types: dict, constexprs: dict, num_warps: int
) -> dict[str, int]:
    """One compile of ``sm90_registers`` (in its child process)."""
    import importlib
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = getattr(importlib.import_module(module), name)
    fn = JITFunction(kernel.fn)
    names = fn.arg_names
    sig = {n: ("constexpr" if n in constexprs else types[n]) for n in names}
    src = ASTSource(fn=fn, signature=sig,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})  # fmt: skip
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})  # fmt: skip
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", out))
    return {
        "registers": int(found["REG"]),
        "local_bytes": int(found.get("LOCAL", 0)),
        "stack_bytes": int(found.get("STACK", 0)),
    }


def policy_loss_op_host_cost(
    device: str = "meta", impl: str = "torch", n_tokens: int = 64, calls: int = 200
) -> dict[str, float]:
    """Host cost of the ``torch.library`` registration of ``paravt::policy_loss``: seconds per
    call of the registered op against a plain call of the Python function behind it, same
    arguments, with autograd (a leaf log-prob: the op's autograd wrapper saves context) and
    without. ``device="meta"``: the op dispatches to its fake kernel, compared with calling
    that function directly: the work is a few allocations, so the difference is the
    registration alone (dispatcher, custom-op wrappers, autograd node), measurable on a
    loaded CPU. ``"cpu"``/``"cuda"``: the real implementation ``ops._policy_loss`` with
    ``impl``, on ``n_tokens`` tokens in 4 sequences (on CUDA each timing ends with a
    synchronize: the host cost when the device keeps up). Returns ``{op_s, plain_s, ratio,
    extra_us, op_grad_s, ratio_grad, extra_grad_us}``. Used by
    ``bench/test_bench_kernels_policy_loss.py`` and ``bench/gpu_kernels.py``."""
    from . import ops
    from .options import PolicyLossOptions

    g = torch.Generator().manual_seed(0)
    n = n_tokens
    old = -torch.rand(n, generator=g) * 3
    lp = old + 0.1 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    mask = torch.ones(n)
    cu = torch.linspace(0, n, 5).long()
    lp, old, adv, mask, cu = (t.to(device) for t in (lp, old, adv, mask, cu))
    opts = PolicyLossOptions(agg="seq-mean-token-mean")
    args = (lp, old, adv, mask, None, None, cu, None, *opts.schema_args(), impl)
    args_grad = (lp.clone().requires_grad_(), *args[1:])
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    plain_fn = ops._policy_loss_fake if device == "meta" else ops._policy_loss

    def per_call(fn, a) -> float:
        fn(*a)
        sync()
        best = float("inf")
        for _ in range(5):  # best of 5 blocks of `calls`: a loaded machine's noise is one-sided
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(*a)
            sync()
            best = min(best, (time.perf_counter() - t0) / calls)
        return best

    plain = per_call(plain_fn, args)
    op = per_call(ops.policy_loss_op, args)
    op_grad = per_call(ops.policy_loss_op, args_grad)
    return {
        "op_s": op,
        "plain_s": plain,
        "ratio": op / plain,
        "extra_us": (op - plain) * 1e6,
        "op_grad_s": op_grad,
        "ratio_grad": op_grad / plain,
        "extra_grad_us": (op_grad - plain) * 1e6,
    }


def policy_loss_step(x: dict[str, torch.Tensor], grad_seed: torch.Tensor) -> Callable[[], None]:
    """One ``policy_loss`` forward + backward on the inputs ``x`` (``lp`` with grad, ``old``,
    ``adv``, ``mask``, ``ref``, ``prox``, ``cu``), decoupled objective with the behaviour cap
    and k3 KL, seq-mean-token-mean: the call whose launches the tests count
    (tests/test_kernels_policy_loss.py) and whose bandwidth the device check measures
    (``bench/gpu_kernels.py --issue37``)."""
    from paravt_kernels import policy_loss

    def step() -> None:
        loss, _ = policy_loss(x["lp"], x["old"], x["adv"], x["mask"], ref_logprob=x["ref"],
                              prox_logprob=x["prox"], behav_cap=2.0, kl_coef=0.01,
                              kl_type="k3", agg="seq-mean-token-mean",
                              cu_seqlens=x["cu"])  # fmt: skip
        torch.autograd.grad(loss, x["lp"], grad_outputs=grad_seed)

    return step
