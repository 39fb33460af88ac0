"""vLLM's command-line conventions beyond argparse's: `--config FILE.yaml` and flag names written with
underscores.

    argv --normalize_flag_names--> "--max_model_len" is "--max-model-len"
         --expand_config_file--> [MODEL] <the file's flags> <the rest of argv>

The YAML file maps flag names without the leading dashes (with dashes or underscores) to values:

    model: Qwen/Qwen2.5-7B-Instruct
    port: 8001
    served-model-name: [qwen, default]
    enable-prefix-caching: false
    allowed-origins: ["https://example.com"]

true gives `--flag`, false `--no-flag`; a list gives the flag and its items (one JSON list for flags that
take JSON, such as --allowed-origins); a mapping gives one JSON object; null leaves the flag out. The
file's flags go before the command line's, so a flag given on the command line wins (argparse keeps the
last value), and a positional model wins over the file's `model`, as in vLLM.
"""

from __future__ import annotations

import argparse
import json
import re

from jaxllm.compat import argparse_option_actions

_FLAG_NAME = re.compile(r"^--[A-Za-z0-9][A-Za-z0-9_-]*")


def normalize_flag_names(argv: list[str]) -> list[str]:
    """`--a_b` and `--a_b=v` as `--a-b` and `--a-b=v`: vLLM accepts both spellings of every flag."""
    out = []
    for arg in argv:
        m = _FLAG_NAME.match(arg)
        out.append(m.group(0).replace("_", "-") + arg[m.end() :] if m else arg)
    return out


def expand_config_file(argv: list[str], parser: argparse.ArgumentParser, positional_model: bool) -> list[str]:
    """`argv` with `--config FILE` replaced by the file's flags, placed so that the command line wins.
    Exits through `parser.error` naming the file for an unreadable file or an unknown key."""
    found = [i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")]
    if not found:
        return argv
    if len(found) > 1:
        parser.error("--config: given more than once")
    i = found[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv):
            parser.error("argument --config: expected a YAML file")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
    else:
        path, rest = argv[i].removeprefix("--config="), argv[:i] + argv[i + 1 :]
    has_positional = positional_model and bool(rest) and not rest[0].startswith("-")
    flags = config_file_flags(path, parser, drop_model=has_positional)
    head = rest[:1] if has_positional else []
    return head + flags + rest[len(head) :]


def config_file_flags(path: str, parser: argparse.ArgumentParser, drop_model: bool = False) -> list[str]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f)
    except OSError as e:
        parser.error(f"--config {path}: cannot read it ({e.strerror or e})")
    except yaml.YAMLError as e:
        parser.error(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})")
    if values is None:
        return []
    if not isinstance(values, dict):
        parser.error(
            f"--config {path}: must be a mapping of flag names to values, got {type(values).__name__}"
        )
    actions = argparse_option_actions(parser)
    flags: list[str] = []
    for key, value in values.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if flag == "--config":
            parser.error(f"--config {path}: a config file cannot name another (key {key!r})")
        if flag not in actions:
            parser.error(f"--config {path}: unknown key {key!r} (jaxllm has no flag {flag})")
        if value is None or (drop_model and flag == "--model"):
            continue
        action = actions[flag]
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif (no_flag := "--no-" + flag[2:]) in actions:
                flags.append(no_flag)
            else:
                parser.error(f"--config {path}: {key!r} cannot be false (the flag {flag} takes a value)")
        elif isinstance(value, list) and action.nargs == "+":
            flags += [flag, *(str(v) for v in value)]
        elif isinstance(value, list | dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags
