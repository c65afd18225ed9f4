"""docs/env_vars.md and docs/cli_flags.md are generated from the code (scripts/gen_docs_tables.py);
the committed files must equal a fresh generation, so a variable or flag added, removed or
reworded without regenerating fails here instead of leaving the docs wrong."""
from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO_ROOT, "scripts", "gen_docs_tables.py")


def _load_script() -> ModuleType:
    # scripts/ is no package: load the file itself, as `python3 scripts/...` would run it.
    spec = importlib.util.spec_from_file_location("gen_docs_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _load_script()


@pytest.mark.parametrize("rel", sorted(GEN.generated_files()))
def test_committed_table_matches_the_code(rel):
    expected = GEN.generated_files()[rel]
    path = os.path.join(REPO_ROOT, rel)
    assert os.path.exists(path), f"{rel} is missing: run `{GEN.REGENERATE}` and commit it"
    with open(path, encoding="utf-8") as f:
        committed = f.read()
    assert committed == expected, (
        f"{rel} is out of date with the code: run `{GEN.REGENERATE}` and commit the result")


def test_tables_cover_every_variable_and_flag():
    from sglang.srt.environ import list_env_fields

    env_md = GEN.env_vars_markdown()
    for field in list_env_fields():
        assert f"| `{field.name}` |" in env_md, field.name
    flags_md = GEN.cli_flags_markdown()
    parser = GEN._server_parser()
    server_flags = [a for a in parser._actions
                    if a.option_strings and a.dest not in ("help", "version")]
    assert server_flags
    for action in server_flags:
        assert f"`{action.option_strings[0]}`" in flags_md, action.option_strings
    for line in (env_md + flags_md).splitlines():
        if line.startswith("| "):  # a row that broke across lines would lose its cells
            assert line.endswith(" |"), line


def _load_graph_script() -> ModuleType:
    path = os.path.join(REPO_ROOT, "scripts", "gen_import_graph.py")
    spec = importlib.util.spec_from_file_location("gen_import_graph", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_architecture_import_graph_is_current():
    """docs/architecture.md's package import graph equals a fresh generation (rerun
    ``python3 scripts/gen_import_graph.py`` after changing what a package imports)."""
    graph = _load_graph_script()
    with open(graph.DOC) as f:
        doc = f.read()
    assert graph.render(doc) == doc


def test_lower_layers_import_nothing_from_rounds_or_managers():
    """The layering docs/architecture.md states: the model, its layers, the pools and the runner
    never import the round workers or the scheduler at import time; the rounds never import the
    scheduler."""
    edges = _load_graph_script().package_edges()
    lower = {"models", "layers", "mem_cache", "model_executor", "sampling", "configs",
             "model_loader", "distributed"}
    bad = sorted((a, b) for a, b in edges if a in lower and b in ("rounds", "managers"))
    assert not bad
    assert ("rounds", "managers") not in edges
