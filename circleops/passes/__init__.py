"""Graph passes on an ExportedProgram (fusion, folding, dtype policy), one module each."""
