"""Quantized weights and graphs."""
