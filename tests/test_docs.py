"""The user documentation: README.md (the front page), docs/ (one page per topic, built by mkdocs)
and configs/ stay short, true to today's code and free of development history.

- the README stays a front page (at most 300 lines; the rest is in docs/);
- no internal issue numbers ("issue 18") in README.md, docs/ or configs/, nor in the package;
- every relative link of README.md, configs/README.md and docs/*.md names a file that exists
  and, for a markdown page, a heading it has;
- ``mkdocs build --strict`` (mkdocs.yml) succeeds: it fails on a page missing from the nav, a
  broken link or a broken anchor inside docs/.

Seconds: no process group, no model.
"""
from __future__ import annotations

import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300
ISSUE_NUMBER = re.compile(r"[Ii]ssue [0-9]")
USER_DOCS = ["README.md", "docs", "configs"]
PACKAGE = ["rlhf_switch", "recipes", "actors"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _files(roots: list[str], suffixes: tuple[str, ...]) -> list[Path]:
    out = []
    for root in roots:
        path = REPO / root
        out += [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in suffixes)
    return out


def _issue_numbers(files: list[Path]) -> list[str]:
    return [f"{p.relative_to(REPO)}:{i}: {line.strip()}"
            for p in files for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if ISSUE_NUMBER.search(line)]


def _prose(text: str) -> list[tuple[int, str]]:
    """The lines of a markdown text outside fenced code blocks, with inline code spans removed."""
    lines, fenced = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((i, re.sub(r"`[^`]*`", "", line)))
    return lines


def _anchors(page: Path) -> set[str]:
    """Every anchor a heading of ``page`` gets, as GitHub (the README's renderer) and as mkdocs
    (the site's: Python-Markdown's toc slugify) write it."""
    anchors, fenced = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "")
        # GitHub: lower case, punctuation dropped (unicode letters kept), every space a hyphen
        anchors.add(re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-"))
        # mkdocs: NFKD to ASCII, punctuation dropped, runs of spaces and hyphens one hyphen
        ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
        anchors.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", ascii_text).strip().lower()))
    return anchors


def _broken_links(page: Path) -> list[str]:
    broken = []
    for i, line in _prose(page.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: — not ours to check
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)}:{i}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where} (no heading with that anchor in {dest.relative_to(REPO)})")
    return broken


def test_the_readme_is_a_front_page_of_at_most_300_lines():
    lines = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"


def test_no_issue_numbers_in_the_user_documentation():
    found = _issue_numbers(_files(USER_DOCS, (".md", ".yaml", ".yml")))
    assert found == [], "internal issue numbers in user documentation:\n" + "\n".join(found)


def test_no_issue_numbers_in_the_package():
    found = _issue_numbers(_files(PACKAGE, (".py",)))
    assert found == [], "internal issue numbers in the package's docstrings and comments:\n" + "\n".join(found)


def test_every_relative_link_of_the_documentation_resolves():
    pages = [REPO / "README.md", REPO / "configs" / "README.md"] + sorted((REPO / "docs").glob("*.md"))
    broken = [b for page in pages for b in _broken_links(page)]
    assert broken == [], "broken links:\n" + "\n".join(broken)


def test_the_link_check_finds_a_broken_link_and_a_broken_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "b.md").write_text("# Has `this` heading, too\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#has-this-heading-too) [gone](c.md) [bad](b.md#nope)\n"
                    "```\n[in code](nowhere.md)\n```\n`[inline](nowhere.md)`\n")
    assert _broken_links(page) == ["a.md:1: c.md (no such file)",
                                   "a.md:1: b.md#nope (no heading with that anchor in b.md)"]


def test_the_documentation_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra (make test installs it)")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"mkdocs build --strict failed:\n{out.stdout}\n{out.stderr}"
    assert (tmp_path / "site" / "index.html").exists()


def test_the_phase_list_is_the_codes():
    """docs/loop.md's "One iteration" list and the loop's docstring name the phases of
    ``recipes.loop.PHASES``, in its order."""
    import re

    from recipes.loop import PHASES
    from recipes.loop import loop as loop_module

    text = (REPO / "docs" / "loop.md").read_text()
    section = text[text.index("## One iteration"):text.index("How the loop is built")]
    assert tuple(re.findall(r"^\d+\. `(\w+)`", section, re.M)) == PHASES
    doc = loop_module.__doc__
    listed = re.findall(r"^    (\w+)\s", doc[doc.index("The phases of one iteration"):doc.index("Between iterations")], re.M)
    assert tuple(listed) == PHASES


def test_the_iteration_records_keys_are_the_documented_ones():
    """docs/loop.md's "An iteration's record" names every key ``IterationRecord.metrics`` writes
    (a record filled as every phase of a synchronous iteration fills it), and nothing it does not
    write under some run mode."""
    import torch

    from recipes.loop.record import IterationRecord
    from rlhf_switch.rl.experience import Experience, SampleExperience
    from rlhf_switch.rl.tasks import Sample

    exp = Experience([SampleExperience([1, 3], Sample("1+1=", "2"), 0, 7)], gen_seconds=0.5)
    s = exp.samples[0]
    s.generated([5, 2], [-0.1, -0.2], 3)
    s.text, s.reward, s.raw_reward, s.finish_reason = "2", 1.0, 1.0, "stop"
    rec = IterationRecord(3, timings={"sync": 0.1}, sync={"seconds": 0.1, "bytes_moved": 10, "bytes_sent": 10},
                          copied={"bytes": 0, "seconds": 0.0}, reloaded={"bytes": 0, "bytes_per_rank": 0, "seconds": 0.0},
                          offloaded={"bytes": 0, "bytes_per_rank": 0, "released_bytes": 0, "seconds": 0.0},
                          peak={p: (lambda: {"bytes": 1, "measure": "rss"}) for p in ("sync", "generate", "train")},
                          stale_tol=1e-4, stale_tol_source="float32",
                          checked=[{"stale_logprob_diff": 1e-6, "logprob_seconds": 0.1, "mismatch": {
                              "dp_rank": 0, "log_ratio": torch.tensor([1e-6, 0.0]), "seq_log_ratio": torch.tensor([1e-6])}}],
                          stats=[{"policy_loss": 0.1, "kl": 0.0, "clipfrac": 0.0, "grad_norm": 1.0, "update_seconds": 0.1,
                                  "steps": 1, "tokens": 2, "dp_rank": 0}])
    written = set(rec.metrics(exp))
    text = (REPO / "docs" / "loop.md").read_text()
    table = text[text.index("### An iteration's record"):text.index("### Logging backends")]
    documented, last = set(), ""
    for key in re.findall(r"`(\w+)`", table):  # `_mean` after `mismatch_logprob_diff_max`: the prefix's
        key = last.rsplit("_", 1)[0] + key if key.startswith("_") else key
        documented.add(key)
        last = key
    assert written <= documented, sorted(written - documented)
    sometimes = {"rule_reward_mean", "model_reward_mean", "vf_loss", "vf_clipfrac", "value_mean", "return_mean",
                 "is_weight_mean", "is_masked_tokens", "samples_interrupted", "dynamic_sampling", "rebalance", "lend",
                 "rollout_replicas_lost", "replica_idle_share", "replica_idle_share_max"}
    assert documented - written == sometimes, sorted(documented - written)
