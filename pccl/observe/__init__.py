"""What the master's status server and a peer's ``/metrics`` share: the bounded HTTP
server (:mod:`pccl.observe.server`, aiohttp: imported only by a process that serves)
and the scrape-time Prometheus collector (:mod:`pccl.observe.collector`). Neither
knows of peers or masters."""
