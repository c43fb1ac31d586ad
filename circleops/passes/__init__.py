"""Graph passes on an ExportedProgram (fusion, folding, dtype policy), one module each."""

from circleops.adapters.dynamic_cache import register_when_imported

# an unpatched HF model exports with its DynamicCache output (pattern fusion's route)
register_when_imported()
