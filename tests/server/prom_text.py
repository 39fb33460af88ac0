"""Reading a /metrics body with prometheus_client's own parser (the exposition format's reference reader)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, frozenset]  # (sample name, its labels as frozenset of (name, value))


def samples(text: str) -> dict[Key, float]:
    out: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text_or_samples, name: str, **labels: str) -> float:
    """The one sample called `name` whose labels include `labels` (0.0 when there is none yet)."""
    got = samples(text_or_samples) if isinstance(text_or_samples, str) else text_or_samples
    want = set(labels.items())
    hits = [v for (n, ls), v in got.items() if n == name and want <= ls]
    assert len(hits) <= 1, (name, labels, hits)
    return hits[0] if hits else 0.0


def sample_names(text: str) -> set[str]:
    """Every sample name in the body (`x_bucket`, `x_count`, `y_total`, ...)."""
    return {name for name, _ in samples(text)}


def bucket_bounds(text_or_samples, name: str, **labels: str) -> list[float]:
    """The `le` bounds of histogram `name` (without +Inf), ascending."""
    got = samples(text_or_samples) if isinstance(text_or_samples, str) else text_or_samples
    want = set(labels.items())
    les = {dict(ls)["le"] for (n, ls), _ in got.items() if n == f"{name}_bucket" and want <= ls}
    return sorted(float(le) for le in les if le != "+Inf")
