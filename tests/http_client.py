"""One HTTP client for the tests' plain requests to the local servers they start.

`httpx.get` builds a client, and with it an SSL context read from the CA bundle, at every call:
polled every 20 ms while a test waits for a worker to come back, that was a tenth of the suite's
CPU, taken from the clusters under test. One client, kept for the run, builds it once."""

from __future__ import annotations

import httpx2 as httpx

HTTP = httpx.Client()
