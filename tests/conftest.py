import os
import sys

# tests/families.py and tests/helpers are importable from every test module.
sys.path.insert(0, os.path.dirname(__file__))
