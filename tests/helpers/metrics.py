"""The daemon's metrics page, read with prometheus_client's own parser."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """The labels and value of each sample named ``name`` on the page ``text`` (a
    counter's samples are named with ``_total``)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                yield sample.labels, float(sample.value)


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample named ``name`` with exactly ``labels`` (None: not shown)."""
    return next((value for found, value in samples(text, name) if found == labels), None)
