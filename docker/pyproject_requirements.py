"""`pyproject_requirements.py PYPROJECT EXTRAS`: prints the requirement lines of jaxllm's pyproject.toml,
its build requirements, its dependencies and those of the extras named in EXTRAS (comma-separated, may be
empty). The image installs these in a layer of their own, before the source comes in, so that editing
jaxllm's code rebuilds only the small layer that installs jaxllm itself (offline: its build requirements
are already there); the gigabytes of jax / CUDA wheels stay cached until pyproject.toml changes."""

import re
import sys
import tomllib

_SELF = re.compile(r"^jaxllm\[(?P<extras>[^\]]*)\]\s*$")  # an extra that names others: jaxllm[test,bench]


def requirements(pyproject: dict, extras: list[str]) -> list[str]:
    project = pyproject["project"]
    optional = project.get("optional-dependencies", {})
    lines = list(pyproject.get("build-system", {}).get("requires", [])) + list(project["dependencies"])
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        seen.add(extra)
        if extra not in optional:
            raise SystemExit(f"JAXLLM_EXTRAS: unknown extra {extra!r}; pyproject.toml has {sorted(optional)}")
        for req in optional[extra]:
            nested = _SELF.match(req)
            if nested:
                todo.extend(e.strip() for e in nested["extras"].split(",") if e.strip())
            else:
                lines.append(req)
    return lines


def main() -> None:
    path, extras = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
    with open(path, "rb") as f:
        pyproject = tomllib.load(f)
    print("\n".join(requirements(pyproject, [e.strip() for e in extras.split(",") if e.strip()])))


if __name__ == "__main__":
    main()
