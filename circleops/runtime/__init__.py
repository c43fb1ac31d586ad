"""Running a written file: ``onert.run``, ``litert.run``, ``reference.run``.

Each module exposes ``run(path, inputs: list[np.ndarray]) -> list[np.ndarray]``; they are
imported on use (``from circleops.runtime import litert``) so that no runtime loads unless needed.
"""
