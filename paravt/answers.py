"""Reading answers out of text: the answer block, option letters and time windows.

Parsing only, no scoring: the accuracy reward (``paravt.rewards.accuracy``), the benchmark
metrics (``paravt.eval.scoring``) and the dataset readers (``paravt.data.readers``,
``paravt.eval.benchmarks``: options and ground-truth windows of rows) all read text with
these functions, so a model's answer and a dataset's gold are read the same way.

* :func:`extract_answer` — the content of the *last complete* ``<answer>…</answer>`` block.
* :func:`extract_choice` — the option letter an answer names (a hedge names none);
  :func:`option_text` splits ``"B. red square"``, :func:`options_from_question` reads the
  options a question lists one per line.
* :func:`parse_window` — a time window in seconds (``"12.5-18"``, ``"00:19.7 - 00:25.6"``).
* :func:`normalize_text` — SQuAD-style normalisation (open-ended answers, option texts).
"""

from __future__ import annotations

import math
import re
import string

_OPEN_ANSWER, _CLOSE_ANSWER = "<answer>", "</answer>"


def extract_answer(text: str) -> str | None:
    """Content of the last complete ``<answer>…</answer>`` block (stripped), or None.

    Blocks are read left to right, each from an ``<answer>`` to the next ``</answer>`` (so
    ``<answer>A<answer>B</answer>`` is one block, ``A<answer>B``). Written with ``str.find``
    rather than a lazy regex: ``findall`` rescans to the end from every unclosed ``<answer>``,
    quadratic in the text (seconds on 100 KB of repeated tags); this is one pass.
    """
    last: str | None = None
    pos = 0
    while (i := text.find(_OPEN_ANSWER, pos)) >= 0:
        j = text.find(_CLOSE_ANSWER, i + len(_OPEN_ANSWER))
        if j < 0:
            break
        last = text[i + len(_OPEN_ANSWER) : j]
        pos = j + len(_CLOSE_ANSWER)
    return None if last is None else last.strip()


# ----------------------------------------------------------------------------------- mcq
def _letters(num_options: int) -> str:
    n = num_options if num_options > 0 else 26
    return string.ascii_uppercase[: min(n, 26)]


_OPTION_RE = re.compile(r"^\s*(?:\(([A-Z])\)|([A-Z])[.:)])\s*(\S.*)$")


def option_text(option: str) -> tuple[str | None, str]:
    """Split 'B. red square' / '(B) red square' / 'B) red' / 'B: red' into ('B', 'red square')."""
    m = _OPTION_RE.match(option)
    if m:
        return m.group(1) or m.group(2), m.group(3).strip()
    return None, option.strip()


def options_from_question(question: str) -> list[str]:
    """The options a question lists one per line (``A. foo``, ``(B) bar``, ``C: baz``), or [].

    Only a run of lines lettered A, B, C… in order counts (at least two), so a stray line such
    as "I. Introduction" or options written inline on one line yield no options.
    """
    found = []
    for line in question.splitlines():
        letter, text = option_text(line)
        if letter is None or not text or (not found and letter != "A"):
            continue
        if letter != string.ascii_uppercase[len(found)]:
            break
        found.append(f"{letter}. {text}")
    return found if len(found) >= 2 else []


# A choice letter inside a sentence: upper-case and not glued to a word ("Apple").
_LETTER = r"[\*_]*[\(\[]?(?P<l>[A-Z])(?![A-Za-z])"
# A letter followed by a word is read as the word ("A man walks": the article; "I think": the
# pronoun), and so is every other letter ("C man walks"), so that no letter scores where "A"
# would not. The words listed cannot follow the article or the pronoun, so a letter before
# them stays a letter: "Option A is correct", "Answer: A since…", "A or C" (then a hedge).
_THEN_WORD = re.compile(
    r"\s+(?!(?i:is|seems|looks|fits|matches|appears|since|because|as|or|and|nor|but|vs|versus"
    r"|which)\b)[A-Za-z]"
)
# Explicit answer phrases: "the answer is (B)", "Answer: C", "The answer is: B", "correct
# option is D", "The final answer is **B**".
# Every blank run is followed by a REQUIRED token (never two optional blanks in a row), so a
# long run of spaces after "answer" costs linear time, not cubic (87 s at 2,000 spaces before).
_ANSWER_PHRASE = re.compile(
    r"(?i:\banswer\b\s*(?:(?:is(?:\s*:)?|:|=)\s*)?(?:(?:option|choice)\s*)?"
    r"|\bcorrect\s+(?:option|choice)\b\s*(?:(?:is(?:\s*:)?|:)\s*)?)" + _LETTER
)
_MENTION = re.compile(r"(?i:\b(?:option|choice)\b)\s*(?:(?:is|:)\s*)?" + _LETTER)
_PAREN = re.compile(r"\((?P<l>[A-Za-z])\)")
# A further letter listed right after one: "A or C", "(A)/(C)", "A, option C", "A and C".
_THEN_LETTER = re.compile(
    r"[\*_\)\]]*\s*(?:[,/&]|(?i:\b(?:or|and|nor|vs|versus)\b))\s*(?:(?i:option|choice)\b\s*)?"
    + _LETTER
)
# Other letters that name an option anywhere in an answer: "(C)", "option C", and a lone "C."
# / "C)" item ("A. B. C. D."). Upper-case only: "B. The person(s) leave" and "C. Both (a) and
# (b)" name just their opening letter.
_OTHER_LETTERS = [
    re.compile(r"(?<![A-Za-z])\((?P<l>[A-Z])\)"),
    _MENTION,
    re.compile(r"(?<!\S)[\*_]*[\(\[]?(?P<l>[A-Z])(?:[\)\]]|[.:](?=\s|$))"),
]


def _named(rx: re.Pattern[str], s: str) -> list[re.Match[str]]:
    """The matches of ``rx`` in ``s`` whose letter names a choice (not "A" of "A man")."""
    return [m for m in rx.finditer(s) if not _THEN_WORD.match(s, m.end("l"))]


def _listed(s: str, m: re.Match[str]) -> tuple[set[str], int]:
    """The letter of ``m`` and those listed right after it ("A or C", "A, B and D"), and where
    the list ends."""
    letters, pos = {m.group("l").upper()}, m.end("l")
    while (c := _THEN_LETTER.match(s, pos)) and not _THEN_WORD.match(s, c.end("l")):
        letters.add(c.group("l"))
        pos = c.end("l")
    return letters, pos


def extract_choice(answer: str, options: list[str] | None = None) -> str | None:
    """The option letter an answer names, upper-case, or None.

    Tried in order; the first rule that names a letter decides (a letter outside the options,
    e.g. "E" of four, then gives None rather than falling through to a weaker rule):

    1. the whole answer is a letter: ``"B"``, ``"(b)"``, ``"B."``, ``"**B**"`` (markdown bold);
    2. an explicit phrase, the *last* one wins: ``the answer is (B)``, ``Answer: C``,
       ``correct option is D`` — so "option C is wrong, the answer is D" is D;
    3. a letter opening the answer followed by ``)``, ``.`` or ``:``: ``"b) red"``, ``"B. red"``;
    4. ``option D`` / ``choice D`` mentions, and then 5. parenthesised letters ``(c)``
       anywhere;
    6. the answer equal to one option's text (normalised).

    Hedging names no letter: a letter followed by a list of others (``"the answer is A or C"``,
    ``"(A)/(C)"``, ``"A, C"``); in rules 3–5, another option letter anywhere as ``(C)``,
    ``option C`` or a lone ``C.`` item (``"(A) or option C"``, ``"A. B. C. D."``, ``"B. red,
    not (C)"``); several letters from rule 4 or 5 (``"(A) or (B)"``). A letter elsewhere counts
    only if it is one of the options (a stray capital in prose is no hedge); a listed one always.

    Letters in phrases must be upper-case ("the answer is a red square" names none), and a
    letter followed by a word is read as the word ("A red square appears", "The answer is A man
    walking"): the reference's ``\\b([A-D])\\b`` paid for the article. Every letter is read
    alike, so "Answer: C man walks" names none either, while a word that cannot follow an
    article keeps the letter ("Option A is correct", "Answer: A since…", "the answer is C
    because…"). The honest limit: "The answer is C based on…" also reads as no choice; the
    prompt asks for the letter alone. Letters beyond the number of options are rejected; with no
    options any letter counts (pass ``paravt.rewards.accuracy.sample_options(sample)`` to use the
    options a question lists in its text).
    """
    valid = _letters(len(options or []))
    s = answer.strip()
    if not s:
        return None

    def decide(letters: set[str]) -> str | None:
        if len(letters) != 1:
            return None
        letter = letters.pop()
        return letter if letter in valid else None

    m = re.fullmatch(r"[\*_]*[\(\[]?([A-Za-z])[\)\]]?[.:]?[\*_]*", s)
    if m:
        return decide({m.group(1).upper()})
    phrases = _named(_ANSWER_PHRASE, s)
    if phrases:
        return decide(_listed(s, phrases[-1])[0])
    others = {m.group("l") for rx in _OTHER_LETTERS for m in _named(rx, s)} & set(valid)
    m = re.match(r"^[\(\[]?(?P<l>[A-Za-z])(?:[\)\]]|[.:](?=\s|$))", s)
    if m:
        return decide(_listed(s, m)[0] | others)
    for found in (_named(_MENTION, s), _named(_PAREN, s)):
        named, reach = set(others), -1
        for f in found:
            # A letter inside a list already read adds nothing; skipping it keeps "option A or
            # option A or …" linear (walking each one's list again took 37 s on 100 KB).
            if f.end("l") > reach:
                letters, reach = _listed(s, f)
                named |= letters
        if found:
            return decide(named)
    if options:
        norm = normalize_text(s)
        for i, opt in enumerate(options):
            letter, text = option_text(opt)
            if text and normalize_text(text) == norm:
                return letter or valid[i]
    return None


# ------------------------------------------------------------------------------- open-ended
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = re.compile(rf"[{re.escape(string.punctuation)}]")


def normalize_text(s: str) -> str:
    """SQuAD-style normalisation: lower-case, drop punctuation and articles, collapse spaces."""
    s = _PUNCT.sub(" ", s.lower())
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


# -------------------------------------------------------------------------------- temporal
# A time: seconds ("12.5") or a clock ("1:05", "00:01:05.5"), optionally negative. It may not
# start inside a number or a word ("1e400-2" holds no "400"), so a run of digits offers one start
# and the patterns stay linear in the text (the former pattern took 25 s on 20 KB of digits).
# Nor may it stop inside one ("16.5e3" holds no "16.5"), nor stand before a unit other than
# seconds: "12.5-16.5 minutes" / "… ms" / "…e3" scored IoU 1.0 against a 12.5-16.5 s window.
_T = (
    r"(?<![0-9A-Za-z.])(?<![0-9]:)(-?(?:[0-9]+:){0,2}[0-9]+(?:\.[0-9]+)?)"
    r"(?![.:]?[0-9])"  # the whole number, never a prefix of it
    r"(?!(?!(?:seconds?|secs?|s)(?![A-Za-z]))[A-Za-z])"  # a letter right after: seconds only
    r"(?!\s*(?:[eE][+-]?[0-9]|[x×*]\s*10|\^|%|分|毫秒|小时|帧"
    r"|(?i:m|ms|msecs?|mins?|minutes?|(?:milli|micro|nano)seconds?|[uµμn]s|h|hrs?|hours?"
    r"|frames?|days?)(?![A-Za-z])))"
)
# An optional unit after a time; the blank before the separator only after a unit, so two
# optional blanks never compete for the same spaces (quadratic backtracking otherwise).
_U = r"\s*(?:(?:seconds?|secs?|s)\b\s*)?"
# Linear on blank runs for the same reason as _ANSWER_PHRASE (22 s on 1,000 spaces before).
_CUE = r"\s*(?:time\b\s*)?(?:(?:at|is|of|=|:)\s*)?"
_WINDOW_RES = [
    re.compile(rf"\bfrom\s+{_T}{_U}to\s+{_T}", re.IGNORECASE),
    re.compile(rf"\bbetween\s+{_T}{_U}and\s+{_T}", re.IGNORECASE),
    re.compile(rf"{_T}{_U}(?:-|–|—|~|\bto\b|,)\s*{_T}", re.IGNORECASE),
    re.compile(
        rf"\bstart(?:s|ing)?\b{_CUE}{_T}[^0-9]{{0,40}}?\bend(?:s|ing)?\b{_CUE}{_T}",
        re.IGNORECASE,
    ),
]


def _seconds(t: str) -> float:
    """Seconds of a matched time; NaN for a clock with a field of 60 or more ("1:75")."""
    sign = -1.0 if t.startswith("-") else 1.0
    parts = t.lstrip("-").split(":")
    if any(float(p) >= 60 for p in parts[1:]):
        return math.nan
    value = 0.0
    for p in parts:  # float, not int: 5000 digits overflow to inf instead of raising
        value = value * 60 + float(p)
    return sign * value


def parse_window(text: str) -> tuple[float, float] | None:
    """A time window ``(start, end)`` in seconds, or None.

    Read forms (the one that starts first in the text decides; at the same position, the
    earlier in this list): ``from 12.5 to 18 seconds``; ``between 12.5 and 18``; ``12.5-18``, ``12.5 - 18``, ``[12.5,
    18]``, ``12.5 s to 18 s``, ``12.5~18`` (also "The event happens in the 24.3 - 30.4
    seconds."); ``starts at 5 and ends at 9`` / ``start time: 5, end time: 9``. Each time is
    seconds or a clock, ``MM:SS`` or ``HH:MM:SS`` (fractional seconds allowed): ``00:19.7 -
    00:25.6``, ``1:02:03 - 1:02:10``. None when the deciding window has ``end <= start``
    (reversed or empty windows are not swapped: a reversed answer is a wrong answer), a bound
    that is not finite (400 digits parse to inf), or a clock field of 60 or more. Negative
    times are read as written; their IoU with a window inside the video is accordingly low.

    Times are seconds: a unit may follow only if it is one (``s``, ``sec``, ``seconds``,
    ``秒``). A time followed by another unit (``12.5-16.5 minutes``, ``… ms``, ``… h``,
    ``… frames``, ``… %``, ``…分钟``) or written with an exponent (``16.5e3``) is no time, so
    such a window is skipped (a later window in seconds may still decide) rather than read as
    seconds; the six benchmarks all ask for and grade seconds.
    """
    found = [(m.start(), i, m) for i, rx in enumerate(_WINDOW_RES) if (m := rx.search(text))]
    if not found:
        return None
    m = min(found, key=lambda x: x[:2])[2]
    a, b = _seconds(m.group(1)), _seconds(m.group(2))
    return (a, b) if math.isfinite(a) and math.isfinite(b) and b > a else None
