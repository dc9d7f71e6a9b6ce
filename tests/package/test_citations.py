"""Every paper location the repository cites exists in that paper, and the known misreadings stay gone.

The four papers (README "Papers"): PipeMorph (NSDI'26, cited by its numbers), Adaptra (its arXiv
version), Falcon, CrossPipe. :data:`PAPERS` is what each one holds — sections, figures, tables,
algorithms with their line counts, equations, appendices — read off the papers' text; where that text
is beside the checkout (``../shared/papers``, README.md there names the files) the catalogue itself is
checked against it.

A citation is a paper's name followed by locations: ``PipeMorph §7.3 / Fig. 19``, ``Falcon §5.3,
Fig. 10/11``, ``CrossPipe §4.2, Alg.1``, ``Adaptra Alg. 2 line 9``, ``Falcon Eq. (3)–(5)``. Each one
found in the docs, docstrings and scripts must name something that paper has. :data:`WRONG` pins
readings that were wrong once: each pattern must not appear in the docs, README, BENCHMARKS.md, the
planner's and runtime's sources or the benchmark scripts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAPERS_DIR = ROOT.parent / "shared" / "papers"


def _sections(*spec: str) -> frozenset[str]:
    """``"4:1-3"`` → 4, 4.1, 4.2, 4.3; ``"4.2:1-5"`` → 4.2, 4.2.1 … 4.2.5; ``"9"`` → 9."""
    out = set()
    for item in spec:
        head, _, sub = item.partition(":")
        out.add(head)
        if sub:
            lo, hi = (int(x) for x in sub.split("-"))
            out.update(f"{head}.{i}" for i in range(lo, hi + 1))
    return frozenset(out)


PAPERS = {
    "PipeMorph": {  # NSDI'26, 003_*.txt
        "file": "003_9629dc099e8da627.txt",
        "sections": _sections("1", "2:1-2", "3:1-3", "4:1-3", "5:1-3", "6", "7:1-5", "8", "9", "10"),
        "figures": 22, "tables": 2, "equations": 4,
        "algorithms": {1: 10, 2: 9, 3: 14, 4: 20},  # algorithm → its last line number
        "appendix": frozenset(),  # unlabelled: "Proof of the Lemma in § 4.1", "Scheduling Algorithm in § 4.3"
        "theorems": 1, "lemmas": 1,
    },
    "Adaptra": {  # arXiv:2504.19232, 000_*.txt
        "file": "000_4314cf6c3805c433.txt",
        "sections": _sections("1", "2:1-2", "3:1-3", "4:1-3", "5:1-3", "6", "7:1-5", "8", "9"),
        "figures": 21, "tables": 3, "equations": 1,
        "algorithms": {1: 12, 2: 11, 3: 16, 4: 22},  # its listings number the Require/Ensure lines too
        "appendix": frozenset(), "theorems": 1, "lemmas": 1,
    },
    "Falcon": {  # arXiv:2410.12588, 001_*.txt
        "file": "001_0a728956831c1b99.txt",
        "sections": _sections("1", "2", "3:1-5", "4:1-3", "5:1-3", "6", "7:1-5", "8", "9:1-2"),
        "figures": 20, "tables": 7, "equations": 10,
        "algorithms": {1: 19},
        "appendix": frozenset({"9.1", "9.2"}), "theorems": 0, "lemmas": 0,
    },
    "CrossPipe": {  # arXiv:2507.00217, 002_*.txt
        "file": "002_3db776a8121c221a.txt",
        "sections": _sections("1", "2:1-4", "3:1-5", "4:1-2", "4.2:1-5", "5:1-2", "6:1-4", "7:1-4", "8:1-2", "9",
                              "10"),
        "figures": 17, "tables": 6, "equations": 0,
        "algorithms": {1: 23},
        "appendix": frozenset({"A", "B", "C", "D", "D.1", "E", "F", "F.1", "F.2"}), "theorems": 0, "lemmas": 0,
    },
}

#: a paper name, optionally possessive, then the first location
NAME = re.compile(r"\b(PipeMorph|Adaptra|Falcon|CrossPipe)(?:'s)?\s+(?=§|Fig|Alg|Eq|Table|Theorem|Lemma|App)")
SEP = re.compile(r"(?:\s*(?:,|/|;|\(|\)|:|–|-|and|or|with|its|the)\s*)*")
NUM = r"(?:\d+(?:\.\d+)*)"
LOC = re.compile(
    rf"(?P<kind>§|Figs?\.?|Figures?|Algs?\.?|Algorithms?|Eqs?\.?|Equations?|Tables?|Theorem|Lemma|App\.|Appendix)"
    rf"\s*\(?(?P<num>{NUM}|[A-F](?:\.\d)?)\)?"
    rf"(?P<more>(?:\s*(?:/|–|-)\s*§?\s*\(?{NUM}\)?)*)"
    rf"(?:\s+lines?\s+(?P<lines>\d+(?:\s*[–-]\s*\d+)?))?")

#: files whose citations are checked for existence (the whole repository's text)
SCANNED = [*ROOT.glob("*.md"), *(ROOT / "docs").rglob("*.md"), *(ROOT / "titan_ext").rglob("*.py"),
           *(ROOT / "titan_ext").rglob("*.c"), *(ROOT / "scripts").glob("*.py"), *(ROOT / "tests").rglob("*.py"),
           *(ROOT / "train_configs").glob("*.toml")]
SCANNED = [p for p in SCANNED if p != Path(__file__).resolve()]  # its own examples of wrong locations

#: files whose wording is pinned by WRONG (the docs and the code documenting the papers' algorithms)
PINNED = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs").rglob("*.md"),
          *(ROOT / "titan_ext" / "plan").rglob("*.py"), *(ROOT / "titan_ext" / "plan").glob("*.c"),
          *(ROOT / "titan_ext" / "runtime").rglob("*.py"), *sorted((ROOT / "scripts").glob("bench_*.py"))]

WRONG = [
    (r"Alg\.? ?1 \(§ ?4\.1\)", "PipeMorph's Alg. 1 (initial planning) is in §4.2; §4.1 is the delay analysis"),
    (r"(?:I and W|I/W|split backward)[^.\n]{0,60}\b§4\.1\b",
     "the backward's split into D (I) and W is CrossPipe §3.1 (and its appendix B), not §4.1"),
    (r"§5/§7 setting", "S=8, N=16 over two DCs is CrossPipe §7.1's M70 setting (n_PP = 8, GBS = 16)"),
    (r"Falcon §2\b[^\n]{0,40}(?:bandwidth|slow link)",
     "Falcon injects its communication fail-slows as bandwidth contention in §7.1"),
    (r"0\.45\s*[×x] the baseline|\(paper 0\.45|the paper: 0\.45",
     "PipeMorph Fig. 19: S3's 3.6x improvement is 1/3.6 = 0.28x the baseline"),
    (r"brings it to 3\.6", "PipeMorph §7.3: S3 gives a 3.6x improvement; it does not bring the slowdown to 3.6x"),
    (r"Fig\.? ?17'?s? compound case|combined scenario \(Falcon Fig\.? ?17\)",
     "the device-then-DP-link run is the reverse of Falcon §7.3's sequence (Fig. 17: link, then GPU, then S4)"),
    (r"[Pp]assed once", "the S4-onto-spares test passed 10 of 10 under two busy loops (commit 3f27ff2)"),
    (r"shared/papers/0\d\d_", "cite a paper by name and its public URL (README \"Papers\"), not a local file"),
    (r"as in the arXiv text \(000_", "name Adaptra (arXiv:2504.19232), not a local file"),
    (r"PipeMorph §6 ②", "PipeMorph §6's ② is the initial schedule's generation, not the profile checks"),
]


def _loc_errors(paper: str, m: re.Match) -> list[str]:
    p = PAPERS[paper]
    kind, num = m["kind"], m["num"]
    more = re.findall(NUM, m["more"] or "")
    nums = [num, *more]
    errs = []
    if kind == "§":
        for n in nums:
            if "." not in n and any(s.startswith(n + ".") for s in p["sections"]) or n in p["sections"]:
                continue
            if n in p["appendix"]:
                continue
            errs.append(f"§{n}")
    elif kind.startswith("Fig"):
        errs += [f"Fig. {n}" for n in nums if not n.isdigit() or not 1 <= int(n) <= p["figures"]]
    elif kind.startswith("Table"):
        errs += [f"Table {n}" for n in nums if not n.isdigit() or not 1 <= int(n) <= p["tables"]]
    elif kind.startswith("Eq"):
        errs += [f"Eq. {n}" for n in nums if not n.isdigit() or not 1 <= int(n) <= p["equations"]]
    elif kind.startswith("Alg"):
        algs = [n for n in nums if n.isdigit()]
        errs += [f"Alg. {n}" for n in algs if int(n) not in p["algorithms"]]
        if m["lines"] and len(algs) == 1 and int(algs[0]) in p["algorithms"]:
            last = max(int(x) for x in re.findall(r"\d+", m["lines"]))
            if last > p["algorithms"][int(algs[0])]:
                errs.append(f"Alg. {algs[0]} line {last}")
    elif kind == "Theorem":
        errs += [] if num.isdigit() and 1 <= int(num) <= p["theorems"] else [f"Theorem {num}"]
    elif kind == "Lemma":
        errs += [] if num.isdigit() and 1 <= int(num) <= p["lemmas"] else [f"Lemma {num}"]
    elif kind.startswith("App"):
        if p["appendix"] and num not in p["appendix"]:
            errs.append(f"appendix {num}")
    return errs


def citations(text: str):
    """(paper, match) for every location that follows a paper's name."""
    for name in NAME.finditer(text):
        pos = name.end()
        while True:
            m = LOC.match(text, pos)
            if not m:
                break
            yield name[1], m
            pos = SEP.match(text, m.end()).end()


def test_the_parser_reads_the_forms_the_docs_use():
    found = [(p, m["kind"], m["num"], re.findall(NUM, m["more"] or ""), m["lines"]) for p, m in citations(
        "PipeMorph §7.3 / Fig. 19; Falcon §5.3, Fig. 10/11; CrossPipe §4.2, Alg.1; Adaptra Alg. 2 line 9; "
        "Falcon Eq. (3)–(5); CrossPipe App. D; Falcon's Alg. 1")]
    assert found == [("PipeMorph", "§", "7.3", [], None), ("PipeMorph", "Fig.", "19", [], None),
                     ("Falcon", "§", "5.3", [], None), ("Falcon", "Fig.", "10", ["11"], None),
                     ("CrossPipe", "§", "4.2", [], None), ("CrossPipe", "Alg.", "1", [], None),
                     ("Adaptra", "Alg.", "2", [], "9"), ("Falcon", "Eq.", "3", ["5"], None),
                     ("CrossPipe", "App.", "D", [], None), ("Falcon", "Alg.", "1", [], None)]
    bad = [(p, _loc_errors(p, m)) for p, m in citations("PipeMorph Fig. 23, Falcon §5.4, CrossPipe Alg. 2, "
                                                         "PipeMorph Alg. 2 line 11, Falcon Table 8")]
    assert [e for _, e in bad] == [["Fig. 23"], ["§5.4"], ["Alg. 2"], ["Alg. 2 line 11"], ["Table 8"]]


@pytest.mark.parametrize("path", sorted(set(SCANNED)), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_cited_paper_location_exists(path):
    text = path.read_text(errors="replace")
    bad = []
    for paper, m in citations(text):
        for err in _loc_errors(paper, m):
            line = text.count("\n", 0, m.start()) + 1
            bad.append(f"{path.relative_to(ROOT)}:{line}: {paper} has no {err} ({m[0]!r})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("pattern,why", WRONG, ids=[w for w, _ in WRONG])
def test_known_misreadings_stay_gone(pattern, why):
    rx = re.compile(pattern)
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}" for p in sorted(set(PINNED))
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if rx.search(line)]
    assert not hits, why + "\n" + "\n".join(hits)


def test_the_papers_are_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for url in ("https://www.usenix.org/conference/nsdi26/presentation/wu-tianyuan",
                "https://arxiv.org/abs/2504.19232", "https://arxiv.org/abs/2410.12588",
                "https://arxiv.org/abs/2507.00217"):
        assert url in readme, url


def test_the_planner_implements_the_alg2_line_that_agrees_with_eq1():
    """Adaptra's Alg. 2 line 9 (⌈(t^F_i + t^B_i + 2c_i) / (t^F_{i+1} + t^B_{i+1})⌉), not NSDI's line 7
    (⌊(t^F_i + t^B_{i+1} + 2c_i) / …⌋): the smallest Δ_i for which Eq. 1 holds (docs/planner.md)."""
    from titan_ext.plan import PipelineProfile
    from titan_ext.plan.warmup import absorbs_delay, adapted_warmup_counts, required_slackness

    profile = PipelineProfile.uniform(4, 16, f_ms=10, b_ms=10, w_ms=10, delays_ms={2: 15})
    assert required_slackness(profile, 2) == 3  # NSDI's floor: ⌊50 / 20⌋ = 2, tolerance 10 ms < 15 ms
    x = adapted_warmup_counts(profile)
    assert absorbs_delay(profile, x, 2)
    slow_b = PipelineProfile(4, 16, (10,) * 4, (30, 10, 10, 10), (10,) * 4).with_delays({0: 5})
    assert required_slackness(slow_b, 0) == 3  # ⌈(10 + 30 + 10) / 20⌉; NSDI's numerator 10 + 10 + 10 → 1


@pytest.mark.skipif(not PAPERS_DIR.is_dir(), reason="the papers' text is not beside this checkout")
@pytest.mark.parametrize("paper", sorted(PAPERS))
def test_the_catalogue_matches_the_papers_text(paper):
    p = PAPERS[paper]
    text = (PAPERS_DIR / p["file"]).read_text(errors="replace")
    heads = set(re.findall(r"^#*\s*(\d+(?:\.\d+)*) [A-Z]", text, re.M))
    missing = sorted(s for s in p["sections"] if s not in heads)
    assert not missing, f"{paper}: sections not in the text: {missing}"
    figures = {int(n) for n in re.findall(r"^\**Figure (\d+):", text, re.M)}
    assert max(figures) == p["figures"] and figures == set(range(1, p["figures"] + 1)), sorted(figures)
    tables = {int(n) for n in re.findall(r"Table (\d+):", text)}
    assert tables == set(range(1, p["tables"] + 1)), sorted(tables)
    algorithms = {int(n) for n in re.findall(r"^Algorithm (\d+) ", text, re.M)}
    assert algorithms == set(p["algorithms"]), sorted(algorithms)
