"""The metric names a PromQL expression (or a Grafana `label_values(...)` query) reads.

Strings, label matchers `{...}`, ranges `[...]` and the label lists of by/without/on/ignoring/group_*
are removed first; what is left that looks like a name and is not called like a function (`rate(`) nor a
keyword is a metric name. Grafana's variables are filled in before (`expand`).
"""

from __future__ import annotations

import re

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
             "unless", "inf", "nan"}  # fmt: skip
_NAME = re.compile(r"(?<![0-9.\w:])[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\s*\)\s*", expr, re.S)
    if m:
        expr = m.group(1)
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", " ", s)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for match in _NAME.finditer(s):
        word = match.group(0)
        if s[match.end() :].lstrip().startswith("(") or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def expand(expr: str, variables: dict[str, str]) -> str:
    """Grafana's `${name}` and `$name` filled in (longest names first, so $model_name before $model)."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    return expr


def dashboard_queries(dashboard: dict, prefix: str) -> list[str]:
    """Every PromQL query of a Grafana dashboard (panel targets and query variables), with the metric
    prefix variable set to `prefix`, the other variables to match-all and $__rate_interval to 1m."""
    variables = {"prefix": prefix, "model_name": ".*", "instance": ".*", "__rate_interval": "1m"}
    raw = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            raw.append(v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
    return [expand(q, variables) for q in raw]
