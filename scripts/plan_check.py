"""Check ``python -m paravt.plan`` against measured CPU peaks: the update of one micro-batch,
the reference model's placement, an asynchronous worker rank and the weight push.

    PYTHONPATH=$PWD .venv/bin/python scripts/plan_check.py tiny   [--tokens 4096]
    PYTHONPATH=$PWD .venv/bin/python scripts/plan_check.py medium [--tokens 1024]
    PYTHONPATH=$PWD .venv/bin/python scripts/plan_check.py reference [--model tiny|medium]
    PYTHONPATH=$PWD .venv/bin/python scripts/plan_check.py worker|push [--model tiny|medium]
        [--rows 16 --prompt 64 --new 192] [--set rollout.weight_sync_overlap=false]

**The update** (``tiny``, ``medium``). In a fresh process: read the RSS after imports (the
baseline), build the policy with random weights in fp32 on the CPU (the tiny default, or
``medium``: the Qwen3-VL-8B architecture scaled to ~0.3 B parameters, see ``MEDIUM``), the
frozen reference replica (``algo.kl_coef``), then run two optimizer steps of the trainer's own
update (``policy_minibatch_backward``: packed forward, fused ``linear_policy_loss``, backward;
AdamW step) on a text-only packed minibatch of two micro-batches of ``--tokens`` tokens (rows
of 512): the AdamW moments exist during the second step, and the first micro-batch's
gradients during the second one's forward and backward (with one micro-batch per step,
gradients grow while activations are freed and the peak is lower than the plan's sum). The
peak RSS over the baseline (``ru_maxrss``) is compared with the plan's update phase for the
same model, batch (text only: visual share 0) and a CPU layout (no CUDA context, the CPU chunk
sizes). Prints both and their ratio.

Measured here (2 shared cores, torch CPU, fp32, algo.kl_coef 0.01 so with the reference;
tiny: 4096-token micro-batches, medium: 1024; measured = resident tensors + step 2's rise):

    model                   checkpointing   plan (MiB)   measured (MiB)   measured / plan
    tiny (1.0 M)            off                  175.9            191.7             1.090
    tiny (1.0 M)            on                   158.9            151.1             0.951
    medium (298.7 M)        off                 7344.0           7359.8             1.002
    medium (298.7 M)        on                  6028.0           5821.1             0.966

The whole-process peak RSS over the baseline (first step's one-time costs included) was
211.4 / 174.0 / 7399.9 / 5863.4 MiB. The tiny model's excess is the step's small tensors and
allocator overhead that the plan does not count (a few MiB against a ~180 MiB step).

**The reference's placement** (``reference``; default ``--model medium``). Two gloo ranks
(forked from this process after its imports, joined by ``init_distributed`` as under
torchrun; one thread each) each build the model (the reference's weights), place it
``replicate`` (``paravt.distributed.place_reference``: measured = the RSS over the rank's
baseline), then shard it in place over the two ranks (FSDP2: measured = the replica's RSS
less what sharding gave back), each followed by one no-grad log-prob pass (``--no-pass``:
none). Compared with the plan's ``reference model`` term for 2 trainer ranks. FSDP2's
one-time costs (a dummy module sharded first) stay before the baseline.

**A worker rank and the push** (``worker`` and ``push`` run the same exchange and print
both ends). Trainer rank 0 and one rollout worker, two forked processes joined by the real
control stream and weights group (``paravt.workers.roles.Channel`` / ``WeightGroup``, gloo).
The trainer loads the policy (master dtype) from a checkpoint written first (the tiny
tokenizer; for ``medium`` its config and random weights) and pushes it once as
``RolloutPipeline.publish`` does (``full_weights`` cast to the compute dtype into
``WeightPublisher``, ``rollout.weight_sync=bucketed``, ``rollout.weight_bucket_mb``, overlap
on): measured = the RSS held when ``push`` returned (the snapshot), and the peak over the
resident policy until the send ended. The worker loads its model as ``paravt.workers.worker``
does (``load_model_from_config``, compute dtype; every weight read once, since the loader maps
the safetensors file), receives the version (``weight_sync.receive``), swaps it in and verifies
the engine's copy (``verify_engine``): measured = the staged version's RSS (kept: a next
version arriving mid-rollout) and the peak over it (the checksums); then, the stop ids
cleared so that every row runs to ``--new`` tokens, it generates ``--rows`` distinct text
prompts with the HF engine: measured = the RSS rise of that call, against the plan's KV cache
and sampling buffers for the same rows and context (``hf_generation_bytes``).

Measured 2026-12-07 (2 shared cores, fp32; the commands under the second table):

    reference model, per rank (2 gloo ranks)           plan (MiB)  measured (MiB)  measured / plan
    medium (298.7 M), replicate                        1139.4          1141.6            1.002
    medium (298.7 M), shard                             569.7           573.3            1.006
    tiny, --tiny-vocab 151936 (19.9 M), replicate        76.1            77.2            1.015
    tiny, --tiny-vocab 151936 (19.9 M), shard            38.0            39.9            1.049

Sharded, a rank holds 0.502 (medium) / 0.517 (tiny) of the replica. The plan does not list
the log-prob pass (it runs before the update and is smaller): the replica's pass rose 63 MiB
on the medium model, the sharded one's 764 MiB (the root unit, embeddings and lm_head, 256
MiB, gathered with its all-gather buffer, and the running and prefetched blocks). The tiny
model at its own 4,096-token vocabulary holds 3.9 MiB of weights, under the few MiB of noise
FSDP2's wrapping and glibc's heap add (sharded: 2.03 x the plan, 0.74 of the replica): hence
the test's larger vocabulary (tests/test_plan.py, ``--no-pass``).

    medium (298.7 M), worker/push commands below       plan (MiB)  measured (MiB)  measured / plan
    worker: HF model (compute dtype)                     1139.4          1161.2            1.019
    worker: staged weights (next version)                1139.4          1140.4            1.001
    worker: weight check transient (c)                     32.0            31.9            0.998
    worker: KV cache + sampling, 16 x (64 + 192)          262.0           274.2            1.047
    worker: KV cache + sampling, 8 x (448 + 64) (b)       381.0           408.0            1.071
    worker: the terms' sum (16 x (64 + 192))             2572.9          2608.3            1.014
    push: the snapshot (overlapped)                      1139.4          1142.2            1.002
    push: transient (peak - snapshot)                       0.0            -0.1              -
    push: peak, overlapped                               1139.4          1142.1            1.002
    push: peak, not overlapped (b)                        256.0           266.6            1.042

    (a) scripts/plan_check.py worker --model medium --verbose (all rows but (b))
    (b) scripts/plan_check.py push --model medium --rows 8 --prompt 448 --new 64
        --set rollout.weight_sync_overlap=false --verbose
    (c) and the push rows re-measured after the checksum began to sum in chunks of 4096 rows
        (2026-12-07: 256 -> 32 MiB on the worker, the push's 128 MiB transient gone)
    reference rows: scripts/plan_check.py reference --model medium|tiny [--tiny-vocab 151936]
    --verbose

The model's 22 MiB over the plan is the tokenizer and processor the loader builds. The KV
cache's 12 MiB is HF's ``DynamicCache`` growing by ``torch.cat`` (a layer's K and V copied at
each step: 1/16 of the cache). The checksum (``paravt.weight_sync.checksum``) sums a tensor's
int32 words into int64 and torch's ``sum(dtype=int64)`` makes an int64 copy: 2 x the bytes of
the 32768 x 1024 fp32 lm_head (256 MiB) before it summed in chunks of ``CHUNK_ROWS`` rows; now
32 MiB at most (the 8B recipe's worker: 2.3 GiB -> 32 MiB). With long prompts (b) the prefill's one-layer
MLP transient outgrows the cache's growth (the old KV term measured 1.58 x).

Before these checks the plan's push on (a) was 384 MiB (one 256 MiB bucket + a 128 MiB cast
copy) against 1269 measured, and the worker had no checksum term: the plan now counts the whole snapshot where an overlapped push
on a CPU holds it (on a GPU it waits in pinned host memory), a bucket no larger than the
model, the largest tensor alone in its bucket when larger (the 8B's 1187 MiB embedding, not
256 MiB), no cast copy on one process whose masters are the compute dtype (none is made),
the checksum's transient on the trainer and the worker, and the HF prefill.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import resource
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

# Qwen3-VL-8B's shape, narrower and shallower: ~0.32 B parameters (fp32: 1.3 GB of weights).
MEDIUM = dict(hidden=1024, layers=16, heads=16, kv_heads=8, head_dim=64, intermediate=3072,
              vocab=32768, v_depth=4, v_hidden=512, v_intermediate=1536)  # fmt: skip


def rss_kb(key: str = "VmRSS") -> int:
    """This process's resident set (``VmRSS``) or its peak since the last reset (``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build(kind: str, cfg) -> torch.nn.Module:
    import transformers

    from paravt.plan import hf_config

    hf = hf_config(cfg, None)
    if kind == "medium":
        m = MEDIUM
        t, v = hf.text_config, hf.vision_config
        t.hidden_size, t.num_hidden_layers = m["hidden"], m["layers"]
        t.num_attention_heads, t.num_key_value_heads = m["heads"], m["kv_heads"]
        t.head_dim, t.intermediate_size, t.vocab_size = m["head_dim"], m["intermediate"], m["vocab"]
        t.rope_parameters["mrope_section"] = [m["head_dim"] // 4, m["head_dim"] // 8,
                                              m["head_dim"] // 8]  # fmt: skip
        v.depth, v.hidden_size, v.intermediate_size = (
            m["v_depth"],
            m["v_hidden"],
            m["v_intermediate"],
        )
        v.out_hidden_size, v.deepstack_visual_indexes = m["hidden"], [1, 2]
    torch.manual_seed(0)
    return transformers.Qwen3VLForConditionalGeneration(hf).eval()


def batch_of(tokens: int, row: int, vocab: int):
    from paravt.types import PackedBatch

    n_rows = max(1, tokens // row)
    lens = [row] * n_rows
    n = sum(lens)
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(n)
    cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(n_rows)], dtype=torch.int32)
    mask[cu[:-1].long()] = 0.0  # a row's first token is never trained
    return PackedBatch(
        input_ids=torch.randint(0, min(vocab, 4000), (n,), generator=g),
        cu_seqlens=cu,
        loss_mask=mask,
        old_logprobs=torch.full((n,), -8.0),
        advantages=torch.randn(n, generator=g),
        seq_weights=torch.ones(n_rows),
        temperatures=torch.ones(n_rows),
        top_ps=torch.ones(n_rows),
        uids=[f"r{i}" for i in range(n_rows)],
        visuals=[None] * n_rows,
        mm_token_type_ids=torch.zeros(n, dtype=torch.long),
        parent_index=torch.full((n_rows,), -1, dtype=torch.long),
        roles=["main"] * n_rows,
    )


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        # Large tensors from mmap, returned to the OS when freed: RSS then follows the live
        # tensors instead of what glibc's heap keeps after a free.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["tiny", "medium", "reference", "worker", "push"])
    p.add_argument("--model", choices=["tiny", "medium"], default="medium",
                   help="reference / worker / push: the model measured")  # fmt: skip
    p.add_argument("--tokens", type=int, default=0, help="micro-batch tokens")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--rows", type=int, default=16, help="worker: rows generated at once")
    p.add_argument("--prompt", type=int, default=64, help="worker: prompt tokens a row")
    p.add_argument("--new", type=int, default=192, help="worker: new tokens a row")
    p.add_argument("--tiny-vocab", type=int, default=0,
                   help="reference / worker / push on tiny: model.tiny_vocab (0: the preset's)")  # fmt: skip
    p.add_argument("--no-pass", action="store_true", help="reference: no log-prob passes")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="reference / worker / push: a config override (repeatable)")  # fmt: skip
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args(argv)
    if a.kind == "reference":
        return _reference(a)
    if a.kind in ("worker", "push"):
        return _async(a)
    from paravt.algo.loss import agg_denominator, make_objective, policy_minibatch_backward
    from paravt.config import load_config
    from paravt.models.forward import packed_hidden  # noqa: F401  (import cost in the baseline)
    from paravt.plan import Layout, model_shape, plan_memory

    tokens = a.tokens or (4096 if a.kind == "tiny" else 1024)
    cfg = load_config("tiny_cpu", overrides=[f"algo.max_tokens_per_microbatch={tokens}",
                                             f"model.gradient_checkpointing={a.checkpointing}"])  # fmt: skip
    torch.set_num_threads(2)
    # Code the step imports lazily (the model's modules, the kernels' packages) is not memory
    # the plan models: imported before the baseline.
    import paravt_kernels  # noqa: F401
    from transformers.models.qwen3_vl import modeling_qwen3_vl  # noqa: F401

    shape = model_shape(cfg)  # meta device: no memory; imports everything the plan needs
    base = rss_kb()
    model = build(a.kind, cfg)
    if cfg.algo.freeze_vision_tower:  # as the trainer does (the tiny preset sets it)
        from paravt.models.loader import freeze_vit

        freeze_vit(model)
    if a.checkpointing:
        model.gradient_checkpointing_enable()
    objective = make_objective(cfg.algo)
    ref = copy.deepcopy(model).requires_grad_(False) if objective.needs_ref else None
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-6)
    # Two micro-batches per optimizer step (as a real minibatch has several): the second runs
    # with the first one's gradients allocated, the case the plan sums.
    b = batch_of(2 * tokens, 512, model.config.text_config.vocab_size)
    b.ref_logprobs = torch.full_like(b.old_logprobs, -8.0) if ref is not None else None
    den = agg_denominator(objective.effective_mask(b), b, cfg.algo.agg)
    model.train()
    built = rss_kb() - base
    for step in range(2):
        # The second step starts with the AdamW moments allocated: its rise is the update's
        # transient memory (activations, gradients, fused buffers).
        start = rss_kb()
        reset_peak()
        policy_minibatch_backward(model, b, objective, global_den=den, max_tokens=tokens)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rise = rss_kb("VmHWM") - start
        if a.verbose:
            print(
                f"  step {step + 1}: RSS rise {rise / 1024:.1f} MiB from {(start - base) / 1024:.1f} MiB"
            )
    resident = sum(q.numel() * q.element_size() for q in model.parameters())
    resident += sum(t.numel() * t.element_size() for st in opt.state.values()
                    for t in st.values() if torch.is_tensor(t))  # fmt: skip
    if ref is not None:
        resident += sum(q.numel() * q.element_size() for q in ref.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    measured_kb = resident / 1024 + rise
    # The plan, for the same model: its shape read off the meta-device build of the same config.
    if a.kind == "medium":
        from paravt.plan import ModelShape

        uniq = {id(q): q for q in model.parameters()}.values()
        shape = _medium_shape(shape, model, uniq, ModelShape)
    pl = plan_memory(cfg, Layout(device_bytes=1 << 40, gpu=False), shape, tokens=tokens,
                     visual_share=0.0)  # fmt: skip
    plan_kb = pl.update / 1024
    print(f"{a.kind}: {shape.params / 1e6:.1f} M parameters, {tokens} tokens, checkpointing "
          f"{a.checkpointing}")  # fmt: skip
    for t in pl.terms:
        if t.update:
            print(f"  plan {t.name:<40} {t.update / 2**20:9.1f} MiB")
    print(f"  measured after building the model(s): {built / 1024:.1f} MiB")
    print(
        f"  measured: peak RSS over the baseline {peak / 1024:.1f} MiB (the first step's "
        "one-time costs included)"
    )
    print(f"plan update {plan_kb / 1024:.1f} MiB; measured (resident tensors "
          f"{resident / 2**20:.1f} MiB + step 2's RSS rise {rise / 1024:.1f} MiB) "
          f"{measured_kb / 1024:.1f} MiB; measured/plan {measured_kb / plan_kb:.3f}")  # fmt: skip
    return 0


def _medium_shape(shape, model, params, ModelShape):
    """The plan's shape of the in-process medium model (counted like ``model_shape``)."""
    import dataclasses

    from paravt.distributed import block_classes

    m = MEDIUM
    classes = block_classes(model)
    blocks = [x for x in model.modules() if isinstance(x, classes)]
    in_block = {id(q) for b in blocks for q in b.parameters()}
    text = max(sum(q.numel() for q in b.parameters()) for b in blocks if "Text" in type(b).__name__)
    vis = max(
        sum(q.numel() for q in b.parameters()) for b in blocks if "Vision" in type(b).__name__
    )
    params = list(params)
    total = sum(q.numel() for q in params)
    trainable = sum(q.numel() for q in params if q.requires_grad)
    root = [q for q in params if id(q) not in in_block]
    return dataclasses.replace(
        shape, source="medium", params=total, trainable=trainable,
        root_params=sum(q.numel() for q in root),
        root_trainable=sum(q.numel() for q in root if q.requires_grad), text_block=text, vision_block=vis, layers=m["layers"],
        hidden=m["hidden"], heads=m["heads"], kv_heads=m["kv_heads"], head_dim=m["head_dim"],
        intermediate=m["intermediate"], vocab=m["vocab"], v_depth=m["v_depth"],
        v_hidden=m["v_hidden"], v_intermediate=m["v_intermediate"],
        largest_tensor=max(q.numel() for q in params),
    )  # fmt: skip


# ------------------------------------------------------------------- the new paths' checks
def _config(a: argparse.Namespace, *overrides: str):
    """The measured runs' config: the tiny preset (fp32 compute and masters, the HF engine),
    the reference on (``algo.kl_coef``), ``--tiny-vocab``, ``--set``'s overrides, then
    ``overrides`` (the mode's)."""
    from paravt.config import load_config

    vocab = [f"model.tiny_vocab={a.tiny_vocab}"] if a.tiny_vocab and a.model == "tiny" else []
    return load_config("tiny_cpu", overrides=["algo.kl_coef=0.01", *vocab, *a.set, *overrides])


def plan_shape(kind: str, cfg):
    """The plan's ``ModelShape`` of ``kind`` (the tiny preset's model, or ``MEDIUM``), read off
    a meta-device build (no memory)."""
    from paravt.plan import ModelShape, model_shape

    shape = model_shape(cfg)
    if kind == "tiny":
        return shape
    with torch.device("meta"):
        model = build(kind, cfg)
    if cfg.algo.freeze_vision_tower:
        from paravt.models.loader import freeze_vit

        freeze_vit(model)
    return _medium_shape(shape, model, {id(q): q for q in model.parameters()}.values(), ModelShape)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _forked(children: list[tuple[partial[dict], dict[str, str]]]) -> list[dict]:
    """Run each ``(fn, env)`` in a process forked from this one (which imported torch,
    transformers and paravt once: the tiny case's seconds), all at once, with ``env`` set
    and one thread; ``fn``'s results. A child that fails raises naming it."""
    import multiprocessing

    mp = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"{i}.json" for i in range(len(children))]
        procs = [mp.Process(target=_child, args=(fn, env, str(out)), name=fn.func.__name__)
                 for (fn, env), out in zip(children, outs)]  # fmt: skip
        for q in procs:
            q.start()
        # Until all end, one fails (its peer would wait on gloo for days) or 15 minutes pass.
        deadline = time.monotonic() + 900
        while any(q.is_alive() for q in procs) and time.monotonic() < deadline:
            if any(q.exitcode not in (None, 0) for q in procs):
                break
            time.sleep(0.2)
        bad = [q for q in procs if q.exitcode != 0]
        for q in procs:
            if q.is_alive():
                q.kill()
                q.join()
        if bad:
            why = ", ".join(f"{q.name} (exit {q.exitcode})" if q.exitcode is not None
                            else f"{q.name} (hung)" for q in bad)  # fmt: skip
            raise SystemExit(f"plan_check: {why}; see above")
        return [json.loads(out.read_text()) for out in outs]


def _child(fn: Callable[[], dict], env: dict[str, str], out: str) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    Path(out).write_text(json.dumps(fn()))


def _row(name: str, plan_b: float, measured_b: float) -> str:
    return (f"  {name:<44} plan {plan_b / 2**20:9.1f} MiB   measured {measured_b / 2**20:9.1f} "
            f"MiB   measured/plan {measured_b / plan_b if plan_b else float('inf'):.3f}")  # fmt: skip


def _local_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds (a DTensor's local shard)."""
    own = (q.to_local() if hasattr(q, "to_local") else q for q in model.parameters())
    return sum(t.numel() * t.element_size() for t in own)


def _reference(a: argparse.Namespace) -> int:
    """``reference``: what each of 2 gloo ranks holds for the reference model, replicated and
    then sharded (``paravt.distributed.place_reference``), against the plan's term."""
    from transformers.models.qwen3_vl import modeling_qwen3_vl  # noqa: F401  (as paravt_kernels)

    import paravt.algo.reference  # noqa: F401  (imported once, before the ranks fork)
    from paravt.plan import Layout, plan_memory

    cfg = _config(a)
    import paravt_kernels  # noqa: F401  (the log-prob pass's)

    shape = plan_shape(a.model, cfg)  # also the imports and one-time costs, before the fork
    port = str(_free_port())
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": port}  # fmt: skip
    res = _forked([(partial(_reference_rank, a, cfg),
                    {**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in (0, 1)])  # fmt: skip
    lay = Layout(nproc_per_node=2, device_bytes=1 << 40, gpu=False)
    print(f"reference ({a.model}: {shape.params / 1e6:.1f} M parameters, {cfg.model.dtype}), "
          "2 gloo ranks: RSS each rank holds for it")  # fmt: skip
    ratios = {}
    for where in ("replicate", "shard"):
        pl = plan_memory(_config(a, f"algo.ref_placement={where}"), lay, shape)
        want = pl.term("reference model").update
        for r, got in enumerate(res):
            g = got[where]
            print(_row(f"{where}, rank {r}", want, g["held"]))
            if a.verbose:
                print(f"    parameters held {g['local'] / 2**20:.1f} MiB; after a log-prob pass "
                      f"{g['after_pass'] / 2**20:.1f} MiB; the pass's rise {g['pass'] / 2**20:.1f} MiB")  # fmt: skip
        ratios[where] = max(got[where]["held"] for got in res) / want
    shard_of = max(got["shard"]["held"] / got["replicate"]["held"] for got in res)
    print(f"shard / replicate (largest rank): {shard_of:.3f}")
    print(f"reference measured/plan: replicate {ratios['replicate']:.3f} shard "
          f"{ratios['shard']:.3f}")  # fmt: skip
    return 0


def _reference_rank(a: argparse.Namespace, cfg) -> dict:
    """One rank of ``reference``: build the model (the reference's weights), place it
    replicated, measure; shard it in place, measure the drop; a log-prob pass after each."""
    from paravt.algo.reference import ReferencePolicy
    from paravt.distributed import cleanup, init_distributed, place_reference

    ctx = init_distributed("cpu")
    b = batch_of(a.tokens or 1024, 512, 4000)
    # FSDP2's one-time costs (its lazy imports, DTensor's dispatch caches): before the baseline
    place_reference(torch.nn.Sequential(torch.nn.Linear(64, 64)), ctx, "shard")
    gc.collect()
    base = rss_kb()
    ref = ReferencePolicy(build(a.model, cfg))
    out: dict = {}
    for where in ("replicate", "shard"):
        before = rss_kb()
        place_reference(ref.model, ctx, where)
        gc.collect()
        # replicate: the whole build; shard: the replica less what sharding it gave back (RSS
        # deltas: the first log-prob pass's one-time costs stay out of the shard's number)
        if where == "replicate":
            held = rss_kb() - base
        else:
            held = out["replicate"]["held"] // 1024 - (before - rss_kb())
        start = rss_kb()
        reset_peak()
        if not a.no_pass:
            ref.logprobs(b, max_tokens=a.tokens or 1024)
        rise = rss_kb("VmHWM") - start
        gc.collect()
        out[where] = {"held": held * 1024, "local": _local_bytes(ref.model),
                      "pass": rise * 1024, "after_pass": (rss_kb() - base) * 1024}  # fmt: skip
    cleanup(ctx)
    return out


def _async(a: argparse.Namespace) -> int:
    """``worker`` / ``push``: one trainer rank 0 and one rollout worker, two processes joined by
    the real control stream and weights group (``paravt.workers.roles``, gloo). The trainer
    loads the policy and pushes one version (``WeightPublisher``, bucketed); the worker loads
    its model as ``paravt.workers.worker`` does, receives that version (``weight_sync.receive``),
    swaps it in, and with it still staged (a next version arriving mid-rollout) generates one
    batch with the HF engine. ``worker`` and ``push`` run the same exchange: each prints
    both ends."""
    import paravt.engines.hf  # noqa: F401  (imported once, before the two processes fork)
    import paravt.weight_sync  # noqa: F401
    import paravt.workers.roles  # noqa: F401
    from paravt.models import build_tiny_checkpoint
    from paravt.plan import Layout, hf_generation_bytes, plan_memory

    cfg = _config(a, "rollout.workers=1")
    shape = plan_shape(a.model, cfg)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        build_tiny_checkpoint(ckpt)
        if a.model == "medium":  # the tiny tokenizer, the medium config and weights
            model = build("medium", cfg)
            model.save_pretrained(ckpt, safe_serialization=True)
            del model
            gc.collect()
        env = {"PLANCHECK_PORT": str(_free_port()), "TOKENIZERS_PARALLELISM": "false"}
        trainer, worker = _forked([(partial(_async_trainer, a, cfg, str(ckpt)), env),
                                   (partial(_async_worker, a, cfg, str(ckpt)), env)])  # fmt: skip
    pl = plan_memory(cfg, Layout(nproc_per_node=2, device_bytes=1 << 40, gpu=False), shape)
    bc = 4 if cfg.model.dtype == "float32" else 2
    w = {t.name: t.rollout for t in pl.worker_terms}
    gen = hf_generation_bytes(shape, bc, a.rows, a.prompt + a.new, a.prompt)
    print(f"worker ({a.model}: {shape.params / 1e6:.1f} M parameters, {cfg.model.dtype}); "
          f"generating {a.rows} rows x ({a.prompt} prompt + {a.new} new) tokens")  # fmt: skip
    measured = {"HF model (compute dtype)": worker["model"],
                "staged weights (next version)": worker["staged"],
                "weight check transient": worker["check"]}  # fmt: skip
    terms = [(n, w[n], measured[n]) for n in measured]
    terms.append(("HF engine KV cache + sampling (this batch)", gen, worker["generate"]))
    for name, want, got in terms:
        print(_row(name, want, got))
    wp, wm = sum(t[1] for t in terms), sum(t[2] for t in terms)
    print(_row("worker (the terms' sum)", wp, wm))
    if a.verbose:
        print(f"    generated {worker['tokens']} tokens; the worker's peak RSS over its baseline "
              f"{worker['peak'] / 2**20:.1f} MiB")  # fmt: skip
    bucket, transient = pl.term("weight push bucket (rank 0)"), pl.term("weight push transient")
    print(f"push on trainer rank 0 (rollout.weight_bucket_mb={cfg.rollout.weight_bucket_mb}, "
          f"overlap {cfg.rollout.weight_sync_overlap}), its sync phase over the resident policy")  # fmt: skip
    snap, peak = trainer["snapshot"], trainer["push_peak"]
    if cfg.rollout.weight_sync_overlap:  # the snapshot is held when push() returns
        print(_row("weight push bucket (rank 0): the snapshot", bucket.sync, snap))
        print(_row("weight push transient (peak - snapshot)", transient.sync, peak - snap))
    want = bucket.sync + transient.sync
    print(_row("push (peak)", want, peak))
    if a.verbose:
        print(f"    after the send {trainer['after'] / 2**20:.1f} MiB; the policy "
              f"{trainer['model'] / 2**20:.1f} MiB")  # fmt: skip
    print(f"measured/plan: worker {wm / wp:.3f} push {peak / want:.3f}")
    return 0


def _touch(model: torch.nn.Module) -> None:
    """Read every weight once: the loader maps the checkpoint's safetensors file, whose pages
    join the RSS only when read (a GPU rank's copy to its device reads them all)."""
    with torch.no_grad():
        for t in model.state_dict().values():
            t.sum()


def _groups(member: int):
    from paravt.workers.roles import Channel, WeightGroup

    port = int(os.environ["PLANCHECK_PORT"])
    store = torch.distributed.TCPStore("127.0.0.1", port, 2, member == 0)
    return Channel(store, "ctrl", member, 2), WeightGroup(store, "weights", member, 2, "cpu")


def _async_trainer(a: argparse.Namespace, cfg, ckpt: str) -> dict:
    """Trainer rank 0: the policy in the master dtype, one bucketed push of it cast to the
    compute dtype (as ``RolloutPipeline.publish``)."""
    from paravt.distributed import full_weights
    from paravt.models import load_model_from_config
    from paravt.weight_sync import Spec, WeightPublisher

    ctrl, group = _groups(0)
    gc.collect()
    base = rss_kb()
    policy = load_model_from_config(ckpt, cfg.model, device="cpu",
                                    dtype=cfg.train.master_dtype).model  # fmt: skip
    _touch(policy)
    gc.collect()
    model = rss_kb() - base
    ctrl.bcast({"kind": "ready"})
    dtype = getattr(torch, cfg.model.dtype)
    specs = [Spec(n, tuple(t.shape), dtype if t.is_floating_point() else t.dtype)
             for n, t in policy.state_dict().items()]  # fmt: skip
    pub = WeightPublisher(ctrl, group, cfg.rollout.weight_sync, cfg.rollout.weight_bucket_mb << 20,
                          cfg.rollout.weight_sync_overlap, "cpu")  # fmt: skip
    start = rss_kb()
    reset_peak()
    pub.push(1, specs, full_weights(policy, dtype))
    snapshot = rss_kb() - start
    pub.wait()
    peak = rss_kb("VmHWM") - start
    gc.collect()
    after = rss_kb() - start
    ctrl.recv(1)  # the worker's bye: it has what it needs
    return {"model": model * 1024, "snapshot": snapshot * 1024, "push_peak": peak * 1024,
            "after": after * 1024}  # fmt: skip


def _async_worker(a: argparse.Namespace, cfg, ckpt: str) -> dict:
    """The rollout worker: its model as ``paravt.workers.worker`` loads it (compute dtype, its
    device), the HF engine, one received version, one generated batch."""
    from paravt.engines import make_engine
    from paravt.engines.engine import GenerationRequest, SamplingParams
    from paravt.models import load_model_from_config
    from paravt.weight_sync import receive, verify_engine

    ctrl, group = _groups(1)
    gc.collect()
    base = rss_kb()
    bundle = load_model_from_config(ckpt, cfg.model, device="cpu")
    bundle.model.eval()
    _touch(bundle.model)
    gc.collect()
    model = rss_kb() - base
    # No stop ids: every row runs to --new tokens (random weights could sample one early).
    bundle.special = dataclasses.replace(bundle.special, eos=-1, im_end=-1, endoftext=-1)
    engine = make_engine(cfg, bundle)
    g = torch.Generator().manual_seed(1)
    reqs = [GenerationRequest(torch.randint(10, 4000, (a.prompt,), generator=g).tolist(),
                              SamplingParams(temperature=1.0, max_new_tokens=a.new, seed=i))
            for i in range(a.rows)]  # fmt: skip
    warm = GenerationRequest(reqs[0].prompt_ids, SamplingParams(max_new_tokens=2, seed=0))
    engine.generate([warm])  # a first call's one-time costs, before the measurements
    ctrl.bcast()  # ready
    header = ctrl.bcast()
    gc.collect()
    start = rss_kb()
    reset_peak()
    staged = receive(header, ctrl, group, "cpu")
    engine.sync_weights(staged.named())
    verify_engine(engine, staged)
    check = rss_kb("VmHWM") - start
    gc.collect()
    held = rss_kb() - start  # the staged version, kept: the next one arriving mid-rollout
    check -= held  # the verification's transient over the staged version
    start = rss_kb()
    reset_peak()
    outs = engine.generate(reqs)
    rise = rss_kb("VmHWM") - start
    tokens = sum(a.prompt + len(o.token_ids) for o in outs)
    peak = rss_kb("VmHWM") - base
    ctrl.send({"kind": "bye"}, 0)
    return {"model": model * 1024, "staged": held * 1024, "check": check * 1024,
            "generate": rise * 1024, "tokens": tokens, "peak": peak * 1024}  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
