"""The user's pages follow the code: docs/configuration.md documents every flag `jaxllm serve` has (the
flags are generated from EngineArgs and ServerArgs, so a new field without a row fails here), and the
README stays a first page, not a measurement log."""

from __future__ import annotations

import re
from pathlib import Path

from jaxllm.server.args import make_arg_parser

ROOT = Path(__file__).resolve().parents[1]


def _documented_flags() -> set[str]:
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    return set(re.findall(r"`(--[a-z0-9-]+)", text))


def test_every_serve_flag_has_a_row_in_configuration_md():
    documented = _documented_flags()
    flags = set()
    for action in make_arg_parser()._actions:  # noqa: SLF001 (argparse keeps its actions here)
        flags.update(o for o in action.option_strings if o.startswith("--") and o != "--help")
    # A boolean flag's --no-X form is documented beside --X.
    missing = sorted(
        f for f in flags if f not in documented and f.replace("--no-", "--", 1) not in documented
    )
    assert not missing, f"flags without a row in docs/configuration.md: {missing}"


def test_documented_flags_exist():
    flags = set()
    for action in make_arg_parser()._actions:
        flags.update(action.option_strings)
    stale = sorted(f for f in _documented_flags() if f not in flags and not f.startswith("--no-"))
    # Flags of other commands the page may show as vLLM equivalents are written without a leading `--`
    # in a code span of their own; every `--flag` span must be one of ours.
    assert not stale, f"docs/configuration.md documents flags jaxllm serve does not have: {stale}"


def test_readme_is_a_first_page():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    dated = re.findall(r"20\d\d-\d\d-\d\d", text)
    assert not dated, f"README.md carries dated entries {dated[:3]}: they belong in docs/performance.md"


def _field_tables(route: str) -> dict[str, set[str]]:
    """The fields docs/openai_api.md lists for a route, per table: {"Served": {...}, "Refused": {...}}."""
    text = (ROOT / "docs" / "openai_api.md").read_text(encoding="utf-8")
    section = text.split(f"## POST {route}\n", 1)[1].split("\n## ", 1)[0]
    tables = {}
    for part in section.split("\n### ")[1:]:
        title, _, body = part.partition("\n")
        names = set()
        for line in body.splitlines():
            if line.startswith("| `"):
                names.update(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
        tables[title.strip()] = names
    return tables


def test_openai_api_md_lists_what_the_request_models_serve_and_refuse():
    from jaxllm.server.protocol import body_models

    for route in ("/v1/chat/completions", "/v1/completions"):
        model = body_models()[route]
        declared = {f.alias or name for name, f in model.model_fields.items()}
        tables = _field_tables(route)
        assert tables["Served"] == declared - set(model.no_effect), route
        assert tables["Accepted, no effect"] == set(model.no_effect), route
        assert tables["Refused"] == set(model.unserved), route
