"""The collapse experiment's report: the typed result (:class:`CollapseResult`), the statistics
that make it from the runs' own files (:func:`summarise`), the pre-registered bars
(:func:`bars`), ``collapse.md`` (:func:`format_markdown`) and ``collapse.png`` (:func:`plot`).

``python -m paravt.experiments collapse`` (``paravt.experiments.collapse``) calls
:func:`summarise` on the arm runs' ``metrics.jsonl`` / ``heldout.jsonl`` rows and writes
``CollapseResult.to_dict()`` as ``collapse.json``; ``python -m paravt.experiments phase``
(``paravt.experiments.phase``) reads finished folders back through
:meth:`CollapseResult.from_dict`. ``collapse.json`` is the interface between the two (and
between an older run and a newer reader): its format is fixed, and ``from_dict`` reads one
written before a field existed (the field absent: NaN or None), so old result folders still
read. NaN is written as ``null`` (``paravt.metrics.json_safe``) and read back as NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from paravt.experiments.arms import save_panels
from paravt.metrics import mean_or_nan, sample_std

NAN = float("nan")
#: Steps averaged for the "end" values (the issue's "mean last 5 steps").
END_STEPS = 5
#: Per-step keys kept in ``collapse.json``'s curves and drawn in ``collapse.png``.
CURVE_KEYS = (
    "tool_calls_per_rollout",
    "tool_call_rate",
    "format_compliance",
    "reward/fmt_base",
    "think_closure_rate",
    "parse_error_rate",
    "accuracy",
    "adv/tool",
    "adv/no_tool",
    "adv/mixed_groups",
)
#: The same-K metrics (:func:`same_k`), each per K of ``--eval-k`` and seed.
SAME_K_KEYS = (
    "tool_rate_need",
    "tool_rate_no_need",
    "acc_need",
    "acc_no_need",
    "format",
    "tool_turn_closure",
    "share_need",
)
#: The pre-registered bars (docs/collapse/protocol3/PREREGISTRATION.md), at this K.
BAR_K = 32


def _float(v: Any) -> float:
    """A number read back from JSON (``null``, a missing key or a non-number: NaN)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else NAN


def _floats(d: Any) -> dict[str, float]:
    return {str(k): _float(v) for k, v in (d or {}).items()}


# ----------------------------------------------------------------------------- records
@dataclass
class MeanStd:
    """A mean over seeds and the sample std across them (0 with one seed)."""

    mean: float
    std: float

    @classmethod
    def from_dict(cls, d: Any) -> MeanStd:
        d = d if isinstance(d, dict) else {}
        return cls(_float(d.get("mean")), _float(d.get("std")))

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "std": self.std}


def _ms_map(d: Any) -> dict[str, MeanStd]:
    return {str(k): MeanStd.from_dict(v) for k, v in (d or {}).items()}


@dataclass
class SameK:
    """One run's (or cold start's) held-out values at one K, prompt by prompt split by need
    (:func:`same_k`)."""

    tool_rate_need: float = NAN
    tool_rate_no_need: float = NAN
    acc_need: float = NAN
    acc_no_need: float = NAN
    format: float = NAN
    tool_turn_closure: float = NAN
    share_need: float = NAN
    prompts: float = 0.0

    @classmethod
    def from_dict(cls, d: Any) -> SameK:
        d = d if isinstance(d, dict) else {}
        return cls(**{f.name: _float(d.get(f.name)) for f in fields(cls)})

    def to_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class SameKStats:
    """:class:`SameK`'s ``SAME_K_KEYS`` over seeds, each a :class:`MeanStd` (a value missing
    from an older ``collapse.json``: NaN)."""

    tool_rate_need: MeanStd
    tool_rate_no_need: MeanStd
    acc_need: MeanStd
    acc_no_need: MeanStd
    format: MeanStd
    tool_turn_closure: MeanStd
    share_need: MeanStd

    @classmethod
    def from_dict(cls, d: Any) -> SameKStats:
        d = d if isinstance(d, dict) else {}
        return cls(**{key: MeanStd.from_dict(d.get(key)) for key in SAME_K_KEYS})

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {key: getattr(self, key).to_dict() for key in SAME_K_KEYS}


def _same_k_map(d: Any, cls: type) -> dict[str, Any]:
    return {str(k): cls.from_dict(v) for k, v in (d or {}).items()}


@dataclass
class SeedValues:
    """One arm run's summary (:func:`seed_values`), with its seed and its :func:`same_k`
    values once :func:`summarise` adds them."""

    kappa_start: float
    kappa_end: float
    format_start: float
    format_end: float
    tool_rate_end: float
    # per overview budget K the arm trained at (a K missing from the last steps: NaN)
    tool_rate_end_k: dict[str, float]
    acc_end_k: dict[str, float]
    tool_rate_heldout_k: dict[str, float]
    # the diagnosis: steps with a group holding rollouts with and without a crop, and the
    # mean over those steps of each side's mean advantage (tool < 0 < no-tool pushes away
    # from the tool)
    mixed_steps: float
    adv_tool_mixed: float
    adv_no_tool_mixed: float
    seed: int | None = None
    same_k: dict[str, SameK] | None = None

    _SCALARS = (
        "kappa_start", "kappa_end", "format_start", "format_end", "tool_rate_end",
    )  # fmt: skip
    _BY_K = ("tool_rate_end_k", "acc_end_k", "tool_rate_heldout_k")
    _DIAG = ("mixed_steps", "adv_tool_mixed", "adv_no_tool_mixed")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SeedValues:
        return cls(
            **{k: _float(d.get(k)) for k in (*cls._SCALARS, *cls._DIAG)},
            **{k: _floats(d.get(k)) for k in cls._BY_K},
            seed=d.get("seed"),
            same_k=_same_k_map(d["same_k"], SameK) if "same_k" in d else None,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {} if self.seed is None else {"seed": self.seed}
        out.update({k: getattr(self, k) for k in self._SCALARS})
        out.update({k: dict(getattr(self, k)) for k in self._BY_K})
        out.update({k: getattr(self, k) for k in self._DIAG})
        if self.same_k is not None:
            out["same_k"] = {k: v.to_dict() for k, v in self.same_k.items()}
        return out


@dataclass
class Curve:
    """A per-step curve over an arm's seeds: the steps, the mean and the std across seeds
    (the band of ``collapse.png``)."""

    step: list[int] = field(default_factory=list)
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: Any) -> Curve:
        d = d if isinstance(d, dict) else {}
        return cls(list(d.get("step") or []), list(d.get("mean") or []), list(d.get("std") or []))

    def to_dict(self) -> dict[str, list]:
        return {"step": self.step, "mean": self.mean, "std": self.std}


@dataclass
class ArmResult:
    """One arm over its seeds (``collapse.json``'s ``arms[ARM]``; :func:`summarise`)."""

    description: str
    kappa_start: MeanStd
    kappa_end: MeanStd
    format_start: MeanStd
    format_end: MeanStd
    tool_rate_end: MeanStd
    mixed_steps: MeanStd
    adv_tool_mixed: MeanStd
    adv_no_tool_mixed: MeanStd
    tool_rate_end_k: dict[str, MeanStd]
    acc_end_k: dict[str, MeanStd]
    tool_rate_heldout_k: dict[str, MeanStd]
    same_k: dict[str, SameKStats]
    seeds: list[SeedValues]
    curves: dict[str, Curve]

    _STATS = (
        "kappa_start", "kappa_end", "format_start", "format_end", "tool_rate_end",
        "mixed_steps", "adv_tool_mixed", "adv_no_tool_mixed",
    )  # fmt: skip
    _BY_K = ("tool_rate_end_k", "acc_end_k", "tool_rate_heldout_k")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArmResult:
        return cls(
            description=d.get("description", ""),
            **{k: MeanStd.from_dict(d.get(k)) for k in cls._STATS},
            **{k: _ms_map(d.get(k)) for k in cls._BY_K},
            same_k=_same_k_map(d.get("same_k"), SameKStats),
            seeds=[SeedValues.from_dict(s) for s in d.get("seeds") or []],
            curves={k: Curve.from_dict(c) for k, c in (d.get("curves") or {}).items()},
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"description": self.description}
        out.update({k: getattr(self, k).to_dict() for k in self._STATS})
        for k in self._BY_K:
            out[k] = {kk: v.to_dict() for kk, v in getattr(self, k).items()}
        out["same_k"] = {k: v.to_dict() for k, v in self.same_k.items()}
        out["seeds"] = [s.to_dict() for s in self.seeds]
        out["curves"] = {k: c.to_dict() for k, c in self.curves.items()}
        return out


@dataclass
class ColdStartEval:
    """The cold starts' held-out values at one K (the mean, or the std, over seeds)."""

    kappa: float = NAN
    tool_rate: float = NAN
    format: float = NAN
    parse_errors: float = NAN
    accuracy: float = NAN

    #: each field's metric in the evaluation's ``K{K}_tools/...`` keys
    METRICS = {
        "kappa": "tool_calls_per_rollout",
        "tool_rate": "tool_call_rate",
        "format": "format_compliance",
        "parse_errors": "parse_error_rate",
        "accuracy": "accuracy",
    }

    @classmethod
    def from_dict(cls, d: Any) -> ColdStartEval:
        d = d if isinstance(d, dict) else {}
        return cls(**{k: _float(d.get(k)) for k in cls.METRICS})

    def to_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in self.METRICS}


@dataclass
class SeedSameK:
    """One cold start's :func:`same_k` values (``same_k_start_seeds``)."""

    seed: int
    same_k: dict[str, SameK]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SeedSameK:
        return cls(d.get("seed"), _same_k_map(d.get("same_k"), SameK))  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "same_k": {k: v.to_dict() for k, v in self.same_k.items()}}


@dataclass
class Bar:
    """One pre-registered bar (:func:`bars`): ``lhs`` op ``rhs``; ``met`` None when an arm or
    value it needs is missing."""

    id: str
    bar: str
    lhs: float
    rhs: float
    met: bool | None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Bar:
        met = d.get("met")
        return cls(d.get("id", ""), d.get("bar", ""), _float(d.get("lhs")),
                   _float(d.get("rhs")), met if isinstance(met, bool) else None)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "bar": self.bar, "lhs": self.lhs, "rhs": self.rhs, "met": self.met}


@dataclass
class RunInfo:
    """What the collapse driver ran (``collapse.json``'s last keys): the seeds, the task,
    q (``data.synth_decoy_share`` on "spot_decoy", else None; ``q_recorded`` False: a
    ``collapse.json`` written before it recorded q), the cold start's knobs, the evaluation
    interval and the wall time in minutes. Each is None when an older file lacks it."""

    seeds: list[int] | None = None
    task: str | None = None
    decoy_share: float | None = None
    windows: list[int] | None = None
    unclosed_think: float | None = None
    replay: float | None = None
    eval_every: int | None = None
    minutes: float | None = None
    q_recorded: bool = True

    KEYS = (
        "seeds", "task", "decoy_share", "windows", "unclosed_think", "replay", "eval_every",
        "minutes",
    )  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunInfo:
        return cls(**{k: d.get(k) for k in cls.KEYS}, q_recorded="decoy_share" in d)

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.KEYS}
        if not self.q_recorded:
            del out["decoy_share"]
        return out


@dataclass
class CollapseResult:
    """``collapse.json``, typed (:func:`summarise`; ``run``: the driver's :class:`RunInfo`,
    None for a summary alone)."""

    arms: dict[str, ArmResult]
    sft: dict[str, ColdStartEval]
    sft_std: dict[str, ColdStartEval]
    same_k_start: dict[str, SameKStats]
    same_k_start_seeds: list[SeedSameK]
    eval_k: list[int]
    same_ks: list[int]
    end_steps: int
    bars: list[Bar] = field(default_factory=list)
    run: RunInfo | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CollapseResult:
        """A ``collapse.json`` read back (one written by an older run included: a missing
        field reads as empty, NaN or None)."""
        has_run = any(k in d for k in RunInfo.KEYS)
        return cls(
            arms={a: ArmResult.from_dict(v) for a, v in (d.get("arms") or {}).items()},
            sft=_same_k_map(d.get("sft"), ColdStartEval),
            sft_std=_same_k_map(d.get("sft_std"), ColdStartEval),
            same_k_start=_same_k_map(d.get("same_k_start"), SameKStats),
            same_k_start_seeds=[SeedSameK.from_dict(s) for s in d.get("same_k_start_seeds") or []],
            eval_k=list(d.get("eval_k") or []),
            same_ks=list(d.get("same_ks") or []),
            end_steps=int(d.get("end_steps", END_STEPS)),
            bars=[Bar.from_dict(b) for b in d.get("bars") or []],
            run=RunInfo.from_dict(d) if has_run else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``collapse.json`` (keys in its order; NaN left for
        ``json_safe``)."""
        out: dict[str, Any] = {
            "arms": {a: v.to_dict() for a, v in self.arms.items()},
            "sft": {k: v.to_dict() for k, v in self.sft.items()},
            "sft_std": {k: v.to_dict() for k, v in self.sft_std.items()},
            "same_k_start": {k: v.to_dict() for k, v in self.same_k_start.items()},
            "same_k_start_seeds": [s.to_dict() for s in self.same_k_start_seeds],
            "eval_k": list(self.eval_k),
            "same_ks": list(self.same_ks),
            "end_steps": self.end_steps,
            "bars": [b.to_dict() for b in self.bars],
        }
        if self.run is not None:
            out.update(self.run.to_dict())
        return out


# ------------------------------------------------------------------------- statistics
def _ms(xs: Sequence[float]) -> MeanStd:
    xs = [x for x in xs if x == x]
    return MeanStd(mean_or_nan(xs), sample_std(xs))


def _num(r: dict[str, Any], key: str) -> float:
    v = r.get(key)
    return float(v) if isinstance(v, (int, float)) else NAN


def seed_values(rows: Sequence[dict[str, Any]], eval_k: Sequence[int]) -> SeedValues:
    """One run's summary from its ``metrics.jsonl`` rows: κ and format compliance at step 1
    and over the last ``END_STEPS`` steps; the tool-call rate over those steps, overall and
    per overview budget K the run trained at (NaN for a K none of those steps drew); held-out
    accuracy and tool-call rate after RL per K of ``eval_k`` (every arm at the same K); and
    the diagnosis: the number of steps with a mixed group and the mean over those steps of
    each step's mean advantage of tool and of no-tool rollouts (a sign that changes during
    the run cancels in it: read the per-step curves)."""
    train = sorted((r for r in rows if r.get("kind") == "train"), key=lambda r: r["step"])
    after = next((r for r in reversed(rows) if r.get("kind") == "eval_after"), {})
    last = train[-END_STEPS:]

    def end(key: str) -> float:
        return mean_or_nan([x for x in (_num(r, key) for r in last) if x == x])

    first = train[0] if train else {}
    budgets = sorted(
        {int(k[len("tool_rate/K") :]) for r in train for k in r if k.startswith("tool_rate/K")}
    )
    mixed = [r for r in train if _num(r, "adv/mixed_groups") > 0]
    return SeedValues(
        kappa_start=_num(first, "tool_calls_per_rollout"),
        kappa_end=end("tool_calls_per_rollout"),
        format_start=_num(first, "format_compliance"),
        format_end=end("format_compliance"),
        tool_rate_end=end("tool_call_rate"),
        tool_rate_end_k={str(k): end(f"tool_rate/K{k}") for k in budgets},
        acc_end_k={str(k): _num(after, f"K{k}_tools/accuracy") for k in eval_k},
        tool_rate_heldout_k={str(k): _num(after, f"K{k}_tools/tool_call_rate") for k in eval_k},
        mixed_steps=float(len(mixed)),
        adv_tool_mixed=mean_or_nan([_num(r, "adv/tool") for r in mixed]),
        adv_no_tool_mixed=mean_or_nan([_num(r, "adv/no_tool") for r in mixed]),
    )


def same_k(held: Sequence[dict[str, Any]], ks: Sequence[int]) -> dict[str, SameK]:
    """Every arm measured at the same K, prompt by prompt: from the per-prompt rows of a run's
    last held-out evaluation (``heldout.jsonl`` rows of kind ``eval_after``; the cold start's
    evaluation is one too), for each K of ``ks`` (its ``K{K}_tools`` condition): the tool-call
    rate on the prompts whose K-frame overview misses the square asked about (``need_K{K}``,
    recorded by the generator: ``paravt.data.synth.need_flags``) and on the others, accuracy
    on each, format compliance fτ and the ``</think>`` closure of tool-calling turns over all
    of them, and the share of prompts that need the tool. Each is a mean over prompts of the
    prompt's mean over its samples (NaN: no such prompt, or no tool turn)."""
    last = [r for r in held if r.get("kind") == "eval_after"]
    step = max((r["step"] for r in last), default=None)
    out: dict[str, SameK] = {}
    for k in ks:
        rows = [
            r
            for r in last
            if r["step"] == step and r.get("condition") == f"K{k}_tools" and int(r["K"]) == k
        ]
        need = [r for r in rows if (r.get("extra") or {}).get(f"need_K{k}") is True]
        free = [r for r in rows if (r.get("extra") or {}).get(f"need_K{k}") is False]

        def m(rs: Sequence[dict[str, Any]], key: str) -> float:
            return mean_or_nan([x for x in (_num(r, key) for r in rs) if x == x])

        out[str(k)] = SameK(
            tool_rate_need=m(need, "tool_call_rate"),
            tool_rate_no_need=m(free, "tool_call_rate"),
            acc_need=m(need, "accuracy"),
            acc_no_need=m(free, "accuracy"),
            format=m(rows, "format_compliance"),
            tool_turn_closure=m(rows, "tool_turn_closure"),
            share_need=len(need) / len(rows) if rows else NAN,
            prompts=float(len(rows)),
        )
    return out


def _same_k_ms(vals: Sequence[dict[str, SameK]], ks: Sequence[int]) -> dict[str, SameKStats]:
    """:func:`same_k` of several seeds as ``K -> SameKStats``."""
    return {
        str(k): SameKStats(
            **{key: _ms([getattr(v[str(k)], key) for v in vals]) for key in SAME_K_KEYS}
        )
        for k in ks
    }


def _by_step(
    seed_rows: Sequence[Sequence[dict[str, Any]]], kinds: tuple[str, ...], key: str
) -> Curve:
    """The curve of ``key`` over the seeds' rows of ``kinds`` (NaN left out; ``std``: the
    sample std over seeds, 0 with one value)."""
    by: dict[int, list[float]] = {}
    for rows in seed_rows:
        for r in rows:
            if r.get("kind") in kinds and (x := _num(r, key)) == x:
                by.setdefault(int(r["step"]), []).append(x)
    xs = sorted(by)
    return Curve(xs, [mean_or_nan(by[s]) for s in xs], [sample_std(by[s]) for s in xs])


def curves(seed_rows: Sequence[Sequence[dict[str, Any]]], keys: Sequence[str]) -> dict[str, Curve]:
    """``key -> Curve`` over an arm's seeds (NaN values left out; ``std`` across seeds: the
    band of ``collapse.png``); also ``tool_rate/K*`` and held-out ``eval/K*`` (the
    ``eval_step``/``eval_after`` rows)."""
    found = {k for rows in seed_rows for r in rows if r.get("kind") == "train" for k in r}
    keys = [*keys, *sorted(k for k in found if k.startswith("tool_rate/K"))]
    out = {key: _by_step(seed_rows, ("train",), key) for key in keys}
    acc_keys = {
        k for rows in seed_rows for r in rows
        if r.get("kind") in ("eval_step", "eval_after") for k in r
        if k.endswith("_tools/accuracy")
    }  # fmt: skip
    for key in sorted(acc_keys):
        out["eval/" + key.split("_")[0]] = _by_step(seed_rows, ("eval_step", "eval_after"), key)
    return out


def summarise(
    runs: dict[str, dict[int, list[dict[str, Any]]]],
    eval_k: Sequence[int],
    sft_eval: dict[int, dict[str, Any]],
    held: dict[str, dict[int, list[dict[str, Any]]]] | None = None,
    sft_held: dict[int, list[dict[str, Any]]] | None = None,
    same_ks: Sequence[int] = (),
    descriptions: dict[str, str] | None = None,
) -> CollapseResult:
    """``collapse.json``: per arm (``runs``: arm -> seed -> ``metrics.jsonl`` rows; its
    ``description`` from ``descriptions``, else the arm's name) ``kappa_start``,
    ``kappa_end``, ``format_start``, ``format_end``, ``tool_rate_end``, ``mixed_steps``,
    ``adv_tool_mixed``, ``adv_no_tool_mixed`` as :class:`MeanStd` over seeds;
    ``tool_rate_end_k``, ``acc_end_k`` and ``tool_rate_heldout_k`` (K -> :class:`MeanStd`; a
    seed whose value is NaN is left out of that K's mean); ``same_k`` (K of ``same_ks`` ->
    :class:`SameKStats`, from ``held``: arm -> seed -> ``heldout.jsonl`` rows); ``seeds``
    (per seed: its number and values) and ``curves`` (the held-out ``eval/K*`` ones start at
    step 0 with the cold starts'). Also ``sft`` (the cold starts' held-out evaluations,
    ``sft_eval``: seed -> its ``eval_after`` row; per K the mean over seeds, and ``sft_std``),
    ``same_k_start`` (the cold starts' :func:`same_k`, from ``sft_held``) and ``bars``
    (:func:`bars`). See :func:`seed_values`."""
    held = held or {}
    sft_held = sft_held or {}
    descriptions = descriptions or {}
    arms: dict[str, ArmResult] = {}
    for arm, by_seed in runs.items():
        vals = {s: seed_values(rows, eval_k) for s, rows in by_seed.items()}
        for s, v in vals.items():
            v.seed = s
            v.same_k = same_k(held.get(arm, {}).get(s, []), same_ks)
        ks = sorted({k for v in vals.values() for k in v.tool_rate_end_k}, key=int)
        entry = ArmResult(
            description=descriptions.get(arm, arm),
            **{key: _ms([getattr(v, key) for v in vals.values()]) for key in ArmResult._STATS},
            tool_rate_end_k={
                k: _ms([v.tool_rate_end_k.get(k, NAN) for v in vals.values()]) for k in ks
            },
            acc_end_k={str(k): _ms([v.acc_end_k[str(k)] for v in vals.values()]) for k in eval_k},
            tool_rate_heldout_k={
                str(k): _ms([v.tool_rate_heldout_k[str(k)] for v in vals.values()]) for k in eval_k
            },
            same_k=_same_k_ms([v.same_k or {} for v in vals.values()], same_ks),
            seeds=list(vals.values()),
            curves=curves(list(by_seed.values()), CURVE_KEYS),
        )
        for k in eval_k:  # step 0 of the held-out curves: the cold starts' evaluations
            xs = [_num(sft_eval.get(s, {}), f"K{k}_tools/accuracy") for s in by_seed]
            if (start := _ms(xs)).mean == start.mean:
                c = entry.curves.setdefault(f"eval/K{k}", Curve())
                c.step.insert(0, 0)
                c.mean.insert(0, start.mean)
                c.std.insert(0, start.std)
        arms[arm] = entry
    sft: dict[str, ColdStartEval] = {}
    sft_std: dict[str, ColdStartEval] = {}
    for k in eval_k:
        p = f"K{k}_tools/"
        ms = {
            name: _ms([_num(r, p + key) for r in sft_eval.values()])
            for name, key in ColdStartEval.METRICS.items()
        }
        sft[str(k)] = ColdStartEval(**{name: v.mean for name, v in ms.items()})
        sft_std[str(k)] = ColdStartEval(**{name: v.std for name, v in ms.items()})
    start_vals = {s: same_k(rows, same_ks) for s, rows in sft_held.items()}
    res = CollapseResult(
        arms=arms,
        sft=sft,
        sft_std=sft_std,
        same_k_start=_same_k_ms(list(start_vals.values()), same_ks),
        same_k_start_seeds=[SeedSameK(s, v) for s, v in start_vals.items()],
        eval_k=list(eval_k),
        same_ks=list(same_ks),
        end_steps=END_STEPS,
    )
    res.bars = bars(res)
    return res


def bars(res: CollapseResult) -> list[Bar]:
    """The pre-registered bars of protocol 3 (``docs/collapse/protocol3/PREREGISTRATION.md``),
    judged on ``res`` (:func:`summarise`) at K = ``BAR_K``, every arm at the same K, held out:

    (a) vanilla's tool-call rate on prompts that need the tool ≤ 0.5× the cold start's, and
    its accuracy on them not above the cold start's; PARA-GRPO's rate ≥ 0.5× the cold
    start's; the PARA-GRPO − vanilla gaps in that rate and in that accuracy each larger than
    twice the larger of the two arms' seed std;
    (b) anchoring's fτ above vanilla's, and PARA-GRPO's tool-turn ``</think>`` closure above
    gating's, each by more than twice the larger std;
    (c1, protocol 4, ``docs/collapse/protocol4/PREREGISTRATION.md``) the precondition that the
    question is asked on a world where the tools pay: the cold start's accuracy on the
    prompts that need the tool at least 0.5 (protocol 3's cold starts: 0.08-0.31).

    Each bar: a :class:`Bar` (``met`` None when an arm or value it needs is missing). Means
    over seeds; the cold start's is the mean of the seeds' own."""
    k = str(BAR_K)
    arms = res.arms
    start = res.same_k_start.get(k)

    def v(arm: str, key: str) -> tuple[float, float]:
        if arm not in arms or k not in arms[arm].same_k:
            return NAN, NAN
        x = getattr(arms[arm].same_k[k], key)
        return x.mean, x.std

    def s0(key: str) -> float:
        return NAN if start is None else getattr(start, key).mean

    def bar(id_: str, text: str, lhs: float, rhs: float, op: str) -> Bar:
        ok = None if lhs != lhs or rhs != rhs else {"<=": lhs <= rhs, ">=": lhs >= rhs,
                                                     ">": lhs > rhs}[op]  # fmt: skip
        return Bar(id_, text, lhs, rhs, ok)

    def gap(a: str, b: str, key: str) -> tuple[float, float]:
        (ma, sa), (mb, sb) = v(a, key), v(b, key)
        return ma - mb, 2 * max(sa, sb)

    van_rate, par_rate = v("vanilla", "tool_rate_need")[0], v("paragrpo", "tool_rate_need")[0]
    return [
        bar("a1", "vanilla's tool rate on needing prompts <= 0.5x the cold start's",
            van_rate, 0.5 * s0("tool_rate_need"), "<="),
        bar("a2", "vanilla's accuracy on needing prompts not above the cold start's",
            v("vanilla", "acc_need")[0], s0("acc_need"), "<="),
        bar("a3", "PARA-GRPO's tool rate on needing prompts >= 0.5x the cold start's",
            par_rate, 0.5 * s0("tool_rate_need"), ">="),
        bar("a4", "PARA-GRPO - vanilla tool rate on needing prompts > 2x the larger std",
            *gap("paragrpo", "vanilla", "tool_rate_need"), ">"),
        bar("a5", "PARA-GRPO - vanilla accuracy on needing prompts > 2x the larger std",
            *gap("paragrpo", "vanilla", "acc_need"), ">"),
        bar("b1", "anchoring - vanilla format compliance > 2x the larger std",
            *gap("anchoring", "vanilla", "format"), ">"),
        bar("b2", "PARA-GRPO - gating tool-turn </think> closure > 2x the larger std",
            *gap("paragrpo", "gating", "tool_turn_closure"), ">"),
        bar("c1", "the cold start's accuracy on needing prompts >= 0.5 (its tools pay)",
            s0("acc_need"), 0.5, ">="),
    ]  # fmt: skip


# --------------------------------------------------------------------------- Markdown
def _cell(ms: MeanStd) -> str:
    m, s = ms.mean, ms.std
    return "n/a" if m != m else f"{m:.2f} ± {s:.2f}"


_NONE = MeanStd(NAN, 0.0)


def format_markdown(res: CollapseResult) -> str:
    """``collapse.md``: the cold start's held-out numbers, then one row per arm, the
    per-K tool rates and the diagnosis, every arm at the same K, and the bars."""
    ks = res.eval_k
    lines = [
        "# Collapse experiment",
        "",
        "Cold starts (one per seed; mean over seeds), held-out, with tools, T = rollout "
        "temperature:",
        "",
        "| K | κ (calls/rollout) | tool-call rate | format compliance | parse errors | accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for k in ks:
        s = res.sft[str(k)]
        lines.append(
            f"| {k} | {s.kappa:.2f} | {s.tool_rate:.2f} | {s.format:.2f} | "
            f"{s.parse_errors:.2f} | {s.accuracy:.2f} |"
        )
    n = max((len(a.seeds) for a in res.arms.values()), default=0)
    seeds = sorted({s.seed for a in res.arms.values() for s in a.seeds})
    lines += [
        "",
        f"RL, mean ± std over {n} seed(s) {seeds}; start = step 1 (the SFT policy's rollouts), "
        f"end = mean of the last {res.end_steps} steps; accuracy held-out after RL:",
        "",
        "| arm | κ start | κ end | fτ start | fτ end | tool rate end | "
        + " | ".join(f"acc K{k}" for k in ks)
        + " |",
        "|" + "---|" * (6 + len(ks)),
    ]
    for arm, a in res.arms.items():
        cells = [a.kappa_start, a.kappa_end, a.format_start, a.format_end, a.tool_rate_end]
        cells += [a.acc_end_k[str(k)] for k in ks]
        lines.append(f"| {arm} | " + " | ".join(_cell(c) for c in cells) + " |")
    budgets = sorted({k for a in res.arms.values() for k in a.tool_rate_end_k}, key=int)
    lines += [
        "",
        "Tool-call rate at the end per overview budget K the arm trained at, and why tool use "
        "moved: steps with a group holding rollouts with and without a crop (mixed), and the "
        "mean group advantage of each side at those steps:",
        "",
        "| arm | "
        + " | ".join(f"tool rate K{k} end" for k in budgets)
        + " | mixed steps | adv tool | adv no-tool |",
        "|" + "---|" * (4 + len(budgets)),
    ]
    for arm, a in res.arms.items():
        cells = [a.tool_rate_end_k.get(k, _NONE) for k in budgets]
        cells += [a.mixed_steps, a.adv_tool_mixed, a.adv_no_tool_mixed]
        lines.append(f"| {arm} | " + " | ".join(_cell(c) for c in cells) + " |")
    lines += [
        "",
        "Held-out tool-call rate after RL, every arm at the same K (the cold start's: the "
        "first table):",
        "",
        "| arm | " + " | ".join(f"K{k}" for k in ks) + " |",
        "|" + "---|" * (1 + len(ks)),
    ]
    for arm, a in res.arms.items():
        cells = [a.tool_rate_heldout_k[str(k)] for k in ks]
        lines.append(f"| {arm} | " + " | ".join(_cell(c) for c in cells) + " |")
    names = {
        "tool_rate_need": "tool rate, needs tool",
        "tool_rate_no_need": "tool rate, does not",
        "acc_need": "accuracy, needs tool",
        "acc_no_need": "accuracy, does not",
        "format": "fτ",
        "tool_turn_closure": "tool-turn closure",
        "share_need": "share needing",
    }
    for k in res.same_ks:
        lines += [
            "",
            f"Every arm at the same K = {k}, held out, split prompt by prompt by whether the "
            f"K = {k} overview misses the square asked about (cold start: before RL):",
            "",
            "| arm | " + " | ".join(names[key] for key in SAME_K_KEYS) + " |",
            "|" + "---|" * (1 + len(SAME_K_KEYS)),
        ]
        rows = [("cold start", res.same_k_start.get(str(k)))]
        rows += [(arm, a.same_k.get(str(k))) for arm, a in res.arms.items()]
        for arm, vals in rows:
            cells = [_NONE if vals is None else getattr(vals, key) for key in SAME_K_KEYS]
            lines.append(f"| {arm} | " + " | ".join(_cell(c) for c in cells) + " |")
    if res.bars:
        lines += [
            "",
            f"Pre-registered bars (docs/collapse/protocol3/ and protocol4/PREREGISTRATION.md), "
            f"K = {BAR_K}:",
            "",
            "| bar | | left | right | met |",
            "|---|---|---|---|---|",
        ]
        for b in res.bars:
            met = {True: "**met**", False: "not met", None: "n/a"}[b.met]
            lines.append(f"| {b.id} | {b.bar} | {b.lhs:.3f} | {b.rhs:.3f} | {met} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- plot
def plot(res: CollapseResult, out_png: Path) -> Path:
    """``collapse.png``: per-step curves, one line per arm (the mean over seeds) in a band of
    ± one std across seeds: κ, tool-call rate, format compliance, `</think>` closure, tool vs
    no-tool advantage (points: only steps with a mixed group have one), held-out accuracy at
    the smallest K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k0 = min(res.eval_k)
    panels = [
        ("tool_calls_per_rollout", "κ (tool calls / rollout)"),
        ("tool_call_rate", "tool-call rate"),
        ("format_compliance", "format compliance fτ"),
        ("think_closure_rate", "</think> closure"),
        ("adv/tool", "advantage of tool rollouts (mixed groups)"),
        (f"eval/K{k0}", f"held-out accuracy K={k0}"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        for arm, a in res.arms.items():
            c = a.curves.get(key)
            if c and c.step:
                # Advantages exist only at steps with a mixed group: points, not a line.
                style = {"linestyle": "none", "marker": "o"} if key.startswith("adv/") else {}
                marker = "." if len(c.step) < 12 else ""
                (line,) = ax.plot(c.step, c.mean, label=arm, **{"marker": marker, **style})
                if not key.startswith("adv/"):
                    lo = [m - v for m, v in zip(c.mean, c.std)]
                    hi = [m + v for m, v in zip(c.mean, c.std)]
                    ax.fill_between(c.step, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return save_panels(fig, axes, out_png)
