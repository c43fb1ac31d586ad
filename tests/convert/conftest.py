from convert_fixtures import llama_config, llama_dir, llama_gguf, llama_model, llama_pt2  # noqa: F401
