"""The sets of graphs a model is written as: decoder LLMs, vision-language models, speech, task models."""
