"""The PARA-GRPO reward ``R = R_acc + w_fmt · R_fmt + R_tool (+ Σ w_i · term_i)`` and its
breakdown.

``score`` scores one main trajectory; ``score_groups`` fills ``reward`` and
``reward_breakdown`` of every main trajectory of a rollout and gives each sub-agent trajectory
its parent's reward (sub-agents are trained with the main agent's advantage; see
``AlgoConfig.train_sub_agents``). Used by training (``paravt.train``), the evaluation's reward
columns and the tests.

Plug-in terms (``reward.extra_terms``, as TRL's reward functions and verl's custom reward):
each a :data:`RewardTerm` named ``module:attr`` in the config, called on every main
trajectory with its sample, logged as ``reward/<name>`` (its breakdown key) and added to the
total with its weight. None by default: the total is then exactly the three terms above. A
term that raises or returns no finite number scores 0 for that trajectory, with a named error
in its ``errors`` and ``reward/term_errors`` counting them (:func:`_term_value`); one that is
no plug-in function (``os:getpid``, a class) is refused at load (:func:`term_problem`).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from functools import lru_cache

from paravt.config import ConfigError, ExtraRewardTerm, RewardConfig, resolve_plugin
from paravt.rewards import reference
from paravt.rewards.accuracy import accuracy
from paravt.rewards.format import format_reward
from paravt.rewards.tool import call_counts, tool_reward
from paravt.types import Group, Sample, Trajectory

#: A plug-in reward term: ``(main trajectory, its sample) -> float``. Read the trajectory's
#: structure (``turns``, ``calls``, their statuses), never strings the model could write to
#: claim it, as the built-in terms do.
RewardTerm = Callable[[Trajectory, Sample], float]

#: The built-in breakdown keys (``score``'s); a plug-in term may not take one as its name.
BUILTIN_KEYS = frozenset(
    "total acc has_answer em f1 iou fmt fmt_base anchor think_closed flow unclosed_think tool "
    "n_calls n_ok n_model_errors n_system_errors num_turns forced term_errors".split()
)


def term_name(term: ExtraRewardTerm) -> str:
    """The breakdown key of a plug-in term: its ``name``, else the attribute's name."""
    return term.name or term.fn.rpartition(":")[2].rpartition(".")[2]


def term_problem(obj: object) -> str | None:
    """Why ``obj`` is no :data:`RewardTerm`, or None. The rule: a Python function (or an
    instance whose ``__call__`` is one) whose signature takes ``(trajectory, sample)``
    positionally. So ``os:getpid`` (a builtin: any callable was accepted, and called on every
    trajectory), a class (calling it builds an object, not a float) and a function of another
    arity are refused before anything loads (``paravt.validate.validate_run``)."""
    if isinstance(obj, type):
        return "is a class; name a function (trajectory, sample) -> float or an instance of it"
    fn = obj if inspect.isfunction(obj) or inspect.ismethod(obj) else None
    if fn is None and callable(obj):  # an instance of a class with a Python __call__
        call = inspect.getattr_static(type(obj), "__call__", None)
        fn = call.__get__(obj) if inspect.isfunction(call) else None
    if fn is None:
        what = "a built-in" if inspect.isbuiltin(obj) else f"a {type(obj).__name__}"
        return f"is {what}, not a Python function (trajectory, sample) -> float"
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        return f"takes {inspect.signature(fn)}, not (trajectory, sample)"
    return None


@lru_cache(maxsize=64)
def load_term(fn: str, key: str = "reward.extra_terms") -> RewardTerm:
    """The function ``module:attr`` names, or a ``ConfigError`` naming ``key``, the problem and
    the fix (:func:`term_problem`). Cached: a run resolves each term once."""
    obj = resolve_plugin(fn, key)
    if why := term_problem(obj):
        raise ConfigError(f"{key}: {fn!r} {why}; a reward term is a plug-in function")
    return obj  # type: ignore[return-value]


def load_terms(cfg: RewardConfig) -> list[tuple[str, float, RewardTerm]]:
    """``(name, weight, function)`` of every ``reward.extra_terms`` entry, resolved (used by
    :func:`score` and by ``paravt.validate.validate_run`` before anything loads)."""
    out = []
    for i, t in enumerate(cfg.extra_terms):
        key = f"reward.extra_terms[{i}]"
        name = term_name(t)
        if name in BUILTIN_KEYS:
            raise ConfigError(
                f"{key}: the name {name!r} is a built-in reward key; set {key}.name to another"
            )
        out.append((name, float(t.weight), load_term(t.fn, f"{key}.fn")))
    return out


def full_text(traj: Trajectory) -> str:
    """Forced text + generated text of every turn, in order: what accuracy is read from.

    Falls back to ``traj.answer_text`` for trajectories without turns.
    """
    if not traj.turns:
        return traj.answer_text
    return "".join(t.prefix + t.text for t in traj.turns)


def score(traj: Trajectory, sample: Sample, cfg: RewardConfig) -> dict[str, float]:
    """Reward breakdown of one main trajectory.

    Keys: ``total``, ``acc``, ``has_answer`` (+ ``em``/``f1`` for oe, ``iou`` for tvg), ``fmt``,
    ``fmt_base``, ``anchor``, ``think_closed``, ``flow``, ``unclosed_think``, ``tool``,
    ``n_calls``, ``n_ok``, ``n_model_errors``, ``n_system_errors``, ``num_turns``, ``forced``.
    """
    if traj.role != "main":
        raise ValueError(
            f"trajectory {traj.uid} is a {traj.role} agent; score its parent main trajectory "
            "(sub-agents share the parent's reward via score_groups)"
        )
    # The reference's parts read what the policy generated (paravt.rewards.reference).
    ref_text = reference.completion(traj.turns) if traj.turns else traj.answer_text
    if cfg.answer_extraction == "reference":
        out = accuracy(ref_text, sample, oe_metric=cfg.oe_metric, extract=reference.extract_answer)
    else:
        out = accuracy(full_text(traj), sample, oe_metric=cfg.oe_metric)
    out.update(format_reward(traj.turns, lambda_anchor=cfg.lambda_anchor, base=cfg.base_format))
    if cfg.tool_mode == "reference":
        out["tool"] = reference.tool_reward(ref_text, out["acc"])
        out.update({k: float(v) for k, v in call_counts(traj).items()})
    else:
        out.update(
            tool_reward(
                traj,
                out["acc"],
                tool_bonus=cfg.tool_bonus,
                tool_error_penalty=cfg.tool_error_penalty,
                correct_threshold=cfg.tool_correct_threshold,
                call_cost=cfg.call_cost,
            )
        )
    out["num_turns"] = float(len(traj.turns))
    out["forced"] = float(any(t.forced_answer for t in traj.turns))
    out["total"] = out["acc"] + cfg.w_fmt * out["fmt"] + out["tool"]
    if cfg.extra_terms:
        out["term_errors"] = 0.0
    for name, weight, fn in load_terms(cfg) if cfg.extra_terms else ():
        value, why = _term_value(fn, traj, sample)
        if why:  # the plug-in's failure: 0 for this trajectory, named in its errors
            out["term_errors"] += 1.0
            traj.errors.append(f"reward term {name!r} {why}; it scores 0 for this rollout")
            if (name, why[:40]) not in _WARNED:
                _WARNED.add((name, why[:40]))
                log.warning("reward term %r %s (rollout %s); it scores 0", name, why, traj.uid)
        out[name] = value
        out["total"] += weight * value
    return out


log = logging.getLogger("paravt.rewards")
_WARNED: set[tuple[str, str]] = set()  # (term, problem) pairs already warned about


def _term_value(fn: RewardTerm, traj: Trajectory, sample: Sample) -> tuple[float, str]:
    """A plug-in term's value for one trajectory and ``""``, or ``0.0`` and what went wrong:
    it raised, or returned no finite number (a bool, a string, NaN, inf). Issue 66 chose the
    zero over dropping the rollout: its other rewards stay as they are, and the failure is a
    named error of the trajectory (``Trajectory.errors``) counted as ``reward/term_errors``
    (the mean failed terms per rollout) in the step's metrics."""
    try:
        value = fn(traj, sample)
    except Exception as e:  # noqa: BLE001 — a plug-in's bug costs its term, not the run
        return 0.0, f"raised {type(e).__name__}: {str(e)[:200]}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return 0.0, f"returned {type(value).__name__}, not a float"
    try:
        x = float(value)
    except OverflowError:
        return 0.0, f"returned {str(value)[:40]}, past a float's range"
    if not math.isfinite(x):
        return 0.0, f"returned {x}, not a finite number"
    return x, ""


def score_groups(groups: list[Group], cfg: RewardConfig) -> None:
    """Fill ``reward``/``reward_breakdown`` of all main trajectories; sub-agents copy their
    parent's (matched by ``Trajectory.parent``)."""
    for g in groups:
        by_uid: dict[str, Trajectory] = {}
        for t in g.trajectories:
            t.reward_breakdown = score(t, g.sample, cfg)
            t.reward = t.reward_breakdown["total"]
            by_uid[t.uid] = t
        for s in g.sub_trajectories:
            parent = by_uid.get(s.parent or "")
            if parent is None:
                raise ValueError(
                    f"sub-agent trajectory {s.uid} names parent {s.parent!r}, which is not a main "
                    f"trajectory of group {g.group_id}; keep sub-agents with their parent's group"
                )
            s.reward = parent.reward
            s.reward_breakdown = dict(parent.reward_breakdown)
