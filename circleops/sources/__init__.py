"""Where models come from (an HF directory, a GGUF file, the bundled SmolLM2, a .pt2, a config,
a hub id) and what a conversion will weigh, from their sizes alone."""
