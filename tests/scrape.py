"""Scraping a metrics endpoint over HTTP the way Prometheus does, for the tests."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """Every sample of ``url``'s ``/metrics``, by name and labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:  # noqa: S310
        text = answer.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: object) -> float | None:
    """The sample ``name`` with exactly ``labels`` (``None``: no such series)."""
    return samples.get((name, frozenset((k, str(v)) for k, v in labels.items())))


def probe(url: str, path: str) -> tuple[int, str]:
    """The status code and body of ``GET url+path`` (a 503 is an answer, not an error)."""
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=10) as answer:  # noqa: S310
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
