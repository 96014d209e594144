"""Getting tensors out of a running program: the recorder and its torch hooks."""
