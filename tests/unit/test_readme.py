"""The README's generated parts are current: the methods table comes from the registry."""

from __future__ import annotations

from pathlib import Path

from kvweave.report.methods_table import methods_markdown, readme_section, update_readme

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_methods_table_is_current():
    current = readme_section(README.read_text())
    assert current, "README.md lacks the <!-- methods:begin --> ... <!-- methods:end --> block"
    assert current == methods_markdown(), (
        "README.md's methods table is stale: run `.venv/bin/python -c \"from pathlib import Path; "
        "from kvweave.report.methods_table import update_readme; p = Path('README.md'); "
        'p.write_text(update_readme(p.read_text()))"`'
    )


def test_update_readme_replaces_only_the_block():
    text = "intro\n<!-- methods:begin -->\nold\n<!-- methods:end -->\nrest\n"
    updated = update_readme(text)
    assert updated.startswith("intro\n<!-- methods:begin -->\n| method |")
    assert updated.endswith("<!-- methods:end -->\nrest\n")
    assert readme_section(updated) == methods_markdown()


def test_every_public_name_resolves():
    import kvweave

    for name in kvweave.__all__:
        assert getattr(kvweave, name) is not None, name
