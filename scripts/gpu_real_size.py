"""Step 2 of ``scripts/gpu_train_check.sh`` (issue 36): PARA-GRPO steps of a real-size model,
measured phase by phase.

    python scripts/gpu_real_size.py --json OUT.json [--gen-tokens 128] [--profile-step N] \
        -- [python -m paravt.train's arguments: --preset, key=value ...]

It builds the trainer exactly as ``python -m paravt.train`` does (``paravt.train.parse_args``,
``validate_run``, ``check_device_memory``, ``build_trainer``: data, a ``model.init=random``
checkpoint, the engine) and runs ``train.steps`` calls of ``paravt.train.train_step``. What it
adds is measurement only:

- the main agents' turns come from the synthetic task's oracle
  (``paravt.engines.oracle.OracleMainEngine``; ``--no-oracle`` turns this off): a
  random-initialised model never writes a tool call, so without it no crop, sub-agent or crop
  decode would run. Sub-agents generate with the real engine. Only prompts whose oracle calls
  the tool are drawn, and the run counts the tool calls, crops and sub-agent trajectories of
  its RL steps (``tool_work``, from the step metrics ``rollout/crops`` and
  ``rollout/sub_agents``): a run in which none ran is ``failed``, not ``ok``;
- a phase clock installed where the run's preemption handler sits (``Trainer.preempt``:
  ``train_step`` calls its ``enter(step, phase)`` at every phase boundary): per phase the
  synchronised wall time and the peak CUDA memory (``torch.cuda.max_memory_allocated``, reset
  at each boundary), and a ``record_function`` range per phase for the profiler;
- the vision tower's forward time per phase (each model's ``get_image_features`` /
  ``get_video_features`` timed, synchronised);
- from the step's own metrics (``packed_tokens``, ``time/overview`` ... ``time/sub_gen``):
  tokens/s per phase and the update's MFU = 6 · trained parameters · packed tokens · PPO
  epochs / update time, over ``--peak-tflops`` (989: H100/H200 dense bf16);
- the memory plan of the same config (``paravt.plan.plan_memory``) beside the measured peaks;
- the engine's generation alone at a fixed shape (``--gen-batch`` prompts of
  ``--gen-prompt`` tokens, ``--gen-tokens`` new tokens each);
- a torch profiler trace of step ``--profile-step``: the top operators by device time.

Writes ``--json`` (rewritten after every stage, so a run cut short by its time limit still
leaves what it measured) and prints a short report. ``--small-arch PATH`` instead writes a
narrowed Qwen3-VL-2B architecture (real vocabulary, a few MB) for the CPU dry run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

GIB = 1 << 30


class PhaseClock:
    """Stands where ``paravt.train`` keeps its ``Preemption`` (``Trainer.preempt``): the step
    calls ``enter(step, phase)`` at each phase boundary and ``should_abandon()`` after the
    rollout. Records per (step, phase) the synchronised seconds and the peak CUDA bytes."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.rows: list[dict[str, Any]] = []
        self.phase = "startup"
        self.step = 0
        self._t = time.perf_counter()
        self._range: Any = None
        self._reset()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def enter(self, step: int, phase: str) -> None:
        self._sync()
        now = time.perf_counter()
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        row = {"step": self.step, "phase": self.phase, "seconds": now - self._t}
        if self.cuda:
            row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        self.rows.append(row)
        self._reset()
        self.step, self.phase, self._t = step, phase, now
        self._range = torch.profiler.record_function(f"phase/{phase}")
        self._range.__enter__()

    def should_abandon(self) -> bool:  # no signal handling in a measurement run
        return False


class VisionTimer:
    """Synchronised wall time of every vision-tower call (``get_image_features`` /
    ``get_video_features`` of each Qwen-VL backbone in ``models``), summed per phase of
    ``clock``. Forward only: the tower's backward runs inside the update's backward."""

    def __init__(self, models: list[torch.nn.Module], clock: PhaseClock) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._depth = 0
        seen: set[int] = set()
        for m in models:
            for mod in m.modules():
                if id(mod) in seen or not hasattr(mod, "visual"):
                    continue
                for name in ("get_image_features", "get_video_features"):
                    if hasattr(mod, name):
                        setattr(mod, name, self._wrap(getattr(mod, name)))
                seen.add(id(mod))

    def _wrap(self, fn: Any) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            if self._depth:  # get_video_features delegating to get_image_features
                return fn(*a, **k)
            self._depth += 1
            self.clock._sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.clock._sync()
                ph = self.clock.phase
                self.seconds[ph] = self.seconds.get(ph, 0.0) + time.perf_counter() - t0
                self.calls[ph] = self.calls.get(ph, 0) + 1
                self._depth -= 1

        return timed


def plan_figures(cfg: Any, cuda: bool, gpu: str) -> dict[str, Any]:
    """The memory plan of ``cfg`` on one rank of this device (``--gpu``'s size without one)."""
    from paravt.plan import GPUS, Layout, plan_memory

    if cuda:
        dev_bytes, name = torch.cuda.get_device_properties(0).total_memory, "this device"
    else:
        dev_bytes, name = GPUS[gpu], gpu
    pl = plan_memory(cfg, Layout(1, 1, int(dev_bytes), name, gpu=True))
    return {
        "device": name,
        "device_gib": dev_bytes / GIB,
        "rollout_gib": pl.rollout / GIB,
        "update_gib": pl.update / GIB,
        "peak_gib": pl.peak / GIB,
        "fits": pl.fits,
        "terms_gib": {t.name: [t.rollout / GIB, t.update / GIB] for t in pl.terms},
    }


def fixed_generation(engine: Any, batch: int, prompt: int, new: int, seed: int) -> dict:
    """The engine's generation alone: ``batch`` text prompts of ``prompt`` token ids (plain
    ids of the tiny tokenizer's range, no special token) and ``new`` new tokens each. A
    random model may still sample a stop token: the tokens actually generated are counted."""
    from paravt.engines.engine import GenerationRequest, SamplingParams

    g = torch.Generator().manual_seed(seed)
    reqs = [
        GenerationRequest(
            prompt_ids=torch.randint(300, 3000, (prompt,), generator=g).tolist(),
            sampling=SamplingParams(temperature=1.0, max_new_tokens=new, seed=seed + i),
            request_id=f"fixed{i}",
        )
        for i in range(batch)
    ]
    engine.generate(reqs[:1])  # warm-up (allocator, kernels)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    t0 = time.perf_counter()
    res = engine.generate(reqs)
    sync()
    dt = time.perf_counter() - t0
    n = sum(len(r.token_ids) for r in res)
    return {
        "batch": batch,
        "prompt_tokens": prompt,
        "max_new_tokens": new,
        "generated_tokens": n,
        "seconds": dt,
        "tokens_per_s": n / max(dt, 1e-9),
        "finish_reasons": sorted({r.finish_reason for r in res}),
    }


def top_ops(averages: Any, n: int = 25) -> list[dict[str, Any]]:
    """The profiler's operators by self device time (self CPU time without a device);
    ``averages``: the profile's ``key_averages()`` (computed once for this and
    :func:`phase_ranges`: each call re-aggregates every event of the step)."""
    rows = []
    for e in averages:
        dev = float(getattr(e, "self_device_time_total", 0.0) or 0.0)
        rows.append(
            {
                "name": e.key,
                "self_device_ms": dev / 1e3,
                "device_total_ms": float(getattr(e, "device_time_total", 0.0) or 0.0) / 1e3,
                "self_cpu_ms": e.self_cpu_time_total / 1e3,
                "calls": e.count,
            }
        )
    key = "self_device_ms" if any(r["self_device_ms"] > 0 for r in rows) else "self_cpu_ms"
    rows = [r for r in rows if not r["name"].startswith("phase/")]
    return sorted(rows, key=lambda r: -r[key])[:n]


def phase_ranges(averages: Any) -> dict[str, float]:
    """Device time under each ``phase/<name>`` range of the profiled step (ms); ``averages``:
    the profile's ``key_averages()``."""
    return {
        e.key: float(getattr(e, "device_time_total", 0.0) or 0.0) / 1e3
        for e in averages
        if e.key.startswith("phase/")
    }


def summarise(res: dict[str, Any], clock: PhaseClock, vision: VisionTimer, cfg: Any) -> None:
    """Per phase over the RL steps (step 1 counts as warm-up when there are more)."""
    steps = sorted({r["step"] for r in clock.rows if r["step"] > 0})
    measured = steps[1:] if len(steps) > 1 else steps
    per: dict[str, dict[str, float]] = {}
    for r in clock.rows:
        if r["step"] in measured:
            d = per.setdefault(r["phase"], {"seconds": 0.0, "peak_gib": 0.0})
            d["seconds"] += r["seconds"] / len(measured)
            d["peak_gib"] = max(d["peak_gib"], r.get("peak_gib", 0.0))
    res["phases"] = per
    res["phases_measured_steps"] = measured
    res["vision_forward_s_by_phase"] = vision.seconds
    res["vision_calls_by_phase"] = vision.calls
    step_metrics = [res["steps"][str(s)] for s in measured if str(s) in res["steps"]]
    if not step_metrics:
        return

    def mean(key: str) -> float:
        return sum(float(m.get(key, 0.0)) for m in step_metrics) / len(step_metrics)

    packed = mean("packed_tokens")
    # The rows the backbone really computes (a group's prompt once under algo.share_prefix):
    # what the update's FLOPs count.
    rows = mean("backbone_rows") or packed
    epochs = cfg.algo.ppo_epochs
    passes = int(cfg.algo.kl_coef > 0) + 1  # reference + proximal (decoupled objective)
    upd = per.get("update", {}).get("seconds", 0.0)
    lp = per.get("logprobs", {}).get("seconds", 0.0)
    roll = per.get("rollout", {}).get("seconds", 0.0)
    gen = mean("time/main_gen") + mean("time/sub_gen")
    n_params = res["trained_params"]
    flops = 6.0 * n_params * rows * epochs
    res["figures"] = {
        "packed_tokens_per_step": packed,
        "backbone_rows_per_step": rows,
        "generated_tokens_per_step": mean("trained_tokens"),
        "rollout_s": roll,
        "rollout_decode_and_pack_s": mean("time/overview") + mean("time/crops"),
        "rollout_generation_s": gen,
        "rollout_generated_tokens_per_s": mean("trained_tokens") / max(roll, 1e-9),
        "logprobs_s": lp,
        "logprobs_tokens_per_s": rows * passes / max(lp, 1e-9),
        "update_s": upd,
        "update_tokens_per_s": rows * epochs / max(upd, 1e-9),
        "update_tflops": flops / max(upd, 1e-9) / 1e12,
        "update_mfu": flops / max(upd, 1e-9) / (res["peak_tflops"] * 1e12),
        "sync_s": per.get("sync", {}).get("seconds", 0.0),
        "step_s": mean("time/step"),
    }


def tool_work(steps: dict[str, dict[str, float]]) -> dict[str, float]:
    """What of PARA-GRPO's own work the RL steps ran, summed over ``steps`` (the step metrics
    by step): tool calls made by the main agents, crops decoded, sub-agent trajectories."""
    tot = {"tool_calls": 0.0, "crops": 0.0, "sub_agents": 0.0}
    for m in steps.values():
        n = sum(v for k, v in m.items() if k.startswith("count/K"))  # rollouts of the step
        tot["tool_calls"] += m.get("tool_calls_per_rollout", 0.0) * n
        tot["crops"] += m.get("rollout/crops", 0.0)
        tot["sub_agents"] += m.get("rollout/sub_agents", 0.0)
    return tot


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(
        prog="scripts/gpu_real_size.py", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--json", default="", help="write the figures here")
    ap.add_argument("--small-arch", default="", help="write the dry run's narrowed arch, exit")
    ap.add_argument("--small-arch-vocab", type=int, default=0, help="... with this vocabulary")
    ap.add_argument("--no-oracle", action="store_true", help="main agents from the model itself")
    ap.add_argument("--gen-batch", type=int, default=40, help="fixed-shape generation: prompts")
    ap.add_argument("--gen-prompt", type=int, default=1024, help="... tokens per prompt")
    ap.add_argument("--gen-tokens", type=int, default=128, help="... new tokens (0: skip)")
    ap.add_argument("--profile-step", type=int, default=0, help="profile this RL step (0: none)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (MFU)")
    ap.add_argument("--gpu", default="h200-141gb", help="plan for this GPU without CUDA")
    a = ap.parse_args(argv)
    if a.small_arch:
        from paravt.models.tiny import write_narrow_arch

        print(write_narrow_arch(a.small_arch, vocab=a.small_arch_vocab))
        return 0

    from paravt import train
    from paravt.assets import prepare_data
    from paravt.data.sampler import PromptSampler
    from paravt.distributed import init_distributed
    from paravt.engines.oracle import OracleMainEngine, load_oracle
    from paravt.plan import check_device_memory
    from paravt.validate import validate_run

    cfg, _ = train.parse_args(rest)
    cuda = torch.cuda.is_available() and cfg.model.device != "cpu"
    res: dict[str, Any] = {"argv": rest, "status": "running", "cuda": cuda, "steps": {}}
    res["peak_tflops"] = a.peak_tflops
    out = Path(a.json) if a.json else None

    def save() -> None:
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(res, indent=1, default=str))

    t_all = time.perf_counter()
    try:
        res["model"] = cfg.model.config or "tiny"
        res["plan"] = plan_figures(cfg, cuda, a.gpu)
        save()
        validate_run(cfg, 1)
        check_device_memory(cfg, 1)  # the trainer's own check: a plan that does not fit stops
        ctx = init_distributed(cfg.model.device)
        clock = PhaseClock(cuda)
        t0 = time.perf_counter()
        tr = train.build_trainer(cfg, ctx)
        res["build_s"] = time.perf_counter() - t0
        res["trained_params"] = sum(p.numel() for p in tr.policy.parameters() if p.requires_grad)
        res["total_params"] = sum(p.numel() for p in tr.policy.parameters())
        if cuda:
            res["after_build_gib"] = torch.cuda.memory_allocated() / GIB
        tr.preempt = clock
        models = [tr.policy, getattr(tr.engine, "model", tr.policy)]
        if tr.reference is not None:
            models.append(tr.reference.model)
        vision = VisionTimer(models, clock)
        if not a.no_oracle:
            records = load_oracle(Path(prepare_data(cfg, ctx)))
            if not records:
                raise RuntimeError(
                    f"no oracle rows (sft.jsonl) in {cfg.data.synth_dir}: the oracle main agent "
                    "needs the synthetic task; pass --no-oracle for another dataset"
                )
            real = tr.runner.engine
            tr.runner.engine = OracleMainEngine(
                real, tr.bundle.tokenizer, records, cfg.agent.think_prefix
            )
            tr.runner.engine.max_model_len = getattr(real, "max_model_len", 0)
            # Only prompts whose oracle calls the tool: every rollout then crops, decodes and
            # runs sub-agents (an overview that shows the answer would measure none of that).
            calls = {k for k, r in records.items() if "<tool_call>" in json.dumps(r)}
            picked = [s for s in tr.sampler.samples if s.id in calls]
            res["prompts_with_tool_calls"] = [len(picked), len(tr.sampler.samples)]
            if not picked:
                raise RuntimeError(
                    f"none of the {len(tr.sampler.samples)} training prompts has an oracle "
                    "turn that calls the tool: the step would measure no crop and no "
                    "sub-agent (raise data.synth_num_videos or use data.synth_task=spot)"
                )
            tr.sampler = PromptSampler(picked, seed=cfg.train.seed)
        save()
        for step in range(1, cfg.train.steps + 1):
            clock.enter(step, "start")
            prof = None
            if step == a.profile_step:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if cuda:
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                prof = torch.profiler.profile(activities=acts)
                prof.__enter__()
            m = train.train_step(tr, step).metrics
            clock.enter(step, "end")
            if prof is not None:
                prof.__exit__(None, None, None)
                t_p = time.perf_counter()
                averages = prof.key_averages()
                res["profile"] = {
                    "step": step,
                    "top_ops": top_ops(averages),
                    "phase_device_ms": phase_ranges(averages),
                }
                res["profile"]["analysis_s"] = time.perf_counter() - t_p
            res["steps"][str(step)] = {k: v for k, v in m.items() if isinstance(v, (int, float))}
            res["tool_work"] = tool_work(res["steps"])
            res["phase_rows"] = clock.rows
            summarise(res, clock, vision, cfg)
            save()
            print(
                f"[real_size] step {step}: {m['time/step']:.1f} s (rollout "
                f"{m['time/rollout']:.1f}, logprobs {m['time/logprobs']:.1f}, update "
                f"{m['time/update']:.1f}, sync {m['time/sync']:.1f}); packed tokens "
                f"{m['packed_tokens']:.0f}, generated {m['trained_tokens']:.0f}",
                flush=True,
            )
        if a.gen_tokens > 0:
            clock.enter(cfg.train.steps + 1, "fixed_generation")
            res["fixed_generation"] = fixed_generation(
                tr.engine, a.gen_batch, a.gen_prompt, a.gen_tokens, cfg.train.seed
            )
            clock.enter(cfg.train.steps + 1, "end")
            res["phase_rows"] = clock.rows
        if cuda:
            res["max_allocated_gib"] = max(r.get("peak_gib", 0.0) for r in clock.rows)
            res["max_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
        res["status"] = "ok"
        missing = [k for k in ("crops", "sub_agents") if not res["tool_work"].get(k)]
        if missing and not a.no_oracle:
            # The oracle path is there to put crops and sub-agents into the step: a step
            # without them measured a plain GRPO step, not PARA-GRPO's.
            res["status"] = "failed"
            res["error"] = (
                f"the RL steps ran no {' and no '.join(missing)} (tool_work "
                f"{res['tool_work']}): the measured step is not PARA-GRPO's"
            )
    except Exception as e:
        res["status"] = "failed"
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        print(res["traceback"], file=sys.stderr, flush=True)
    finally:
        res["wall_s"] = time.perf_counter() - t_all
        res["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB
        save()
    report(res)
    return 0 if res["status"] == "ok" else 1


def report(res: dict[str, Any]) -> None:
    f = res.get("figures", {})
    pl = res.get("plan", {})
    print(f"[real_size] model {res.get('model')}: {res['status']} in {res['wall_s']:.0f} s "
          f"(build {res.get('build_s', 0):.0f} s), trained params "
          f"{res.get('trained_params', 0) / 1e9:.3f} B")  # fmt: skip
    for k in sorted(f):
        print(f"  {k}: {f[k]:.4g}")
    for ph, d in sorted(res.get("phases", {}).items()):
        print(f"  phase {ph}: {d['seconds']:.2f} s, peak {d.get('peak_gib', 0):.2f} GiB")
    if pl:
        print(f"  plan ({pl['device']}): rollout {pl['rollout_gib']:.1f} GiB, update "
              f"{pl['update_gib']:.1f} GiB, fits {pl['fits']}; measured max allocated "
              f"{res.get('max_allocated_gib', float('nan')):.1f} GiB")  # fmt: skip
    if "tool_work" in res:
        t = res["tool_work"]
        print(f"  tool work in the RL steps: {t['tool_calls']:.0f} tool calls, {t['crops']:.0f} "
              f"crops, {t['sub_agents']:.0f} sub-agents (prompts with oracle tool calls "
              f"{res.get('prompts_with_tool_calls')})")  # fmt: skip
    if "fixed_generation" in res:
        g = res["fixed_generation"]
        print(f"  fixed generation: {g['generated_tokens']} tokens in {g['seconds']:.2f} s "
              f"({g['tokens_per_s']:.0f} tokens/s, batch {g['batch']})")  # fmt: skip
    for r in res.get("profile", {}).get("top_ops", [])[:5]:
        print(f"  top op: {r['name']} {r['self_device_ms']:.1f} ms device, "
              f"{r['self_cpu_ms']:.1f} ms CPU, {r['calls']} calls")  # fmt: skip
    if res.get("error"):
        print(f"  error: {res['error']}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
