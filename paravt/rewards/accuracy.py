"""Accuracy reward ``R_acc``: per-question-type scoring of the extracted answer.

Reading answers out of text (the answer block, option letters, time windows) is
``paravt.answers``, shared with the benchmark metrics and the dataset readers. The answer is
the content of the *last complete* ``<answer>…</answer>`` block of the main agent's text
(never "the last line of anything": a trajectory without a closed answer block scores 0).
Scoring by ``Sample.question_type``:

* ``mcq`` — one option letter is extracted (:func:`paravt.answers.extract_choice`) and
  compared with the ground-truth letter. 1 or 0; a hedge ("A or C") or a list ("A. B. C. D.")
  names none. The options are the row's own, else those its question lists one per line
  (:func:`sample_options`); a letter outside them never scores.
* ``oe`` — normalised exact match (lower-case, punctuation and articles dropped, whitespace
  collapsed) *and* multiset token F1 (:func:`token_f1`). ``R_acc`` is the F1: it equals 1
  exactly when the normalised token multisets match (so every exact match scores 1) and gives
  partial credit otherwise, a denser signal for group-relative advantages than 0/1 exact match.
  ``RewardConfig.oe_metric='exact'`` switches to strict 0/1.
* ``tvg`` — temporal IoU of the predicted window (``"12.5-18"``, ``"from 12.5 to 18 seconds"``,
  ``"[12.5, 18]"``, ``"00:19.7 - 00:25.6"``; :func:`paravt.answers.parse_window`) with the
  ground-truth window (``Sample.event_start/end``, else parsed from ``Sample.answer``). A
  non-finite window scores 0; the readers reject such rows at load. Times are seconds: a window
  in another unit (``"12.5-16.5 minutes"``) or with an exponent (``"16.5e3"``) is no answer and
  scores 0.

Shortcuts of the reference implementation that are closed here: ``\\b([A-D])\\b`` matched the
article "A" in "A red square appears"; token F1 over *sets* rewarded "red red red" for "red";
answers came from the last line of any text.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

from paravt.answers import (
    extract_answer,
    extract_choice,
    normalize_text,
    options_from_question,
    parse_window,
)
from paravt.types import Sample


# ----------------------------------------------------------------------------------- mcq
def sample_options(sample: Sample) -> list[str]:
    """The options of an mcq sample: its own ``options``, else those its question lists."""
    return sample.options or options_from_question(sample.question)


def gold_choice(sample: Sample) -> str:
    """The ground-truth letter of an mcq sample: ``Sample.answer`` read as a choice against its
    options (``"B"``, ``"(B)"``, or an option's text), else the answer upper-cased as is (a
    letter outside the options then matches no prediction)."""
    return extract_choice(sample.answer, sample_options(sample)) or sample.answer.strip().upper()


def mcq_accuracy(pred: str, sample: Sample) -> float:
    """1 if ``pred`` names the ground-truth letter, else 0 (options: :func:`sample_options`)."""
    got = extract_choice(pred, sample_options(sample))
    return 1.0 if got is not None and got == gold_choice(sample) else 0.0


# ------------------------------------------------------------------------------- open-ended
def exact_match(pred: str, gold: str) -> float:
    return 1.0 if normalize_text(pred) == normalize_text(gold) else 0.0


def token_f1(pred: str, gold: str) -> float:
    """Multiset token F1 of the normalised texts.

    ``overlap = sum_t min(c_pred[t], c_gold[t])``; ``P = overlap/|pred|``, ``R = overlap/|gold|``,
    ``F1 = 2PR/(P+R)``. Counting multiplicities (not sets) is what stops "red red red" scoring 1
    against "red". Two empty texts score 1; one empty text scores 0.
    """
    p, g = normalize_text(pred).split(), normalize_text(gold).split()
    if not p or not g:
        return 1.0 if p == g else 0.0
    overlap = sum((Counter(p) & Counter(g)).values())
    if overlap == 0:
        return 0.0
    prec, rec = overlap / len(p), overlap / len(g)
    return 2 * prec * rec / (prec + rec)


# -------------------------------------------------------------------------------- temporal
def temporal_iou(pred: tuple[float, float], gold: tuple[float, float]) -> float:
    """``|pred ∩ gold| / |pred ∪ gold|`` of two intervals; 0 for empty intervals and for any
    non-finite bound (NaN compares false, so ``min``/``max`` would otherwise make a NaN ground
    truth score 1.0 against any prediction)."""
    if not all(math.isfinite(x) for x in (*pred, *gold)):
        return 0.0
    inter = max(0.0, min(pred[1], gold[1]) - max(pred[0], gold[0]))
    union = max(pred[1], gold[1]) - min(pred[0], gold[0])
    return inter / union if union > 0 and inter > 0 else 0.0


def gold_window(sample: Sample) -> tuple[float, float]:
    """The ground-truth window of a tvg sample: ``event_start/end``, else parsed from
    ``Sample.answer``; ValueError naming the sample when it has neither."""
    if sample.event_start is not None and sample.event_end is not None:
        return (float(sample.event_start), float(sample.event_end))
    gold = parse_window(sample.answer)
    if gold is None:
        raise ValueError(
            f"sample {sample.id}: tvg question has no ground-truth window (event_start/end unset "
            f"and answer {sample.answer!r} is not 'start-end'); fix the dataset row"
        )
    return gold


def tvg_accuracy(pred: str, sample: Sample) -> float:
    gold = gold_window(sample)
    got = parse_window(pred)
    return temporal_iou(got, gold) if got is not None else 0.0


# -------------------------------------------------------------------------------- dispatch
def accuracy(
    text: str,
    sample: Sample,
    *,
    oe_metric: str = "f1",
    extract: Callable[[str], str | None] = extract_answer,
) -> dict[str, float]:
    """``R_acc`` of a main agent's full text, with its parts.

    Returns ``{'acc': R_acc, 'has_answer': 0|1}`` plus ``'em'``/``'f1'`` for oe and ``'iou'``
    for tvg. ``extract`` reads the answer out of ``text`` (None: no answer): the last complete
    answer block, or the reference's fallbacks (``paravt.rewards.reference.extract_answer``,
    ``reward.answer_extraction=reference``).
    """
    pred = extract(text)
    out: dict[str, float] = {"has_answer": 0.0 if pred is None else 1.0}
    qt = sample.question_type
    if qt == "mcq":
        out["acc"] = 0.0 if pred is None else mcq_accuracy(pred, sample)
    elif qt == "oe":
        em = 0.0 if pred is None else exact_match(pred, sample.answer)
        f1 = 0.0 if pred is None else token_f1(pred, sample.answer)
        out.update(em=em, f1=f1)
        if oe_metric == "f1":
            out["acc"] = f1
        elif oe_metric == "exact":
            out["acc"] = em
        else:
            raise ValueError(f"reward.oe_metric={oe_metric!r} is not one of f1|exact")
    elif qt == "tvg":
        iou = 0.0 if pred is None else tvg_accuracy(pred, sample)
        out.update(iou=iou, acc=iou)
    else:
        raise ValueError(
            f"sample {sample.id}: question_type {qt!r} is not one of mcq|oe|tvg; fix the row"
        )
    return out
