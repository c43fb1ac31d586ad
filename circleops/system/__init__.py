"""The machine: circleops' cache directory and the memory it has."""
