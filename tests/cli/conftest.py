import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "convert"))

from convert_fixtures import llama_config, llama_dir, llama_gguf, llama_model, llama_pt2  # noqa: E402,F401
