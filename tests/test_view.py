"""``python -m paravt.view``: a real tiny training run and a real evaluation rendered to HTML and
loaded in a real headless Chromium (Debian's ``chromium``, driven by Playwright for Python;
``make test`` installs the browser when missing).

The training run is ``paravt.train.run`` on the tiny model whose main agents' first turn is
scripted (``tests/scripted_engine.py``): an untrained model never writes a well-formed tool
call, and the viewer's crop bars need some. The scripted turn carries hostile text (a
``<script>`` and an ``<img onerror>`` inside the think span and a bad call's arguments); crops,
sub-agent summaries, the forced answer turn, rewards, the update and the run folder are real.

Set ``PARAVT_VIEWER_SCREENSHOT=docs/viewer.png`` to also save the README's screenshot.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from scripted_engine import ScriptedFirstTurn, own_score

from paravt.config import load_config
from paravt.metrics import read_metrics
from paravt.view import load_report, main, write_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HOSTILE_THINK = "look <script>alert(1)</script> here"
HOSTILE_ARG = "</answer><img src=x onerror=alert(2)>"
WINDOWS = ((5.0, 9.0), (20.0, 26.0))
# Steps 1-2 are scripted (two crops + a bad call each); step 3's first turn is the untrained
# model's (no tool use, no </think>): a collapse, which the alarms (window 1) must report.
STEPS, SCRIPTED, PROMPTS, G = 3, 2, 2, 2


def _scripted_text() -> str:
    calls = [
        {"name": "crop_video", "arguments": {"start_time": s, "end_time": e}} for s, e in WINDOWS
    ]
    calls.append({"name": "crop_video", "arguments": {"start_time": HOSTILE_ARG, "end_time": 3}})
    body = "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
    return f"{HOSTILE_THINK}\n</think>\n{body}"


@pytest.fixture(scope="module")
def run_dir(assets, tmp_path_factory) -> Path:
    """A 3-step ``paravt.train.run`` (2 prompts x G=2, K in {2, 4}, every trajectory logged);
    its stdout is kept in ``out/stdout.txt``."""
    import paravt.train as train

    out = tmp_path_factory.mktemp("view") / "run"
    kv = {
        # Its own task folder (the default task, at these settings): the session's shared
        # assets["data"] is never regenerated under other tests.
        "data.synth_dir": str(out.parent / f"{out.name}-synth"),
        "data.synth_num_videos": 2,
        "model.tiny_dir": assets["model"],
        "train.out_dir": str(out),
        "train.steps": STEPS,
        "train.prompts_per_step": PROMPTS,
        "train.save_every": 0,
        "train.eval_prompts": 0,
        "train.progress": "false",
        "train.log_trajectories": PROMPTS * G,
        "rollout.group_size": G,
        "rollout.max_new_tokens": 6,
        "rollout.sub_max_new_tokens": 6,
        "agent.max_turns": 1,
        "agent.max_tool_response_tokens": 8,
        "video.frame_budgets": "[2,4]",
        "video.crop_max_frames": 4,
        "sft.steps": 0,
        "algo.adv_bias": 0.1,
        "train.alarm_window": 1,
    }
    cfg = load_config(overrides=[f"{k}={v}" for k, v in kv.items()])
    build = train.build_trainer

    def scripted(cfg, ctx, roles=None):
        tr = build(cfg, ctx, roles)
        engine = ScriptedFirstTurn(tr.engine, _scripted_text(), own_score)
        tr.runner.engine = engine
        rollout = tr.runner.rollout

        steps = [0]

        def every_step(*a, **kw):  # main uids repeat across steps: script each step's turn 0
            steps[0] += 1
            engine.seen.clear()
            tr.runner.engine = engine if steps[0] <= SCRIPTED else engine.real
            return rollout(*a, **kw)

        tr.runner.rollout = every_step
        return tr

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "build_trainer", scripted)
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            train.run(cfg)
    (out / "stdout.txt").write_text(log.getvalue())
    return out


# Browser calls are bounded: a page's ``evaluate`` has no timeout in Playwright and, rarely, never
# returns (a renderer that crashes or wedges mid-call; one CI run of this suite sat in this module
# until its 90-minute limit). Every script runs through ``Page.value`` (``wait_for_function``,
# which times out), every other call under the context's default timeout, each browser test under
# a pytest-timeout of BROWSER_TEST_S, and a test that fails with a browser error (never an
# assertion) is run once more on a fresh Chromium.
BROWSER_CALL_MS = 60_000
BROWSER_TEST_S = 240
try:
    from playwright.sync_api import Error as BrowserError
except ImportError:  # the browser fixture skips with its own reason

    class BrowserError(Exception):
        pass


def browser_test(fn):
    """A test that drives Chromium: bounded, and run once more on a browser error."""
    fn = pytest.mark.timeout(BROWSER_TEST_S)(fn)
    return pytest.mark.flaky(reruns=1, only_rerun=[BrowserError, "Timeout .* from pytest-timeout"])(
        fn
    )


@pytest.fixture
def browser():
    """A fresh headless Chromium per test (a rerun never meets a wedged one)."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (make test installs it: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -r requirements.txt")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-dev-shm-usage"],
            timeout=BROWSER_CALL_MS,
        )
        yield b
        b.close()


class Page:
    """A Chromium page (its own context) that records console errors, page errors, failed
    requests and dialogs."""

    def __init__(self, browser, width: int = 1280) -> None:
        ctx = browser.new_context(viewport={"width": width, "height": 900})
        ctx.set_default_timeout(BROWSER_CALL_MS)
        self.page = ctx.new_page()
        self.problems: list[str] = []
        self.dialogs: list[str] = []
        pg = self.page
        pg.on("console", lambda m: m.type == "error" and self.problems.append(f"console: {m.text}"))
        pg.on("pageerror", lambda e: self.problems.append(f"pageerror: {e}"))
        # A load the page's own next navigation cancels (net::ERR_ABORTED: the timing loops
        # reopen the page while its lazy thumbnails are still loading; seen in a full-suite
        # run) is no broken asset: a missing or undecodable file fails otherwise, and
        # images_ok checks every image of the final page.
        pg.on(
            "requestfailed",
            lambda r: (
                r.failure != "net::ERR_ABORTED"
                and self.problems.append(f"failed: {r.url} ({r.failure})")
            ),
        )
        pg.on(
            "response", lambda r: r.status >= 400 and self.problems.append(f"{r.status}: {r.url}")
        )

        def dialog(d):
            self.dialogs.append(d.message)
            d.dismiss()

        pg.on("dialog", dialog)

    def value(self, expr: str):
        """The JSON value of the JavaScript expression ``expr``, or a Playwright TimeoutError
        after BROWSER_CALL_MS (``page.evaluate`` would wait forever on a wedged renderer)."""
        handle = self.page.wait_for_function(f"() => [({expr})]", timeout=BROWSER_CALL_MS)
        return handle.json_value()[0]

    def open(self, path: Path) -> float:
        """Load ``path``; returns the navigation's load time in ms (navigation start to the end
        of the load event: HTML parsed, every image decoded)."""
        self.page.goto(path.as_uri(), wait_until="load")
        return self.value(
            "(n => n.loadEventEnd - n.startTime)(performance.getEntriesByType('navigation')[0])"
        )

    def images_ok(self) -> tuple[int, list[str]]:
        """Scroll through the page (thumbnails load lazily), wait for every image; returns
        their count and the sources of those that did not decode."""
        # One half-screen step per poll (10 ms apart), bounded like every call here.
        self.page.wait_for_function(
            "() => { const y = (window.__scrolled || 0) + innerHeight / 2;"
            " window.__scrolled = y; scrollTo(0, y); return y >= document.body.scrollHeight; }",
            polling=10,
            timeout=BROWSER_CALL_MS,
        )
        self.value("(scrollTo(0, 0), 0)")
        self.page.wait_for_function(
            "() => Array.from(document.images).every(i => i.complete)", timeout=BROWSER_CALL_MS
        )
        res = self.value(
            "Array.from(document.images).map(i => [i.complete && i.naturalWidth > 0, i.src])"
        )
        return len(res), [src for ok, src in res if not ok]


def test_real_run_records_and_alarms(run_dir) -> None:
    """What the pages need, checked without a browser (runs where Chromium is missing)."""
    trajs = read_metrics(run_dir / "trajectories.jsonl")
    assert len(trajs) == STEPS * PROMPTS * G
    # The record carries what the pages need.
    t0 = trajs[0]
    assert t0["duration"] > 26 and len(t0["frame_times"]) == t0["K"] == len(t0["thumbs"])
    calls = t0["turns"][0]["calls"]
    assert [(c["start"], c["end"]) for c in calls if c["status"] == "ok"] == list(WINDOWS)
    assert all(c["response"] for c in calls if c["status"] == "ok")  # sub-agent summaries
    assert [c["status"] for c in calls][-1] != "ok"
    assert all((run_dir / p).is_file() for t in trajs for p in t["thumbs"])
    # The collapse of step 3: printed and logged as alarm rows.
    alarms = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "alarm"]
    assert {(a["step"], a["metric"]) for a in alarms} >= {
        (SCRIPTED + 1, "tool_call_rate"),
        (SCRIPTED + 1, "think_closure_rate"),
    }
    printed = (run_dir / "stdout.txt").read_text()
    assert all(f"[alarm] step {a['step']}: {a['message']}" in printed for a in alarms)


@browser_test
def test_real_run_report_in_chromium(run_dir, browser, tmp_path) -> None:
    trajs = read_metrics(run_dir / "trajectories.jsonl")
    out = tmp_path / "report"
    assert main([str(run_dir), "--out", str(out)]) == 0
    pg = Page(browser)

    # Run page: curves, config, alarms section.
    pg.open(out / "index.html")
    titles = pg.value("Array.from(document.querySelectorAll('svg.curve'), e => e.ariaLabel)")
    for want in ("reward", "</think> closure", "tool-call rate", "tool-call rate per K",
                 "parse-error rate", "accuracy", "KL to reference", "entropy"):  # fmt: skip
        assert want in titles
    per_k = pg.value(
        "Array.from(document.querySelectorAll("
        "'svg.curve[aria-label=\"tool-call rate per K\"] polyline title'), e => e.textContent)"
    )
    assert set(per_k) == {f"tool_rate/K{t['K']}" for t in trajs}
    assert f"log_trajectories: {PROMPTS * G}" in pg.page.inner_text("pre")

    # The collapse of step 3 (test_real_run_records_and_alarms), shown with a mark on its curve.
    alarms = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "alarm"]
    shown_alarms = pg.value("Array.from(document.querySelectorAll('.alarm'), e => e.textContent)")
    assert shown_alarms == [f"step {a['step']}: {a['message']}" for a in alarms]
    box = pg.page.query_selector('svg.curve[aria-label="tool-call rate"] rect').bounding_box()
    mark = pg.page.query_selector('svg.curve[aria-label="tool-call rate"] .alarm-mark')
    assert mark.bounding_box()["x"] == pytest.approx(box["x"] + box["width"], abs=1.5)  # step 3
    pg.page.screenshot(path=str(tmp_path / "index.png"), full_page=True)

    # Trajectory page.
    pg.open(out / "trajectories.html")
    p = pg.page
    sections = p.query_selector_all("section.traj")
    assert len(sections) == len(trajs)
    text = p.inner_text("body")
    for t in trajs:
        assert t["uid"] in text
    n_img, broken = pg.images_ok()
    assert n_img == sum(len(t["thumbs"]) for t in trajs) and not broken

    # Each crop bar sits at its window on the axis' pixel scale, and frames at their times.
    n_bars = 0
    for sec, t in zip(sections, trajs):
        dur = float(sec.query_selector(".timeline").get_attribute("data-duration"))
        assert dur == pytest.approx(t["duration"])
        ax = sec.query_selector(".axis").bounding_box()
        ok = [c for turn in t["turns"] for c in turn["calls"] if c["status"] == "ok"]
        bars = sec.query_selector_all(".crop")
        assert len(bars) == len(ok) == (len(WINDOWS) if t["step"] <= SCRIPTED else 0)
        for bar, c in zip(bars, ok):
            bb = bar.bounding_box()
            x0 = ax["x"] + c["start"] / dur * ax["width"]
            x1 = ax["x"] + c["end"] / dur * ax["width"]
            assert bb["x"] == pytest.approx(x0, abs=1.0) and bb["x"] + bb["width"] == pytest.approx(
                x1, abs=1.0
            )
            n_bars += 1
        for fr, ts in zip(sec.query_selector_all(".fr"), t["frame_times"]):
            fb = fr.bounding_box()
            assert fb["x"] + fb["width"] / 2 == pytest.approx(
                ax["x"] + ts / dur * ax["width"], abs=1.0
            )
        summaries = [x.text_content() for x in sec.query_selector_all(".summary")]
        assert summaries == [c["response"] for c in ok]
        bad = [c for u in t["turns"] for c in u["calls"] if c["status"] != "ok"]
        assert len(sec.query_selector_all(".perr")) == len(bad)  # failed calls are shown
        assert len(bad) == (t["step"] <= SCRIPTED)
    assert n_bars == SCRIPTED * PROMPTS * G * len(WINDOWS)

    # Hostile text stays text: no injected element, no dialog, the characters are visible.
    assert pg.value("document.scripts.length") == 1  # the page's own filter script
    assert p.query_selector_all('img[src="x"]') == [] and not pg.dialogs
    assert "<script>alert(1)</script>" in text and "<img src=x onerror=alert(2)>" in text
    assert p.query_selector_all(".think.tag")  # spans highlighted
    assert p.query_selector_all(".call") and p.query_selector_all(".answer")

    # Filters.
    def shown() -> int:
        return int(p.inner_text("#shown"))

    assert shown() == len(trajs)
    p.check("#f-perr")
    assert shown() == sum(any(c["status"] != "ok" for u in t["turns"] for c in u["calls"])
                          for t in trajs)  # fmt: skip
    p.uncheck("#f-perr")
    p.check("#f-notool")
    assert shown() == sum(not any(c["status"] == "ok" for u in t["turns"] for c in u["calls"])
                          for t in trajs) == PROMPTS * G  # fmt: skip
    p.uncheck("#f-notool")
    p.check("#f-wrong")
    assert shown() == sum(t["breakdown"]["acc"] < 1 for t in trajs)
    p.uncheck("#f-wrong")
    k = min(t["K"] for t in trajs)
    p.select_option("#f-k", str(k))
    assert shown() == sum(t["K"] == k for t in trajs)
    assert len(p.query_selector_all("section.traj:not(.hidden)")) == shown()
    p.select_option("#f-k", "")

    p.screenshot(path=str(tmp_path / "trajectories.png"), full_page=False)
    if os.environ.get("PARAVT_VIEWER_SCREENSHOT"):
        dst = Path(os.environ["PARAVT_VIEWER_SCREENSHOT"])
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / "trajectories.png", dst)
        shutil.copyfile(tmp_path / "index.png", dst.with_name(dst.stem + "_run.png"))
    assert not pg.problems, pg.problems


def _hundred(run_dir: Path, data: str, dst: Path, n: int = 100, k: int = 32) -> Path:
    """A run folder with ``n`` logged trajectories: the real run's records, each given ``k``
    overview thumbnails decoded from its real video at 448 px (the 8B preset's overview
    size) and written by the trainer's ThumbnailStore (96 px JPEGs), 4 trajectories a group."""
    from paravt.agent.loop import _times
    from paravt.metrics import ThumbnailStore
    from paravt.types import FrameRequest
    from paravt.video import DecodePlanner, overview_timestamps, probe

    shutil.copytree(run_dir, dst, ignore=shutil.ignore_patterns("checkpoints", "tb", "view"))
    src = read_metrics(run_dir / "trajectories.jsonl")
    vids = sorted((Path(data) / "videos").glob("*.mp4"))
    assert vids
    store = ThumbnailStore(dst, max_bytes=20_000_000)
    planner = DecodePlanner("pyav")
    rows = []
    for i in range(n):
        r = dict(src[i % len(src)], step=i // 4 + 1, uid=f"{i // 4}:{src[i % len(src)]['uid']}")
        v = vids[(i // 4) % len(vids)]
        meta = probe(str(v))
        ts = overview_timestamps(meta, k)
        if i % 4 == 0:
            fb = planner.run([FrameRequest(str(v), tuple(ts), (448, 448))])[0]
            thumbs = store.save(f"g{i // 4}_K{k}", fb.frames)
            times = _times(fb)
        r.update(K=k, duration=meta.duration, frame_times=times, thumbs=thumbs)
        rows.append(r)
    (dst / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dst


@browser_test
def test_hundred_trajectories_open_fast_and_stay_small(run_dir, assets, browser, tmp_path):
    big = _hundred(run_dir, assets["data"], tmp_path / "big")
    index = write_report(big)
    size = sum(f.stat().st_size for d in ("view", "thumbs") for f in (big / d).rglob("*"))
    assert size < 20e6, f"report assets {size / 1e6:.1f} MB"
    pg = Page(browser)
    times = [pg.open(index.parent / "trajectories.html") for _ in range(3)]
    t0 = time.perf_counter()
    n_img, broken = pg.images_ok()
    scroll_s = time.perf_counter() - t0
    assert len(pg.page.query_selector_all("section.traj")) == 100
    assert n_img == 100 * 32 and not broken and not pg.problems
    print(f"\n100 trajectories x 32 thumbnails: load {min(times):.0f} ms (best of 3: "
          f"{', '.join(f'{t:.0f}' for t in times)}), report {size / 1e6:.2f} MB, scrolling "
          f"through every thumbnail {scroll_s:.1f} s")  # fmt: skip
    assert min(times) < 2000, times


def test_viewer_assets_at_the_cap_stay_under_20_mb(run_dir, tmp_path) -> None:
    """A run whose thumbnail store is full at the default ``train.viewer_max_mb``: the report
    written into the run folder links ``thumbs/`` (no second copy), so thumbnails + pages stay
    under 20 MB; a report written elsewhere copies exactly the referenced files."""
    import torch

    from paravt.config import load_config
    from paravt.metrics import ThumbnailStore

    dst = tmp_path / "full"
    shutil.copytree(run_dir, dst, ignore=shutil.ignore_patterns("checkpoints", "tb", "view"))
    store = ThumbnailStore(dst, max_bytes=int(load_config().train.viewer_max_mb * 1e6))
    g = torch.Generator().manual_seed(0)
    src = read_metrics(run_dir / "trajectories.jsonl")
    rows, i = [], 0
    while not store.full:  # noise JPEGs: the worst case per frame
        frames = torch.randint(0, 256, (32, 96, 96, 3), dtype=torch.uint8, generator=g)
        rows.append(dict(src[i % len(src)], uid=f"u{i}", thumbs=store.save(f"g{i}", frames)))
        i += 1
    (dst / "trajectories.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert store.used > 0.95 * store.max_bytes and rows[-1]["thumbs"] is None
    index = write_report(dst)
    html = (index.parent / "trajectories.html").read_text()
    assert 'src="../thumbs/' in html and not (index.parent / "thumbs").exists()
    size = sum(f.stat().st_size for d in ("view", "thumbs") for f in (dst / d).rglob("*"))
    assert size < 20e6, f"viewer assets {size / 1e6:.1f} MB"
    # --out elsewhere: a self-contained copy of the referenced thumbnails.
    other = write_report(dst, tmp_path / "elsewhere")
    copied = list((other.parent / "thumbs").iterdir())
    assert len(copied) == sum(len(r["thumbs"] or []) for r in rows)


@browser_test
def test_eval_folder_renders(assets, browser, tmp_path) -> None:
    """A real ``paravt.eval`` folder (oracle main agent: real crops and sub-agents)."""
    from paravt.agent import AgentRunner
    from paravt.engines.hf import HFEngine
    from paravt.engines.oracle import OracleMainEngine, load_oracle
    from paravt.eval.benchmarks import load_benchmark
    from paravt.eval.runner import EvalSettings, run_eval
    from paravt.models import load_model

    task = tmp_path / "task"
    task.mkdir()
    (task / "videos").symlink_to(Path(assets["data"]) / "videos")
    shutil.copy(Path(assets["data"]) / "sft.jsonl", task / "sft.jsonl")
    shutil.copy(Path(assets["data"]) / "train.jsonl", task / "val.jsonl")
    cfg = load_config(
        "tiny_cpu", overrides=["rollout.sub_max_new_tokens=6", "video.crop_max_frames=4"]
    )
    samples = load_benchmark("synth", task, limit=3)
    tiny = load_model(assets["model"], device="cpu")
    engine = OracleMainEngine(
        HFEngine(tiny, seed=0), tiny.tokenizer, load_oracle(task), cfg.agent.think_prefix
    )
    settings = EvalSettings(
        benchmark="synth", data_root=str(task), model="tiny", engine="hf", frames=4,
        crop_mode="subagent", temperature=0.0, top_p=1.0, sub_temperature=0.0, max_turns=3,
        max_parallel=5, max_new_tokens=cfg.rollout.max_new_tokens,
    )  # fmt: skip
    ev = tmp_path / "eval"
    run_eval(samples, AgentRunner(engine, tiny, cfg), ev, settings, show_progress=False)
    rows = read_metrics(ev / "results.jsonl")
    index = write_report(ev)
    assert index == ev / "view" / "index.html"
    pg = Page(browser)
    pg.open(index)
    assert '"n": 3' in pg.page.inner_text("pre")
    pg.open(index.parent / "trajectories.html")
    secs = pg.page.query_selector_all("section.traj")
    assert len(secs) == len(rows) == 3
    for sec, r in zip(secs, rows):
        assert r["question"] and r["question"].splitlines()[0] in sec.inner_text()
        ok = [c for t in r["trace"] for c in t["calls"] if c["status"] == "ok"]
        bars = sec.query_selector_all(".crop")
        assert len(bars) == len(ok) >= 1
        ax = sec.query_selector(".axis").bounding_box()
        for bar, c in zip(bars, ok):
            x0 = ax["x"] + c["start"] / r["duration"] * ax["width"]
            assert bar.bounding_box()["x"] == pytest.approx(x0, abs=1.0)
    assert not pg.problems, pg.problems


def test_bad_folder_says_what_is_missing(tmp_path, capsys) -> None:
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "neither metrics.jsonl" in err and "results.jsonl" in err and "make train" in err
    assert main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_thumbnail_store_cap(tmp_path) -> None:
    import torch

    from paravt.metrics import ThumbnailStore

    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (4, 64, 80, 3), dtype=torch.uint8, generator=g)
    store = ThumbnailStore(tmp_path, max_bytes=30_000, max_px=48)
    first = store.save("a", frames)
    assert len(first) == 4 and all(n.startswith("thumbs/a-") for n in first)
    assert store.save("a/b", frames[:1]) != store.save("a_b", frames[:1])  # never shared
    from PIL import Image

    assert max(Image.open(tmp_path / first[0]).size) == 48
    assert store.save("a", frames) == first  # shared, not rewritten
    saved = [store.save(f"s{i}", frames) for i in range(60)]
    used = sum(f.stat().st_size for f in (tmp_path / "thumbs").iterdir())
    assert None in saved and used == store.used <= 30_000
    # A resumed run counts what is there.
    assert ThumbnailStore(tmp_path, max_bytes=30_000).used == used


def test_highlight_spans_and_escaping() -> None:
    from paravt.view import highlight

    got = highlight("<think>\n", "a<b & </think><answer>x</answer></think>tail<tool_call>{")
    assert got == (
        '<span class="think tag forced">&lt;think&gt;</span>'
        '<span class="think forced">\n</span>'
        '<span class="think">a&lt;b &amp; </span>'
        '<span class="think tag">&lt;/think&gt;</span>'
        '<span class="answer tag">&lt;answer&gt;</span>'
        '<span class="answer">x</span>'
        '<span class="answer tag">&lt;/answer&gt;</span>'
        '<span class="tag">&lt;/think&gt;</span>'  # a stray closer closes nothing
        "tail"
        '<span class="call tag">&lt;tool_call&gt;</span>'
        '<span class="call">{</span>'  # unclosed: runs to the end
    )


def test_records_are_coerced_and_judged_by_task(tmp_path) -> None:
    """Numbers from a record go into the page only as numbers (a string reward cannot carry
    markup); grounding is right at IoU >= 0.5, not at 1; a row holding U+2028 survives."""
    from paravt.view import load_report, render_trajectory

    row = {"uid": "x", "step": 1, "K": 4, "question": "when\u2028?", "task": "tvg",
           "breakdown": {"acc": 0.6}, "reward": '<img src=x onerror="alert(1)">',
           "duration": "9<b>", "frame_times": [1.0, "<i>"],
           "turns": [{"text": "t", "calls": [{"status": "ok", "start": "1'><b>", "end": 3.0}]}]}  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "kind": "train"}) + "\n")
    (tmp_path / "trajectories.jsonl").write_text(
        json.dumps(row, ensure_ascii=False)
        + "\n"
        + json.dumps(dict(row, uid="y", task="mcq"))
        + "\n"
    )
    rep = load_report(tmp_path)
    tvg, mcq = rep.trajectories
    assert tvg.question == "when\u2028?" and tvg.correct and not mcq.correct
    assert tvg.reward is None and tvg.duration is None and tvg.frame_times == [1.0]
    assert tvg.calls[0].start is None
    page = render_trajectory(0, tvg, {})
    assert "onerror" not in page and "9<b>" not in page and "'><b>" not in page


def test_each_call_is_labelled_by_its_tool(tmp_path) -> None:
    """The page's HTML, without a browser: each executed call's bar and summary carry the tool
    it names (a plug-in's bar its own colour, a one-instant window still visible), a failed call
    names its tool (escaped: an unknown tool's name is model text), a record written before
    calls named their tool reads as "call"; the per-tool call counts get their curve panel."""
    from paravt.view import PALETTE, load_report, render_trajectory

    calls = [
        {"tool": "crop_video", "status": "ok", "start": 2.0, "end": 6.0, "response": "a clip"},
        {"tool": "zoom_frame", "status": "ok", "start": 9.0, "end": 9.0, "response": "a region"},
        {"tool": "<img src=x onerror=alert(1)>", "status": "unknown_tool", "error": "no such"},
        {"status": "ok", "start": 1.0, "end": 2.0, "response": "older"},  # no "tool" key
    ]
    row = {"uid": "u", "step": 1, "K": 4, "question": "q", "answer": "A", "duration": 10.0,
           "turns": [{"text": "t", "calls": calls}], "breakdown": {"acc": 1.0}}  # fmt: skip
    metrics = [
        {"step": s, "kind": "train", "tool_calls/crop_video": 1.0, "tool_calls/zoom_frame": z}
        for s, z in ((1, 0.5), (2, 1.0))
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (tmp_path / "trajectories.jsonl").write_text(json.dumps(row) + "\n")
    rep = load_report(tmp_path)
    (t,) = rep.trajectories
    assert [c.tool for c in t.calls] == ["crop_video", "zoom_frame", calls[2]["tool"], ""]
    page = render_trajectory(0, t, {})
    bars = re.findall(r'<div class="crop" data-tool="([^"]*)"[^>]*style="([^"]*)"', page)
    assert [b[0] for b in bars] == ["crop_video", "zoom_frame", "call"]
    assert "background" not in bars[0][1] and "background" not in bars[2][1]  # the default blue
    colour = re.search(r"background:(#[0-9a-f]{6})", bars[1][1]).group(1)
    assert colour in PALETTE[1:] and "width:0.0000%" in bars[1][1]  # min-width: 2px shows it
    assert ">crop_video 1</span>" in page and ">zoom_frame 2</span>" in page
    assert ">call 3</span>" in page
    items = re.findall(r"<li><span class='tname'>([^<]*)</span> \[([\d., ]+)\] s:", page)
    assert items == [("crop_video", "2.0, 6.0"), ("zoom_frame", "9.0, 9.0"), ("call", "1.0, 2.0")]
    assert "call failed (&lt;img src=x onerror=alert(1)&gt;): unknown_tool: no such" in page
    assert "<img src=x" not in page
    index = write_report(tmp_path).read_text()
    panel = index[index.index('aria-label="tool calls / rollout per tool"') :]
    panel = panel[: panel.index("</svg>")]
    assert "tool_calls/crop_video" in panel and "tool_calls/zoom_frame" in panel


def _tiny_train_folder(d: Path, rows: list[dict]) -> Path:
    """A hand-made training run folder: ``rows`` as metrics.jsonl, one trajectory whose two
    overview frames have thumbnails under ``thumbs/``."""
    from PIL import Image

    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "thumbs").mkdir(exist_ok=True)
    for i in range(2):
        Image.new("RGB", (16, 12), (40 * i, 90, 200)).save(d / "thumbs" / f"u-{i}.jpg")
    traj = {"uid": "u", "step": 1, "K": 2, "question": "q", "answer": "A", "duration": 10.0,
            "frame_times": [2.0, 7.0], "thumbs": ["thumbs/u-0.jpg", "thumbs/u-1.jpg"],
            "turns": [{"text": "<answer>A</answer>", "calls": []}], "breakdown": {"acc": 1.0}}  # fmt: skip
    (d / "trajectories.jsonl").write_text(json.dumps(traj) + "\n")
    (d / "config.yaml").write_text("secret: run config\n")
    return d


def test_eval_table_step_is_escaped(tmp_path) -> None:
    """The ``step`` of an evaluation row is hostile text like any other string of a run."""
    rows = [
        {"step": 1, "kind": "train", "tool_call_rate": 0.5},
        {"step": "<script>alert(3)</script>", "kind": "eval_after", "accuracy": 0.5},
    ]
    index = write_report(_tiny_train_folder(tmp_path / "run", rows)).read_text()
    assert "<script>alert(3)" not in index
    assert "<td>&lt;script&gt;alert(3)&lt;/script&gt;</td>" in index


def test_alarm_with_a_nan_or_missing_step_renders(tmp_path) -> None:
    rows = [
        {"step": 1, "kind": "train", "tool_call_rate": 0.5},
        {"step": 2, "kind": "train", "tool_call_rate": float("nan")},
        {"step": float("nan"), "kind": "alarm", "metric": "tool_call_rate", "message": "fell"},
        {"kind": "alarm", "metric": "tool_call_rate", "message": "fell again"},
        {"step": 2, "kind": "alarm", "metric": "tool_call_rate", "message": "at two"},
    ]
    index = write_report(_tiny_train_folder(tmp_path / "run", rows)).read_text()
    assert "step ?: fell</div>" in index and "step ?: fell again</div>" in index
    assert "step 2: at two</div>" in index
    assert index.count("alarm at step") == 1  # only the alarm with a step is marked
    svg = index[index.index("<svg") : index.rindex("</svg>")]
    assert "nan" not in svg.lower()  # the NaN rate is left out of the curve, not drawn


def test_a_last_line_torn_inside_a_utf8_character_renders(tmp_path) -> None:
    """A run killed mid-write can leave ``metrics.jsonl`` / ``trajectories.jsonl`` (and an
    evaluation's ``results.jsonl``) ending inside a multi-byte character: the viewer drops
    that torn line, as it drops a torn ASCII one, and renders the rest."""

    def cut(row: dict) -> bytes:
        raw = json.dumps(row, ensure_ascii=False).encode()
        return raw[: raw.index("é".encode()) + 1]  # the first byte of a 2-byte character

    rows = [{"step": 1, "kind": "train", "tool_call_rate": 0.5}]
    run = _tiny_train_folder(tmp_path / "run", rows)
    for name in ("metrics.jsonl", "trajectories.jsonl"):
        with open(run / name, "ab") as f:
            f.write(cut({"step": 2, "kind": "train", "note": "été"}))
    assert main([str(run), "--out", str(tmp_path / "view")]) == 0
    rep = load_report(run)
    assert [r["step"] for r in rep.metrics] == [1] and len(rep.trajectories) == 1

    ev = tmp_path / "eval"
    ev.mkdir()
    row = {"id": "a", "question": "durée ?", "answer": "A", "prediction": "A", "score": 1.0}
    (ev / "results.jsonl").write_bytes(
        (json.dumps(row, ensure_ascii=False) + "\n").encode() + cut(dict(row, id="été"))
    )
    assert main([str(ev), "--out", str(tmp_path / "view-eval")]) == 0
    assert [t.question for t in load_report(ev).trajectories] == ["durée ?"]


def test_serve_on_a_busy_port_is_a_one_line_error(tmp_path, capsys) -> None:
    import socket

    run = _tiny_train_folder(tmp_path / "run", [{"step": 1, "kind": "train"}])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main([str(run), "--serve", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"port {port} is in use" in err and f"--serve {port + 1}" in err


def test_serve_of_a_training_run_resolves_its_thumbnails(tmp_path) -> None:
    """``--serve`` of a report inside the run folder serves the run folder, so the pages'
    ``../thumbs/`` links resolve; nothing else of the run (or above it) is served."""
    import http.client
    import re
    import subprocess
    import sys
    from urllib.parse import urljoin, urlparse
    from urllib.request import urlopen

    run = _tiny_train_folder(tmp_path / "run", [{"step": 1, "kind": "train"}])
    (tmp_path / "outside.txt").write_text("not the run's")
    cmd = [sys.executable, "-m", "paravt.view", str(run), "--serve", "0"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = ""
        deadline = time.time() + 60
        while not url and time.time() < deadline:
            line = p.stdout.readline()
            assert line or p.poll() is None, p.stderr.read()
            m = re.search(r"http://127\.0\.0\.1:\d+/\S*", line)
            url = m.group(0) if m else ""
        assert url, "the server never said where it listens"
        page_url = urljoin(url, "trajectories.html")
        page = urlopen(page_url, timeout=10).read().decode()
        srcs = re.findall(r'<img loading="lazy" src="([^"]+)"', page)
        assert len(srcs) == 2 and all(s.startswith("../thumbs/") for s in srcs)
        for s in srcs:
            got = urlopen(urljoin(page_url, s), timeout=10).read()
            assert got == (run / "thumbs" / s.rsplit("/", 1)[1]).read_bytes()
        host = urlparse(url)
        for path in ("/../outside.txt", "/%2e%2e/outside.txt", "/config.yaml",
                     "/metrics.jsonl", "/view/../config.yaml", "/thumbs/../config.yaml"):  # fmt: skip
            c = http.client.HTTPConnection(host.hostname, host.port, timeout=10)
            c.request("GET", path)
            r = c.getresponse()
            body = r.read()
            assert r.status == 404 and b"run config" not in body, (path, r.status)
            assert b"not the run's" not in body
            c.close()
    finally:
        p.terminate()
        p.wait(timeout=10)


def test_planted_symlinks_are_replaced_never_written_through(tmp_path, capsys) -> None:
    """A run folder is not the viewer's: a symlink planted at ``view/index.html`` (or at a
    page's temporary, or at a copied thumbnail) must not make ``python -m paravt.view`` (run as
    root) write the file it points to; the default ``view/`` folder being a link is refused."""
    run = _tiny_train_folder(tmp_path / "run", [{"step": 1, "kind": "train"}])
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (run / "view").mkdir()
    for name in ("index.html", "trajectories.html", ".index.html.tmp"):
        (run / "view" / name).symlink_to(victim)
    assert main([str(run)]) == 0
    assert victim.read_text() == "precious\n"
    assert "<h1>train run: " in (run / "view" / "index.html").read_text()
    assert not (run / "view" / "index.html").is_symlink()
    assert [p.name for p in (run / "view").iterdir() if p.name.endswith(".tmp")] == [
        ".index.html.tmp"  # the planted link is left alone; no temporary of ours remains
    ]
    # A copied report: its thumbnails are written the same way.
    out = tmp_path / "report"
    (out / "thumbs").mkdir(parents=True)
    (out / "thumbs" / "thumbs_u-0.jpg").symlink_to(victim)
    assert main([str(run), "--out", str(out)]) == 0
    assert victim.read_text() == "precious\n"
    assert (out / "thumbs" / "thumbs_u-0.jpg").read_bytes()[:2] == b"\xff\xd8"  # a JPEG
    # The default view/ as a link to another folder: refused, nothing written there.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(run / "view")
    (run / "view").symlink_to(elsewhere)
    capsys.readouterr()
    assert main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{run / 'view'} is a symbolic link" in err
    assert "--out" in err and list(elsewhere.iterdir()) == []


def test_a_fifo_in_a_record_s_place_is_named_never_read(tmp_path, capsys) -> None:
    """A FIFO is no file: reading one waits for a writer forever. The viewer names a FIFO
    metrics.jsonl (exit 2, one line) and renders a run whose config.yaml or trajectories.jsonl
    is one without them; every read runs in a thread that must finish."""
    import threading

    def view(*argv: str) -> int:
        res: list[int] = []
        t = threading.Thread(target=lambda: res.append(main(list(argv))), daemon=True)
        t.start()
        t.join(20)
        assert res, f"python -m paravt.view {' '.join(argv)} hangs"
        return res[0]

    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "metrics.jsonl")
    assert view(str(run)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{run / 'metrics.jsonl'} is a FIFO (named pipe), not a regular file" in err
    (run / "metrics.jsonl").unlink()
    _tiny_train_folder(run, [{"step": 1, "kind": "train", "tool_call_rate": 0.5}])
    for name in ("config.yaml", "trajectories.jsonl"):
        (run / name).unlink()
        os.mkfifo(run / name)
    assert view(str(run)) == 0
    index = (run / "view" / "index.html").read_text()
    assert "(no config.yaml in the run folder)" in index and "0 trajectories" in index
