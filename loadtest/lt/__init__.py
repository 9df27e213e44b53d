"""The load tests' shared Python (standard library only; matplotlib is
imported by the plots' callers): what every scenario of loadtest/ needs and
none of them owns.

    lt.stats    nearest-rank percentiles, rounding
    lt.files    reading and writing the run folders: text, CSV, JSON, the
                checks of the outputs (PNGs, the `check` command's report)
    lt.procs    free loopback ports, child processes stopped by PID, logging
    lt.metrics  the gateway's /metrics (Prometheus text)
    lt.csvlog   a CSV written in batches (the Locust files' request logs)

The scenarios import it as a sibling package (`from lt import stats`):
Python puts a script's own folder, and Locust a locustfile's, first on
sys.path; loadtest/bench/common.py appends loadtest/ to it."""
