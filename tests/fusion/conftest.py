import os
import sys

# the shared, cached models of tests/adapters (adapter_fixtures)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "adapters"))
