"""Scrapes of a /metrics endpoint for the metrics tests (docs/METRICS.md), parsed by
prometheus_client's own parser, so the exposition format is checked too."""

import urllib.request

from prometheus_client import parser


def parse(text):
    """{(name, labels as a sorted tuple): value} and {family name: type} of an exposition."""
    samples, types = {}, {}
    for family in parser.text_string_to_metric_families(text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples, types


def scrape_text(address):
    """The text http://address/metrics answers (asserting a 200)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


def scrape(address):
    """parse() of one scrape of http://address/metrics."""
    return parse(scrape_text(address))


def value(samples, name, **labels):
    """The value of one sample, failing with the samples of that name when it is missing."""
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} is not in the scrape: {sorted(k for k in samples if k[0].startswith(name))}"
    return samples[key]
