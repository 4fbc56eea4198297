"""The one pipeline every document in docs/ is made by: run what measures (a recipe, a script, a
test), keep its results with where they came from, render the document from what was kept. Each
scripts/make_*.py says only what is its own: its runs, its data files, its prose.

One data schema, for every committed file under docs/*/data/:

    {"provenance": {"commit": ..., "command": ..., "torch": ..., "date": ...},
     "results": {... what the run produced ...},
     "wall_s": seconds the run took (where it was timed)}

A document's text is its template, scripts/templates/NAME.md, as it reads: `{{name}}` stands for a
figure (or a table, or a sentence judging one) its script computes, and `{{#name}}...{{/name}}` for
a passage shown only where that value is true (fill()).

One command line, every document's:

    python scripts/make_X.py                   # every run, then the document
    python scripts/make_X.py --only PREFIX ... # rerun the runs whose names start so, then render
    python scripts/make_X.py --render-only     # rewrite the document from the committed data
    python scripts/make_X.py --check           # exit 1 if the document is not that rendering

Outside the library (minidist/ never imports it): rendering documents is the repository's
business, not a user's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]


def provenance(command: str, torch_version: str, repo: Path = ROOT, **extra) -> dict:
    """Where a committed result came from: the commit (marked when the code that ran had
    uncommitted changes; docs/ is left out, the document scripts rewrite it as they go), the
    command, torch's version and the date; `extra`: what else a run needs said (the device)."""
    git = lambda *args: subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True).stdout.strip()  # noqa: E731
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs")
    return {"commit": git("rev-parse", "HEAD") + ("+uncommitted changes" if dirty else ""), "command": command,
            "torch": torch_version, "date": time.strftime("%Y-%m-%d"), **extra}


def made_by(provenance: dict, prefix: str = "", *fields: str) -> dict:
    """A data file's command, date and short commit (and `fields` of its provenance, as torch) as
    template values named `prefix`command, `prefix`date, ...: where a document says what measured it."""
    values = {"command": provenance["command"], "date": provenance["date"], "commit": provenance["commit"][:12],
              **{f: provenance[f] for f in fields}}
    return {prefix + k: v for k, v in values.items()}


def mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def record(path: Path, results: dict, provenance: dict, wall_s: float | None = None, sort_keys: bool = False) -> None:
    """Write one data file in the schema above (`sort_keys`: where the results' own order means
    nothing; otherwise it is kept, as tables render rows in it)."""
    data = {"provenance": provenance, "results": results, **({} if wall_s is None else {"wall_s": wall_s})}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=sort_keys) + "\n")


def load(path: Path) -> dict:
    """A data file, checked to be in the schema (a file that is not says which and why)."""
    data = json.loads(Path(path).read_text())
    missing = {"provenance", "results"} - set(data)
    if missing or not {"commit", "command", "torch", "date"} <= set(data["provenance"]):
        raise SystemExit(f"{path}: not a document data file (needs provenance with commit, command, torch, date, "
                         "and results): rerun the script that writes it")
    return data


def results_of(path: Path) -> tuple[dict, dict]:
    """A data file's (results, provenance), checked as load() checks it."""
    data = load(path)
    return data["results"], data["provenance"]


def run_recipe(recipe: str, overrides: list[str], run_dir: Path, result_file: str = "results.json",
               ok_exits: tuple[int, ...] = (0,), label: str | None = None) -> tuple[dict, float]:
    """Run recipes/`recipe` with `overrides` in a fresh `run_dir` (one rank's thread each);
    (what it left in `result_file`, its wall time). A failed run stops the script, with the
    output's tail: nothing is written."""
    label = label or run_dir.name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    print(f"[{label}] python recipes/{recipe} {' '.join(overrides)}", flush=True)
    start = time.time()
    done = subprocess.run([sys.executable, str(ROOT / "recipes" / recipe), *overrides, f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    wall = time.time() - start
    if done.returncode not in ok_exits or not (run_dir / result_file).is_file():
        raise SystemExit(f"[{label}] failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    print(f"[{label}] {wall:.0f} s", flush=True)
    return json.loads((run_dir / result_file).read_text()), wall


TEMPLATES = ROOT / "scripts" / "templates"
_BLOCK = re.compile(r"\{\{#(\w+)\}\}(.*?)\{\{/\1\}\}", re.S)
_FIELD = re.compile(r"\{\{(\w+)\}\}")


def fill(template: str, **values) -> str:
    """scripts/templates/`template` with each {{#name}}...{{/name}} kept where values[name] is true
    and dropped where it is false (inner ones after outer ones), then each {{name}} replaced by
    str(values[name]). A name left without a value, or a value no name asks for, stops the script:
    a document never shows a hole, and no computed figure goes unsaid."""
    text = (TEMPLATES / template).read_text()
    blocks = set(re.findall(r"\{\{#(\w+)\}\}", text))
    unasked = set(values) - blocks - set(_FIELD.findall(text))
    kept, missing = text, set()
    while (found := _BLOCK.search(kept)) and not missing:
        missing = {found.group(1)} - set(values)
        kept = kept[:found.start()] + (found.group(2) if values.get(found.group(1)) else "") + kept[found.end():]
    missing |= set(_FIELD.findall(kept)) - set(values)
    if missing or unasked:
        raise SystemExit(f"scripts/templates/{template}: no value for {sorted(missing)}; "
                         f"values nothing in it asks for: {sorted(unasked)}")
    return _FIELD.sub(lambda m: str(values[m.group(1)]), kept).rstrip() + "\n"


def fill_quotes(text: str, tag: str, quotes: dict[str, str]) -> str:
    """`text` (the README or a hand-written document) with each region <!-- TAG:NAME -->...<!-- /TAG:NAME -->
    it holds filled with quotes[NAME]: the sentences that quote a rendered document's figures, rendered with it."""
    for name, quote in quotes.items():
        start, end = f"<!-- {tag}:{name} -->", f"<!-- /{tag}:{name} -->"
        if start not in text and end not in text:
            continue
        if text.count(start) != 1 or text.count(end) != 1:
            raise SystemExit(f"a text holds {start} ... {end} more than once, or one mark without the other")
        head, rest = text.split(start)
        text = head + start + quote + end + rest.split(end, 1)[1]
    return text


def quoting_texts(tag: str) -> list[Path]:
    """The texts (README.md, docs/*.md) holding a quote region of `tag`: wherever a sentence quoting a
    rendered document's figures stands, it is rendered with them."""
    return [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if f"<!-- {tag}:" in p.read_text()]


@dataclass
class Document:
    """One document: the script that makes it, where it goes, how it renders (from committed data only), the runs that
    measure its data (name -> callable), and the README's quotes of it (a function rewriting
    a text with them, see fill_quotes; applied to every text that quotes it, see quoting_texts)."""

    script: Path                         # the scripts/make_*.py that declares it (its __file__)
    path: Path
    render: Callable[[], str]
    runs: dict[str, Callable[[], None]] = field(default_factory=dict)
    readme_quotes: Callable[[str], str] | None = None
    quote_tag: str = ""

    def rendered(self) -> dict[Path, str]:
        """What the document and the texts quoting it should hold now."""
        out = {self.path: self.render()}
        if self.readme_quotes is not None:
            for text in quoting_texts(self.quote_tag):
                out[text] = self.readme_quotes(text.read_text())
        return out


def shown(path: Path) -> str:
    """`path` as a person in the repository types it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(doc: Document, argv: list[str] | None = None) -> int:
    """The command line above, for `doc`."""
    parser = argparse.ArgumentParser(description=f"Regenerate {shown(doc.path)}")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--render-only", action="store_true",
                      help="rewrite the document from the committed data without running anything")
    what.add_argument("--check", action="store_true",
                      help="exit 1 if the document (or the README's quotes of it) is not the rendering of the data")
    what.add_argument("--only", nargs="*", help="rerun only the runs whose names start with these")
    args = parser.parse_args(argv)
    if args.check:
        stale = [path for path, text in doc.rendered().items() if not path.is_file() or path.read_text() != text]
        for path in stale:
            print(f"{shown(path)} is not the rendering of its data: run python {shown(doc.script)} --render-only")
        return 1 if stale else 0
    if not args.render_only:
        for name, run in doc.runs.items():
            if args.only is None or any(name.startswith(p) for p in args.only):
                run()
    for path, text in doc.rendered().items():
        path.write_text(text)
        print(f"wrote {shown(path)}")
    return 0
