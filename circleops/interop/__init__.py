"""Other toolchains' ops, registered through circleops' public op registry
(``circleops.register_op``): :mod:`circleops.interop.tico` for TICO's ``circle_custom::*``."""
