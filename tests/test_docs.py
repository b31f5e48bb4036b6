"""The documentation site builds as `make docs` builds it (Sphinx, warnings as errors), its reference
pages hold what the code defines, a broken link between pages fails the build, and README stays a
short entry point whose links lead to files that exist."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def build(source: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "html", str(source), str(out)],
        capture_output=True, text=True, timeout=600,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The docs built as `make docs` builds them, from a copy (the build rewrites the generated
    reference pages in its source; the checkout's must stay as committed for the test below)."""
    tmp = tmp_path_factory.mktemp("docs")
    shutil.copytree(REPO / "docs", tmp / "docs", ignore=shutil.ignore_patterns("_build"))
    for outside in ("deploy", "examples"):  # a page includes deploy/README.md; guides link example files
        (tmp / outside).symlink_to(REPO / outside)
    done = build(tmp / "docs", tmp / "html")
    assert done.returncode == 0, done.stderr[-4000:]
    yield tmp / "html"
    shutil.rmtree(tmp, ignore_errors=True)


def text(page: Path) -> str:
    """A built page's text: tags dropped, entities and the typographic quotes Sphinx puts in undone."""
    plain = html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))
    return plain.translate(str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2013": "--", "\u2014": "---"}))


def test_the_reference_pages_hold_every_config_field_cli_command_and_metric(site):
    from controller.cli import build_parser
    from controller.config import RunConfig, TrainConfig
    from controller.prometheus import CATALOG

    config = text(site / "reference" / "config.html")
    for name, field in TrainConfig.model_fields.items():
        assert name in config and " ".join(field.description.split())[:40] in " ".join(config.split()), name
    for section in RunConfig.model_fields:
        assert f"{section}" in config
    for variant in ("rollout.reward (type: python)", "learner.objective (type: drpo)", "task (type: dataset)"):
        assert variant in config
    from controller.config import PRESET_DIFFERENCES

    for field, why in PRESET_DIFFERENCES.items():  # the preset's differences from the code defaults, each with its reason
        assert field in config and " ".join(why.split())[:40] in " ".join(config.split()), field
    cli = text(site / "reference" / "cli.html")
    for command in ("drpo train", "drpo export", "drpo eval", "drpo report", "--resume", "--overwrite"):
        assert command in cli
    assert len([a for a in build_parser()._actions if a.option_strings]) >= 1
    metrics = text(site / "reference" / "metrics.html")
    assert all(name in metrics for name in CATALOG)
    api = text(site / "reference" / "objectives-api.html")
    assert "token_loss" in api and "register_objective" in api


def test_the_committed_reference_pages_are_what_the_code_generates():
    """They are committed so they read on a repository browser too; a field, option or metric
    changed without `make docs` fails here."""
    sys.path.insert(0, str(REPO / "docs" / "_ext"))
    import drpo_reference

    stale = [name for name, page in drpo_reference.PAGES.items() if (REPO / "docs" / "reference" / name).read_text() != page()]
    assert not stale, f"docs/reference/{', '.join(stale)} differ from what the code generates: run `make docs` and commit them"


def test_every_page_is_in_the_navigation_and_the_home_page_links_them(site):
    pages = {p.relative_to(REPO / "docs").with_suffix("").as_posix() for p in (REPO / "docs").rglob("*.md") if "_build" not in p.parts}
    built = {p.relative_to(site).with_suffix("").as_posix() for p in site.rglob("*.html") if not p.name.startswith(("genindex", "search", "py-modindex"))}
    assert pages <= built
    assert "Troubleshooting" in text(site / "index.html")


def test_a_broken_link_or_heading_anchor_fails_the_build(tmp_path):
    shutil.copytree(REPO / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("_build", "results"))
    (tmp_path / "deploy").symlink_to(REPO / "deploy")  # a page includes deploy/README.md
    (tmp_path / "docs" / "results.md").write_text("# Results\n")
    broken = tmp_path / "docs" / "concepts.md"
    broken.write_text(broken.read_text() + "\nSee [a page](no-such-page.md) and [a heading](getting-started.md#no-such-heading).\n")
    done = build(tmp_path / "docs", tmp_path / "html")
    assert done.returncode != 0 and "no-such-page.md" in done.stderr and "no-such-heading" in done.stderr, done.stderr[-2000:]


def test_readme_is_short_and_its_links_lead_to_files_that_exist():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert local and all((REPO / link).exists() for link in local), [link for link in local if not (REPO / link).exists()]
    for required in ("LICENSE", "CHANGELOG.md", "CONTRIBUTING.md"):
        assert (REPO / required).is_file() and required in readme
