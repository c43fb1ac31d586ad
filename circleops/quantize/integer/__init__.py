"""The PT2E integer path, in the order it runs: the quantizer (circleops.quantize.quantizer,
circleops.quantize.pt2e: annotate, calibrate, convert), Q/DQ folding before lowering
(:mod:`.qdq`), the lowering of its markers (:mod:`.markers`) and the integer pass that turns
the lowered float graph into an integer one (:mod:`.lower`, ``lower_quantized``).
The reference interpreter's integer kernels are circleops.runtime.kernels.quantized.
"""
