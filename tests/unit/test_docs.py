"""README.md and docs/ agree with the repository: links and anchors resolve, every `mimir` command
shown parses with the CLI's own parser, every config named exists and loads, every source path
named exists (tests/helpers/docs_check.py). The checker itself is tested on small made-up docs."""

from __future__ import annotations

import pytest
from docs_check import (
    REPO,
    check_commands,
    check_configs,
    check_links,
    check_paths,
    documents,
    parse,
    slug,
)


@pytest.fixture(scope="module")
def docs():
    return [parse(path) for path in documents()]


def test_the_checked_documents_are_the_readme_and_docs(docs):
    names = {doc.name for doc in docs}
    assert {"README.md", "docs/README.md", "docs/training.md", "docs/results.md"} <= names


def test_every_link_and_anchor_resolves(docs):
    assert check_links(docs) == []


def test_every_mimir_command_line_parses(docs):
    assert sum(len(doc.commands) for doc in docs) >= 30  # the checker finds the commands
    assert check_commands(docs) == []


def test_every_named_config_exists_and_loads(docs, monkeypatch):
    monkeypatch.chdir(REPO)  # a train config names its mixture relative to the repository root
    assert check_configs(docs) == []


def test_every_named_source_path_exists(docs):
    assert check_paths(docs) == []


# -- the checker, on made-up docs -------------------------------------------------------------------


def test_slugs_are_githubs():
    assert slug("`mimir serve`: the OpenAI-compatible API") == "mimir-serve-the-openai-compatible-api"
    assert slug("Mixtures (`configs/data/*.yaml`)") == "mixtures-configsdatayaml"
    assert slug("Tool-use traces (`mimir synth tools`, `tool_use/`)") == "tool-use-traces-mimir-synth-tools-tool_use"


def test_the_checker_finds_a_dead_link_a_wrong_flag_a_missing_config_and_a_missing_path(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## A section\n\n"
        "[ok](#a-section) [dead anchor](#nowhere) [dead file](missing.md) [web](https://example.org)\n"
        "Code spans are not links: `[x](nowhere.md)`; `mimir_megatron/cli.py` exists, `bench/no_such.py` does not.\n\n"
        "```bash\n"
        "mimir train --config configs/train/demo.yaml train.steps=3   # fine\n"
        "OMP_NUM_THREADS=2 .venv/bin/mimir serve --checkpoint runs/demo --no-such-flag\n"
        "mimir bench --shape huge\n"
        "mimir frobnicate\n"
        "mimir eval --suite configs/eval/demo.yaml \\\n"
        "    --checkpoint runs/demo --limit 3\n"
        "mimir data report --mixture configs/data/no_such_mixture.yaml\n"
        "```\n")
    doc = parse(page)
    links = check_links([doc])
    assert [p.split(": ", 1)[1] for p in links] == ["link #nowhere: no heading #nowhere in " + str(page),
                                                     "link missing.md: no such file"]
    commands = check_commands([doc])
    assert len(doc.commands) == 6  # the continued line is one command
    assert len(commands) == 3
    assert "unrecognized arguments: --no-such-flag" in commands[0]
    assert "invalid choice: 'huge'" in commands[1]
    assert "invalid choice: 'frobnicate'" in commands[2]
    configs = check_configs([doc])
    assert len(configs) == 1 and "configs/data/no_such_mixture.yaml: no such file" in configs[0]
    paths = check_paths([doc])
    assert len(paths) == 1 and "`bench/no_such.py`" in paths[0]


def test_a_config_that_does_not_load_is_reported(tmp_path):
    repo = tmp_path / "repo"
    (repo / "configs" / "model").mkdir(parents=True)
    (repo / "configs" / "model" / "broken.yaml").write_text("hidden_size: many\n")
    page = repo / "page.md"
    page.write_text("The model is `configs/model/broken.yaml`.\n")
    problems = check_configs([parse(page)], repo)
    assert len(problems) == 1 and "does not load" in problems[0] and "hidden_size" in problems[0]
