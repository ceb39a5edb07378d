"""The README stays a user's reference: at most 250 lines, dated figures only in its results
section (one table per device family; everything else dated lives in ``benchmarks/results/``,
the rest of the documentation in ``docs/``), its configuration table the one
``mla_backend.config`` generates, and every relative link resolving."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text().splitlines()
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def _sections() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {"": []}
    name = ""
    for line in README:
        if line.startswith("## "):
            name = line[3:].strip()
            out[name] = []
        out[name].append(line)
    return out


def test_readme_is_short() -> None:
    assert len(README) <= 250, f"README.md has {len(README)} lines: move details to docs/"


def test_dates_only_in_the_results_section() -> None:
    sections = _sections()
    assert "Results" in sections and any(DATE.search(x) for x in sections["Results"])
    dated = {name: [x for x in lines if DATE.search(x)] for name, lines in sections.items()}
    outside = {name: lines for name, lines in dated.items() if lines and name != "Results"}
    assert not outside, f"dated lines outside ## Results (move to benchmarks/results/): {outside}"


def test_configuration_table_is_the_config_modules() -> None:
    from mla_backend import config

    assert config.markdown_table().strip() in "\n".join(README), (
        "README's configuration table differs from mla_backend.config.markdown_table(): "
        "paste the function's output into the README"
    )


def test_links_resolve() -> None:
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if not target.startswith("http"):
                assert (doc.parent / target).exists(), f"{doc.name}: {target}"
