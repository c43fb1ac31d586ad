import os
import sys

# the shared, cached exports of tests/lowering (lowering_util)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "lowering"))
