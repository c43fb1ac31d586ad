"""Tools over written files and models: inspect, the fp16 numerics check, the quantization report."""
