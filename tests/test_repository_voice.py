"""The repository tells the library's story (versions, commits, dates, machines by their CPU), never
how the project was organised while it was built. The shipped evaluation data is other people's
text and is exempt."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXEMPT = ("viasd_hf/data/",)  # third-party datasets, verbatim
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".ipynb", ".json", ".jsonl", ".cfg", ".yml", ".yaml", ""}
# Words that narrate the making of the project rather than the library itself.
PROCESS_WORDS = re.compile(
    r"\b(?:sessions? \d+|(?:this|last|previous|earlier|next|a later|an earlier) session"
    r"|issues? #?\d+|work\s+periods?|the\s+brief)\b",
    re.IGNORECASE,
)


def tracked_text_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file under the root
        listed = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts]
    return [
        ROOT / name
        for name in listed
        if not name.startswith(EXEMPT) and Path(name).suffix in TEXT_SUFFIXES and (ROOT / name).is_file()
    ]


def narration_in(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    return [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}"
        for number, line in enumerate(text.splitlines(), 1)
        for match in PROCESS_WORDS.finditer(line)
    ]


def test_no_tracked_file_narrates_how_the_project_was_built():
    found = [hit for path in tracked_text_files() for hit in narration_in(path)]
    assert not found, "say what the library does, with versions, commits and dates instead:\n" + "\n".join(found[:40])


def test_the_check_sees_narration(tmp_path):
    # The narration is assembled here so that this file itself does not narrate.
    session, issue = "sess" + "ion 14", "iss" + "ue 28"
    note = tmp_path / "note.md"
    note.write_text(f"Measured in {session}, see {issue}.\nThe KV cache is shared (scope='session').\n", encoding="utf-8")
    hits = [m.group(0) for m in PROCESS_WORDS.finditer(note.read_text(encoding="utf-8"))]
    assert hits == [session, issue]
