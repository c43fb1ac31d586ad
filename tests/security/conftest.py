import os
import sys

# tests_helpers_pt2 (a plain .pt2 for CLI tests) lives beside this file.
sys.path.insert(0, os.path.dirname(__file__))
