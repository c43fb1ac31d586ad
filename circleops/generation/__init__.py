"""Running a written set of graphs: the generator, sampling, chat."""
