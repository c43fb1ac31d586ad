"""The written output: its manifest, files split past a size limit, the conversion report."""
