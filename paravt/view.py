"""``python -m paravt.view RUN_DIR [--out DIR] [--serve PORT]`` — a static HTML report of a run.

RUN_DIR is a training run folder (``metrics.jsonl``; ``python -m paravt.train`` / ``make
train``) or an evaluation folder (``results.jsonl``; ``python -m paravt.eval --out DIR``). The
report goes to ``--out`` (default ``RUN_DIR/view``) and needs no server, no network and no
JavaScript library: open ``index.html`` in a browser, or pass ``--serve PORT`` to serve it
with the standard library's ``http.server`` (127.0.0.1 only; the report and its thumbnails,
nothing else of the run: :func:`make_server`).

* ``index.html``: the alarms (``paravt.alarms``, the ``kind: "alarm"`` rows), the main curves
  as inline SVG drawn here (reward and its parts, format, ``</think>`` closure, tool-call rate
  overall and per K, parse errors, accuracy, KL, entropy: whichever keys the run logged), the
  before/after evaluation, and the resolved ``config.yaml`` (for an evaluation: its
  ``summary.json`` and ``run.json``).
* ``trajectories.html``: every logged trajectory (``trajectories.jsonl``, or each row of
  ``results.jsonl``): question and gold answer, K, the overview frames as thumbnails on a time
  axis spanning the video, each executed call's window as a bar at its [start, end] labelled
  by its tool (``crop_video``, a plug-in's name; coloured per tool) with its sub-agent's
  summary, each main turn with its ``<think>`` / ``<tool_call>`` / ``<answer>`` spans
  highlighted, failed calls, the reward breakdown; filters (wrong answers, parse errors, no
  tool use, per K) are a few lines of vanilla JS toggling a class.

Model output is hostile text: every string from a run is HTML-escaped (``html.escape``) and
none is placed inside a ``<script>``; the filters read ``data-*`` attributes only.
Thumbnails (``thumbs/``, see ``paravt.metrics.ThumbnailStore``) are copied next to the pages so
the folder is self-contained; a missing one is drawn as a bare tick, never a broken image. They
load lazily (as they scroll into view), so a page of 100 trajectories opens in well under 2 s.
"""

from __future__ import annotations

import argparse
import errno
import html
import json
import os
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paravt.files import (
    DISK_FULL,
    UNWRITABLE,
    file_kind,
    read_text_regular,
    write_atomic,
    write_failure,
)
from paravt.log import get_logger
from paravt.metrics import read_metrics

log = get_logger(__name__)

# Curve panels of the run page: (title, keys or a key prefix ending in "/K" or "*": every key
# that prefix followed by digits; or ending in "/": every key under it). A panel is drawn when at least one of its keys was logged.
# The async/* panels appear for asynchronous runs (paravt.workers) only.
CURVES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/total",)),
    ("reward parts", ("reward/acc", "reward/fmt", "reward/anchor", "reward/tool")),
    ("format compliance", ("format_compliance",)),
    ("</think> closure", ("think_closure_rate",)),
    ("tool-call rate", ("tool_call_rate",)),
    ("tool-call rate per K", ("tool_rate/K",)),
    ("tool calls / rollout", ("tool_calls_per_rollout",)),
    ("tool calls / rollout per tool", ("tool_calls/",)),
    ("parse-error rate", ("parse_error_rate",)),
    ("accuracy", ("accuracy",)),
    ("accuracy per K", ("acc/K",)),
    ("KL to reference", ("kl",)),
    ("entropy", ("entropy",)),
    ("loss", ("loss",)),
    ("grad norm", ("grad_norm",)),
    ("staleness per trained token", ("async/staleness_max", "async/staleness_mean")),
    ("staleness histogram (token share)", ("async/staleness_*",)),
    ("async queue", ("async/queue_depth", "async/in_flight_steps", "async/versions_in_batch")),
    ("async idle fraction", ("async/trainer_idle_frac", "async/worker_idle_frac")),
)
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
TAGS = re.compile(r"</?(?:think|tool_call|answer)>")


class ViewError(ValueError):
    """A folder the viewer cannot render (the message says what is missing and how to make it)."""


# ------------------------------------------------------------------------------- records
@dataclass
class CallView:
    status: str
    start: float | None
    end: float | None
    response: str = ""
    error: str = ""
    tool: str = ""  # the tool the call names ('' when unknown: bad JSON, an older record)


@dataclass
class TurnView:
    prefix: str  # forced text (the think prefix, a forced answer's prompt); "" when unknown
    text: str  # generated text
    calls: list[CallView] = field(default_factory=list)
    forced_answer: bool = False


@dataclass
class TrajView:
    """One trajectory as the pages show it (from ``trajectories.jsonl`` or ``results.jsonl``)."""

    name: str
    step: int | None
    K: int
    question: str
    answer: str
    turns: list[TurnView]
    reward: float | None
    breakdown: dict[str, Any]
    correct: bool
    duration: float | None = None
    frame_times: list[float] = field(default_factory=list)
    thumbs: list[str] | None = None  # paths relative to the run folder

    @property
    def calls(self) -> list[CallView]:
        return [c for t in self.turns for c in t.calls]

    @property
    def parse_errors(self) -> int:
        return sum(c.status != "ok" for c in self.calls)

    @property
    def used_tool(self) -> bool:
        return any(c.status == "ok" for c in self.calls)

    def axis_seconds(self) -> float:
        """The time axis' length: the video's duration, else the latest time it mentions."""
        if self.duration:
            return float(self.duration)
        ends = [c.end for c in self.calls if c.end is not None] + list(self.frame_times)
        return max([1.0, *ends])


@dataclass
class Report:
    kind: str  # "train" | "eval"
    run_dir: Path
    metrics: list[dict[str, Any]]
    alarms: list[dict[str, Any]]
    config_text: str
    trajectories: list[TrajView]
    summary: dict[str, Any] = field(default_factory=dict)


def _num(v: Any) -> float | None:
    """A finite number from a record, else None: every number the pages print or put in an
    attribute goes through here, so a hand-edited record cannot inject markup through one."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if x == x and abs(x) != float("inf") else None


def _items(v: Any, *kinds: type) -> list[Any]:
    """The items of ``v`` that are of ``kinds`` when ``v`` is a list, else none: a record's
    list fields as a hand-edited or foreign file may hold them (``"turns": "text"`` would
    otherwise be read a character at a time)."""
    return [x for x in v if isinstance(x, kinds)] if isinstance(v, list) else []


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _call(c: Any) -> CallView:
    if isinstance(c, (list, tuple)):  # runs before the viewer: [status, start, end]
        c = list(c) + [None] * 3
        return CallView(str(c[0]), _num(c[1]), _num(c[2]))
    return CallView(
        str(c.get("status", "")),
        _num(c.get("start")),
        _num(c.get("end")),
        str(c.get("response") or ""),
        str(c.get("error") or ""),
        str(c.get("tool") or ""),
    )


def _train_traj(r: dict[str, Any]) -> TrajView:
    b = _dict(r.get("breakdown"))
    return TrajView(
        name=str(r.get("uid", "")),
        step=None if _num(r.get("step")) is None else int(_num(r.get("step"))),
        K=int(_num(r.get("K")) or 0),
        question=str(r.get("question", "")),
        answer=str(r.get("answer", "")),
        turns=[
            TurnView(
                str(t.get("prefix", "")),
                str(t.get("text", "")),
                [_call(c) for c in _items(t.get("calls"), dict, list)],
                bool(t.get("forced_answer", False)),
            )
            for t in _items(r.get("turns"), dict)
        ],
        reward=_num(r.get("reward")),
        breakdown=b,
        correct=_correct(b.get("acc"), r.get("task")),
        duration=_num(r.get("duration")),
        frame_times=[
            x for x in map(_num, _items(r.get("frame_times"), int, float)) if x is not None
        ],
        thumbs=_items(r.get("thumbs"), str) or None,
    )


def _correct(acc: Any, task: Any) -> bool:
    """Right answer: accuracy 1 (MCQ, open-ended), or a temporal IoU >= 0.5 for grounding
    (``tvg``: R@1 at IoU 0.5, the usual threshold)."""
    try:
        a = float(acc or 0.0)
    except (TypeError, ValueError):
        return False
    return a >= 0.5 if task == "tvg" else a >= 1.0


def _eval_traj(r: dict[str, Any]) -> TrajView:
    keys = ("score", "correct", "iou", "parsed", "source", "calls", "calls_ok", "error")
    correct = r.get("correct")
    return TrajView(
        name=str(r.get("id", "")),
        step=None,
        K=int(_num(r.get("frames")) or 0),
        question=str(r.get("question", "")),
        answer=str(r.get("answer", "")),
        turns=[
            TurnView(
                "",
                str(t.get("text", "")),
                [_call(c) for c in _items(t.get("calls"), dict, list)],
                bool(t.get("forced_answer", False)),
            )
            for t in _items(r.get("trace"), dict)
        ],
        reward=_num(r.get("score")),
        breakdown={k: r.get(k) for k in keys if r.get(k) is not None},
        correct=bool(correct) if correct is not None else _correct(r.get("iou"), "tvg"),
        duration=_num(r.get("duration")),
    )


def load_report(run_dir: str | Path) -> Report:
    """Read a training run folder (``metrics.jsonl``) or an evaluation folder
    (``results.jsonl``); raises :class:`ViewError` for anything else. Regular files only
    (``paravt.files.read_regular``): a FIFO in a record's place is refused by name, never read
    (a read would wait for a writer forever)."""
    d = Path(run_dir)
    if not d.is_dir():
        raise ViewError(f"{d} is not a directory (pass a training run or evaluation folder)")
    for name in ("metrics.jsonl", "results.jsonl"):
        p = d / name
        if p.exists() and not p.is_file():
            raise ViewError(
                f"{p} is {file_kind(p.stat().st_mode)}, not a regular file: the viewer reads "
                f"regular files only; replace it with the run's {name} (or remove it)"
            )
    if (d / "metrics.jsonl").is_file():
        rows = read_metrics(d / "metrics.jsonl")
        cfg = read_text_regular(d / "config.yaml")
        return Report(
            "train",
            d,
            [r for r in rows if r.get("kind") != "alarm"],
            [r for r in rows if r.get("kind") == "alarm"],
            cfg if cfg is not None else "(no config.yaml in the run folder)",
            [_train_traj(r) for r in read_metrics(d / "trajectories.jsonl")],
        )
    if (d / "results.jsonl").is_file():
        run = read_text_regular(d / "run.json")
        try:
            summary = json.loads(read_text_regular(d / "summary.json") or "{}")
        except json.JSONDecodeError:
            summary = {}
        return Report(
            "eval",
            d,
            [],
            [],
            run if run is not None else "(no run.json in the evaluation folder)",
            [_eval_traj(r) for r in read_metrics(d / "results.jsonl")],
            summary if isinstance(summary, dict) else {},
        )
    raise ViewError(
        f"{d} has neither metrics.jsonl (a training run: `make train` or `python -m paravt.train "
        "train.out_dir=DIR` writes it) nor results.jsonl (an evaluation: `python -m paravt.eval "
        "--benchmark NAME --out DIR` writes it)"
    )


# ------------------------------------------------------------------------------- curves
def _series(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, list[tuple]]:
    names: list[str] = []
    shares: dict[str, str] = {}  # histogram key -> its prefix ("*" panels)
    for k in keys:
        if k.endswith(("/K", "*")):
            hist, k = k.endswith("*"), k.rstrip("*")
            found = {x for r in rows for x in r if x.startswith(k) and x[len(k) :].isdigit()}
            names += sorted(found, key=lambda x: int(x[len(k) :]))
            shares |= dict.fromkeys(found, k) if hist else {}
        elif k.endswith("/"):
            names += sorted({x for r in rows for x in r if x.startswith(k) and x != k})
        elif any(k in r for r in rows):
            names.append(k)
    out = {}
    hist_rows: dict[str, list[dict[str, Any]]] = {}  # prefix -> the rows that logged it
    for n in names:
        if n in shares:
            # A histogram logs the observed values only: at a step that logged the histogram
            # an absent value is a share of 0, and a value no step observed is not drawn (an
            # older run logged every value up to η, almost all zeros).
            pre = shares[n]
            if pre not in hist_rows:
                hist_rows[pre] = [
                    r for r in rows if any(x.startswith(pre) and x[len(pre) :].isdigit() for x in r)
                ]
            pts = [(_num(r.get("step")), _num(r.get(n, 0.0))) for r in hist_rows[pre]]
            if not any(y for _, y in pts):
                continue
        else:
            pts = [(_num(r.get("step")), _num(r[n])) for r in rows if n in r]
        # Finite (step, value) pairs only: a NaN logged by a diverging run, or a hand-edited
        # step, would otherwise make the panel's scale NaN (or crash it).
        pts = [(x, y) for x, y in pts if x is not None and y is not None]
        if pts:
            out[n] = pts
    return out


def svg_curve(
    title: str,
    series: dict[str, list[tuple]],
    marks: Sequence[int] = (),
    w: int = 300,
    h: int = 170,
) -> str:
    """One panel: each series a polyline over step, y from its min to max; ``marks`` are alarm
    steps drawn as red vertical lines."""
    pad_l, pad_r, pad_t, pad_b = 52, 8, 22, 34
    xs = [x for pts in series.values() for x, _ in pts] + list(marks)
    ys = [y for pts in series.values() for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pw, ph = w - pad_l - pad_r, h - pad_t - pad_b

    def px(x: float) -> float:
        return pad_l + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return pad_t + (1 - (y - y0) / (y1 - y0)) * ph

    e = html.escape
    n = 3  # significant digits: enough for the two y labels to differ
    while n < 8 and f"{y0:.{n}g}" == f"{y1:.{n}g}":
        n += 1
    parts = [
        f'<svg class="curve" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
        f'aria-label="{e(title)}">',
        f'<text x="{w / 2}" y="14" text-anchor="middle" class="ttl">{e(title)}</text>',
        f'<rect x="{pad_l}" y="{pad_t}" width="{pw}" height="{ph}" class="frame"/>',
        f'<text x="{pad_l - 3}" y="{pad_t + 8}" text-anchor="end">{y1:.{n}g}</text>',
        f'<text x="{pad_l - 3}" y="{pad_t + ph}" text-anchor="end">{y0:.{n}g}</text>',
        f'<text x="{pad_l}" y="{h - pad_b + 12}">{x0:g}</text>',
        f'<text x="{pad_l + pw}" y="{h - pad_b + 12}" text-anchor="end">{x1:g}</text>',
    ]
    for s in marks:
        parts.append(
            f'<line class="alarm-mark" x1="{px(s):.1f}" x2="{px(s):.1f}" y1="{pad_t}" '
            f'y2="{pad_t + ph}"><title>alarm at step {s}</title></line>'
        )
    for i, (name, pts) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        parts.append(
            f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{coords}">'
            f"<title>{e(name)}</title></polyline>"
        )
        if len(pts) == 1:
            parts.append(f'<circle cx="{px(pts[0][0]):.1f}" cy="{py(pts[0][1]):.1f}" r="2.5" '
                         f'fill="{color}"/>')  # fmt: skip
        if len(series) > 1:
            lx = pad_l + (i % 3) * (pw / 3)
            ly = h - 12 + (i // 3) * 10  # rows of three; a 7th+ series overflows the panel
            parts.append(f'<text x="{lx:.0f}" y="{ly}" fill="{color}">{e(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


# ------------------------------------------------------------------------------- text
_SPAN = {"think": "think", "tool_call": "call", "answer": "answer"}


def highlight(prefix: str, text: str) -> str:
    """``prefix + text`` as escaped HTML with ``<think>``, ``<tool_call>`` and ``<answer>``
    spans (tags included) wrapped in ``<span class="think|call|answer">``; the forced prefix
    is also marked ``forced``. Unclosed spans run to the end; stray closers close nothing."""
    full = prefix + text
    cuts = sorted({0, len(prefix), len(full)} | {p for m in TAGS.finditer(full) for p in m.span()})
    out: list[str] = []
    open_tag: str | None = None
    for a, b in zip(cuts, cuts[1:]):
        seg = full[a:b]
        m = TAGS.fullmatch(seg)
        if m and not seg.startswith("</"):
            open_tag = seg[1:-1]
        classes = [_SPAN[open_tag]] if open_tag else []
        if m:
            classes.append("tag")
        if b <= len(prefix):
            classes.append("forced")
        body = html.escape(seg)
        out.append(f'<span class="{" ".join(classes)}">{body}</span>' if classes else body)
        if m and seg.startswith("</") and open_tag == seg[2:-1]:
            open_tag = None
    return "".join(out)


# ------------------------------------------------------------------------------- pages
CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:20px}h2{font-size:16px;margin-top:24px}
nav a{margin-right:12px}
.curves{display:flex;flex-wrap:wrap;gap:8px}
svg.curve{background:#fff;border:1px solid #ddd;font-size:10px}
svg.curve .ttl{font-size:12px;font-weight:600}
svg.curve .frame{fill:none;stroke:#ccc}
svg.curve .alarm-mark{stroke:#d00;stroke-dasharray:3 2}
.alarm{background:#fee;border:1px solid #d00;padding:4px 8px;margin:4px 0}
.ok{background:#efe;border:1px solid #6a6;padding:4px 8px}
pre{background:#fff;border:1px solid #ddd;padding:8px;overflow:auto;max-height:400px}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:2px 6px;text-align:left}
.filters{position:sticky;top:0;background:#fafafa;padding:6px 0;border-bottom:1px solid #ccc;z-index:5}
.traj{background:#fff;border:1px solid #ccc;margin:12px 0;padding:8px 12px}
.traj.hidden{display:none}
.traj h3{font-size:14px;margin:0 0 4px}
.badge{display:inline-block;padding:0 6px;border-radius:8px;font-size:12px;margin-left:4px}
.b-wrong{background:#fdd}.b-right{background:#dfd}.b-perr{background:#fc8}.b-notool{background:#ddd}
.timeline{position:relative;margin:8px 0 4px}
.frames{position:relative;height:60px}
.frames .fr{position:absolute;top:0;transform:translateX(-50%);text-align:center;font-size:9px}
.frames img{display:block;height:44px;border:1px solid #999}
.frames .tick{width:1px;height:44px;background:#999;margin:0 auto}
.axis{position:relative;height:18px;border-top:2px solid #333;font-size:10px}
.axis span{position:absolute;top:2px;transform:translateX(-50%)}
.lanes{position:relative}
.crop{position:absolute;height:14px;min-width:2px;background:#1f77b4;opacity:.8;border-radius:2px}
.tlabel{position:absolute;top:1px;font-size:10px;padding:0 3px;white-space:nowrap;color:#333}
.tname{font-family:ui-monospace,monospace;font-weight:700}
.lane{position:relative;height:18px}
ol.summaries{font-size:12px;margin:4px 0}
.turn{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:12px;background:#f6f6f6;
 border:1px solid #e0e0e0;padding:6px;margin:4px 0}
.think{background:#eef3ff}.call{background:#fff3d6}.answer{background:#dff5df}
.tag{font-weight:700;color:#555}.forced{color:#888;font-style:italic}
.perr{color:#b00}
.scroll{overflow-x:auto}
"""

JS = """
function applyFilters(){
  var wrong=document.getElementById('f-wrong').checked,
      perr=document.getElementById('f-perr').checked,
      notool=document.getElementById('f-notool').checked,
      k=document.getElementById('f-k').value, shown=0;
  document.querySelectorAll('.traj').forEach(function(el){
    var hide=(wrong&&el.dataset.wrong!=='1')||(perr&&el.dataset.perr==='0')||
             (notool&&el.dataset.tool!=='0')||(k&&el.dataset.k!==k);
    el.classList.toggle('hidden',hide); if(!hide) shown++;
  });
  document.getElementById('shown').textContent=shown;
}
document.querySelectorAll('.filters input,.filters select').forEach(function(el){
  el.addEventListener('change',applyFilters);});
applyFilters();
"""


def _page(title: str, body: str, script: str = "") -> str:
    js = f"<script>{script}</script>" if script else ""
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}'
        f'</title><style>{CSS}</style></head><body><nav><a href="index.html">run</a>'
        f'<a href="trajectories.html">trajectories</a></nav>{body}{js}</body></html>'
    )


def _step(r: dict[str, Any]) -> int | None:
    """A record's step as an int, None when it has none usable (missing, NaN, text)."""
    x = _num(r.get("step"))
    return None if x is None else int(x)


def _alarm_steps(alarms: Sequence[dict[str, Any]], keys: Sequence[str]) -> list[int]:
    """Steps of the alarms on ``keys`` (an alarm without a usable step draws no mark)."""
    return [
        s
        for a in alarms
        if any(a.get("metric") == k or str(a.get("metric", "")).startswith(k) for k in keys)
        and (s := _step(a)) is not None
    ]


def render_index(rep: Report) -> str:
    e = html.escape
    b = [f"<h1>{e(rep.kind)} run: {e(str(rep.run_dir))}</h1>"]
    b.append(f'<p><a href="trajectories.html">{len(rep.trajectories)} trajectories</a></p>')
    if rep.kind == "train":
        b.append("<h2>Alarms</h2>")
        if rep.alarms:
            for a in rep.alarms:
                s = _step(a)
                b.append(
                    f'<div class="alarm">step {"?" if s is None else s}: '
                    f"{e(str(a.get('message', '')))}</div>"
                )
        else:
            b.append('<div class="ok">no collapse alarm</div>')
        train = [r for r in rep.metrics if r.get("kind", "train") == "train"]
        b.append(f"<h2>Curves ({len(train)} steps)</h2><div class='curves'>")
        for title, keys in CURVES:
            series = _series(train, keys)
            if series:
                b.append(svg_curve(title, series, _alarm_steps(rep.alarms, keys)))
        b.append("</div>")
        evals = [r for r in rep.metrics if str(r.get("kind", "")).startswith("eval")]
        if evals:
            keys = ["accuracy", "reward/total", "format_compliance", "tool_call_rate",
                    "think_closure_rate", "parse_error_rate"]  # fmt: skip
            b.append("<h2>Evaluation</h2><table><tr><th>kind</th><th>step</th>")
            b += [f"<th>{e(k)}</th>" for k in keys]
            b.append("</tr>")
            for r in evals:
                cells = "".join(
                    f"<td>{x:.3f}</td>" if (x := _num(r.get(k))) is not None else "<td></td>"
                    for k in keys
                )
                step = e(str(r.get("step", "")))  # as logged, escaped: a record is hostile text
                b.append(f"<tr><td>{e(str(r['kind']))}</td><td>{step}</td>{cells}</tr>")
            b.append("</table>")
        b.append(f"<h2>Config (config.yaml)</h2><pre>{e(rep.config_text)}</pre>")
    else:
        b.append("<h2>Summary (summary.json)</h2>")
        b.append(f"<pre>{e(json.dumps(rep.summary, indent=1)[:20000])}</pre>")
        b.append(f"<h2>Settings (run.json)</h2><pre>{e(rep.config_text)}</pre>")
    return _page(f"paravt {rep.kind} run", "".join(b))


def _fmt(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _tool_colour(tool: str) -> str:
    """The bar colour of a call of ``tool``: '' (the stylesheet's blue) for ``crop_video`` and
    for an unnamed call, else one of :data:`PALETTE`'s others, fixed by the name (crc32, so a
    tool keeps its colour across pages and runs)."""
    if tool in ("", "crop_video"):
        return ""
    return PALETTE[1 + zlib.crc32(tool.encode()) % (len(PALETTE) - 1)]


def render_trajectory(i: int, t: TrajView, thumbs: dict[str, str]) -> str:
    """One ``<section class="traj">``: header, timeline (frames, axis, crop bars), turns,
    calls, reward breakdown. ``thumbs`` maps a record's thumbnail path to the copied file
    (absent: not available, drawn as a tick)."""
    e = html.escape
    dur = t.axis_seconds()
    at = lambda s: min(max(float(s) / dur, 0.0), 1.0) * 100  # noqa: E731  (% of the axis)
    pct = lambda s: f"{at(s):.4f}%"  # noqa: E731
    flags = (
        f'data-k="{t.K}" data-wrong="{int(not t.correct)}" data-perr="{t.parse_errors}" '
        f'data-tool="{int(t.used_tool)}"'
    )
    head = f"#{i} {t.name}" + (f" (step {t.step})" if t.step is not None else "")
    badges = ('<span class="badge b-right">correct</span>' if t.correct
              else '<span class="badge b-wrong">wrong</span>')  # fmt: skip
    if t.parse_errors:
        badges += f'<span class="badge b-perr">{t.parse_errors} parse error(s)</span>'
    if not t.used_tool:
        badges += '<span class="badge b-notool">no tool use</span>'
    p = [f'<section class="traj" id="t{i}" {flags}><h3>{e(head)} K={t.K}{badges}</h3>']
    p.append(f'<div class="q"><b>Q:</b> {e(t.question) or "<i>(question not recorded)</i>"}</div>')
    p.append(f'<div><b>gold:</b> <span class="gold">{e(t.answer)}</span>')
    if t.reward is not None:
        p.append(f" &nbsp; <b>reward:</b> {_fmt(t.reward)}")
    p.append("</div>")
    # Timeline: frames above the axis, crop bars below, all in % of the axis' width.
    p.append(f'<div class="timeline" data-duration="{dur}"><div class="frames">')
    srcs = t.thumbs or []
    for k, ts in enumerate(t.frame_times):
        src = thumbs.get(srcs[k]) if k < len(srcs) else None
        # Lazy: 100 trajectories x 32 frames load in ~0.3 s instead of ~1.3 s (test_view.py).
        pic = (f'<img loading="lazy" src="{e(src)}" alt="frame at {ts:.1f} s">' if src
               else '<div class="tick"></div>')  # fmt: skip
        p.append(f'<div class="fr" style="left:{pct(ts)}" data-t="{ts}">{pic}{ts:.0f}s</div>')
    p.append('</div><div class="axis">')
    for q in range(5):
        s = dur * q / 4
        p.append(f'<span style="left:{pct(s)}">{s:.0f}s</span>')
    p.append('</div><div class="lanes">')
    ok = [c for c in t.calls if c.status == "ok" and c.start is not None and c.end is not None]
    for n, c in enumerate(ok):
        assert c.start is not None and c.end is not None
        w = f"{max(min(c.end, dur) - max(c.start, 0.0), 0.0) / dur * 100:.4f}%"
        name = e(c.tool or "call")
        colour = f";background:{_tool_colour(c.tool)}" if _tool_colour(c.tool) else ""
        # The label beside the bar: after it, or before it when the bar ends near the axis' end.
        side = f"left:{pct(c.end)}" if at(c.end) < 80 else f"right:{100 - at(c.start):.4f}%"
        p.append(
            f'<div class="lane"><div class="crop" data-tool="{name}" data-start="{c.start}" '
            f'data-end="{c.end}" style="left:{pct(c.start)};width:{w}{colour}" title="{name} '
            f'{n + 1}: {c.start:.1f}-{c.end:.1f} s"></div>'
            f'<span class="tlabel" style="{side}">{name} {n + 1}</span></div>'
        )
    p.append("</div></div>")
    if ok:
        p.append('<ol class="summaries">')
        p += [
            f"<li><span class='tname'>{e(c.tool or 'call')}</span> [{c.start:.1f}, {c.end:.1f}] s: "
            f"<span class='summary'>{e(c.response)}</span></li>"
            for c in ok
        ]
        p.append("</ol>")
    for j, turn in enumerate(t.turns):
        tag = " (forced answer)" if turn.forced_answer else ""
        p.append(f"<div><b>turn {j}{tag}</b></div>")
        p.append(f'<div class="turn">{highlight(turn.prefix, turn.text)}</div>')
        bad = [c for c in turn.calls if c.status != "ok"]
        for c in bad:
            tool = f" ({e(c.tool)})" if c.tool else ""
            p.append(f'<div class="perr">call failed{tool}: {e(c.status)}: {e(c.error)}</div>')
    if t.breakdown:
        p.append("<div class='scroll'><table class='breakdown'><tr>")
        p += [f"<th>{e(str(k))}</th>" for k in t.breakdown]
        p.append("</tr><tr>")
        p += [f"<td>{e(_fmt(v))}</td>" for v in t.breakdown.values()]
        p.append("</tr></table></div>")
    p.append("</section>")
    return "".join(p)


def render_trajectories(rep: Report, thumbs: dict[str, str]) -> str:
    ks = sorted({t.K for t in rep.trajectories})
    opts = "".join(f'<option value="{k}">K={k}</option>' for k in ks)
    b = [
        f"<h1>Trajectories ({len(rep.trajectories)})</h1>",
        '<div class="filters"><label><input type="checkbox" id="f-wrong"> wrong answers</label> '
        '<label><input type="checkbox" id="f-perr"> parse errors</label> '
        '<label><input type="checkbox" id="f-notool"> no tool use</label> '
        f'<select id="f-k"><option value="">every K</option>{opts}</select> '
        '&nbsp; showing <span id="shown"></span></div>',
    ]
    if not rep.trajectories:
        b.append("<p>No trajectory logged (train.log_trajectories=0?).</p>")
    b += [render_trajectory(i, t, thumbs) for i, t in enumerate(rep.trajectories)]
    return _page("paravt trajectories", "".join(b), JS)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Render ``run_dir`` into ``out`` (default ``run_dir/view``); returns ``out/index.html``.

    Inside the run folder (the default) the pages link the run's own ``thumbs/`` (nothing is
    copied: the run's viewer assets are its thumbnails, capped by ``train.viewer_max_mb``, and
    two HTML pages); elsewhere the thumbnails are copied into ``out/thumbs/`` so that the report
    is a self-contained folder.
    """
    rep = load_report(run_dir)
    root = rep.run_dir.resolve()
    dst = Path(out) if out else Path(run_dir) / "view"
    if not out:  # the run's folder is not ours: its view/ must be a folder, not a link
        _own_folder(dst)
    dst.mkdir(parents=True, exist_ok=True)
    inside = root == dst.resolve() or root in dst.resolve().parents
    thumbs: dict[str, str] = {}
    for t in rep.trajectories:
        for rel in t.thumbs or []:
            if rel in thumbs:
                continue
            src = (rep.run_dir / rel).resolve()
            # Only files inside the run folder: a record never makes the viewer read elsewhere.
            if not src.is_file() or root not in src.parents:
                continue
            if inside:
                thumbs[rel] = Path(os.path.relpath(src, dst.resolve())).as_posix()
                continue
            name = "thumbs/" + src.relative_to(root).as_posix().replace("/", "_")
            target = dst / name
            _own_folder(target.parent)
            target.parent.mkdir(exist_ok=True)
            write_atomic(target, src.read_bytes(), fsync=False)
            thumbs[rel] = name
    # Through a temporary and a rename: a link planted at a page is replaced, not followed.
    write_atomic(dst / "index.html", render_index(rep))
    write_atomic(dst / "trajectories.html", render_trajectories(rep, thumbs))
    return dst / "index.html"


def _own_folder(d: Path) -> None:
    """Refuse (:class:`ViewError`) a symlink at ``d``, a folder the viewer makes inside a folder
    it does not own (``RUN_DIR/view``, ``thumbs/``): writing through it would put the pages
    wherever the link points (any folder of the machine, for a viewer run as root)."""
    if d.is_symlink():
        raise ViewError(
            f"{d} is a symbolic link (to {os.readlink(d)}); the report is written into a real "
            f"folder only: remove the link, or pass --out DIR to write the report elsewhere"
        )


def make_server(index: Path, run_dir: Path, port: int) -> tuple[Any, str]:
    """An HTTP server (stdlib ``http.server``, 127.0.0.1 only) for the report whose first page
    is ``index``, and the URL of that page; ``port`` 0 lets the system pick one.

    A report inside its run folder (the default ``RUN_DIR/view``) links the run's own
    ``thumbs/`` as ``../thumbs/…``, so the server's root is the run folder; a report elsewhere
    is self-contained and is the root itself. Only the report's two pages and the thumbnail
    folders are served: the rest of the run (checkpoints, config, metrics) and anything above
    the root answer 404, whatever ``..`` or symlink a request holds. Raises :class:`ViewError`
    when the port cannot be bound (in use, privileged, out of range)."""
    import errno
    import functools
    from http import HTTPStatus
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import quote, urlsplit

    report, run = index.parent.resolve(), run_dir.resolve()
    root = run if run == report or run in report.parents else report
    allowed = (report / "index.html", report / "trajectories.html", report / "thumbs")
    allowed += (root / "thumbs",)
    start = "/" + quote(index.resolve().relative_to(root).as_posix())

    class Handler(SimpleHTTPRequestHandler):
        def send_head(self):  # type: ignore[no-untyped-def]  # GET and HEAD
            if urlsplit(self.path).path == "/":  # the root is no page: go to the report
                self.send_response(HTTPStatus.FOUND)
                self.send_header("Location", start)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            # translate_path already drops ".." (and the query); resolve() catches symlinks.
            p = Path(self.translate_path(self.path)).resolve()
            if not any(p == a or a in p.parents for a in allowed):
                self.send_error(HTTPStatus.NOT_FOUND, "File not found")
                return None
            return super().send_head()

    if not 0 <= port <= 65535:
        raise ViewError(f"--serve {port} is not a TCP port; pass one in 1-65535 (0: any free)")
    try:
        srv = ThreadingHTTPServer(("127.0.0.1", port), functools.partial(Handler, directory=root))
    except OSError as e:
        why = {
            errno.EADDRINUSE: "is in use (another server, or an earlier --serve still running)",
            errno.EACCES: "needs privileges (ports below 1024)",
        }.get(e.errno or 0, f"cannot be bound ({e.strerror or e})")
        raise ViewError(
            f"port {port} {why}; the report is written ({index}): serve it on a free port, "
            f"e.g. --serve {port + 1 if port < 65535 else 8000}, or --serve 0 for any free one"
        ) from None
    return srv, f"http://127.0.0.1:{srv.server_address[1]}{start}"


def serve(index: Path, run_dir: Path, port: int) -> None:
    """Serve the report (see :func:`make_server`) until interrupted."""
    srv, url = make_server(index, run_dir, port)
    with srv:
        log.info(f"serving {index.parent} at {url} (Ctrl-C stops)")
        try:
            srv.serve_forever()
        except KeyboardInterrupt:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m paravt.view",
        description=__doc__.split("\n")[0],
        epilog="It writes RUN_DIR/view/index.html (the metrics' panels, alarms, evaluations) and "
        "trajectories.html (each logged episode: overview frames, tool calls, crops, sub-agent "
        "summaries, rewards); open them in a browser, or pass --serve PORT. RUN_DIR: a "
        "python -m paravt.train run folder (train.out_dir) or a python -m paravt.eval --out folder.",
    )
    ap.add_argument("run_dir", help="training run folder (metrics.jsonl) or eval folder")
    ap.add_argument("--out", default="", help="report folder (default RUN_DIR/view)")
    ap.add_argument("--serve", type=int, default=None, metavar="PORT", help="serve it after")
    a = ap.parse_args(argv)
    dst = Path(a.out) if a.out else Path(a.run_dir) / "view"
    try:
        index = write_report(a.run_dir, a.out or None)
        log.info(f"wrote {index} and {index.parent / 'trajectories.html'}")
        if a.serve is not None:
            serve(index, Path(a.run_dir), a.serve)
    except ViewError as e:
        log.error(f"error: {e}")
        return 2
    except OSError as e:
        if e.errno in UNWRITABLE:  # a read-only run folder (a mount, a shared copy) or --out
            code = errno.errorcode.get(e.errno or 0, str(e.errno))
            log.error(
                f"error: {e.filename or dst} cannot be written ({e.strerror}, {code}): the "
                f"report's pages go to {dst}, which is not writable. Fix: pass --out DIR to a "
                "folder you can write (e.g. --out /tmp/view), or make it writable; the run's "
                "own files are untouched"
            )
            return 2
        if e.errno not in DISK_FULL:
            raise
        log.error(
            f"error: {write_failure('report page', e.filename or dst, e, dst)} The run's own "
            "files are untouched, and a page is written whole or not at all. Fix: free space "
            "there, or pass --out DIR on another disk, and rerun"
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
