import os
import sys

# tests/families.py and the shared test helpers are importable from every test module.
sys.path.insert(0, os.path.dirname(__file__))

# Under pytest-xdist every worker is its own process; with torch's default of one thread
# per core the workers oversubscribe the 2 cores and small ops crawl (measured: a tiny
# decode step 146 ms instead of 4 ms). One intra-op thread per worker.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)
