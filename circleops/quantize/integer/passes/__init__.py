"""The integer passes, one per module, each turning a lowered PT2E graph one step closer to
an integer graph (circleops.quantize.integer.lower.integerize runs them in order). Each
module's docstring shows the graph BEFORE and AFTER its pass."""
