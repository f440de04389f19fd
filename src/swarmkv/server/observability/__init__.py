"""What a server shows about itself: Prometheus metrics, latency, cache breaks, the cache tree and page, request logs."""
