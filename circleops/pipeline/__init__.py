"""One conversion: its option checks (validate), the stages export -> fuse -> lower -> quantize ->
write -> verify over one Options (stages), and the public ``convert`` / ``save`` (convert)."""
