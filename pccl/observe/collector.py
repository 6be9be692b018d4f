"""A Prometheus collector whose samples are computed at each scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import Metric


class ScrapeTimeCollector:
    """A Prometheus collector whose samples ``collect`` computes at each scrape (read
    from live state: never stale, nothing to keep up to date)."""

    def __init__(self, collect: Callable[[], Iterator[Metric]]) -> None:
        self.collect = collect

    def describe(self) -> list[Metric]:
        return []
