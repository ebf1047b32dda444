"""Check ``python -m paravt.plan`` against a measured CPU peak: the update of one micro-batch.

    PYTHONPATH=$PWD .venv/bin/python scripts/plan_check.py tiny   [--tokens 4096]
    PYTHONPATH=$PWD .venv/bin/python scripts/plan_check.py medium [--tokens 1024]

In a fresh process: read the RSS after imports (the baseline), build the policy with random
weights in fp32 on the CPU (the tiny default, or ``medium``: the Qwen3-VL-8B architecture
scaled to ~0.3 B parameters, see ``MEDIUM``), the frozen reference replica (``algo.kl_coef``),
then run two optimizer steps of the trainer's own update (``policy_minibatch_backward``:
packed forward, fused ``linear_policy_loss``, backward; AdamW step) on a text-only packed
minibatch of two micro-batches of ``--tokens`` tokens (rows of 512): the AdamW moments exist
during the second step, and the first micro-batch's gradients during the second one's
forward and backward (with one micro-batch per step, gradients grow while activations are
freed and the peak is lower than the plan's sum). The peak RSS over the baseline (``ru_maxrss``) is compared with the plan's update phase
for the same model, batch (text only: visual share 0) and a CPU layout (no CUDA context, the
CPU chunk sizes). Prints both and their ratio.

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
"""

from __future__ import annotations

import argparse
import copy
import resource
import sys

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
    import os

    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        # Large tensors from mmap, returned to the OS when freed: RSS then follows the live
        # tensors instead of what glibc's heap keeps after a free.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["tiny", "medium"])
    p.add_argument("--tokens", type=int, default=0, help="micro-batch tokens")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args(argv)
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
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
