"""Builtin plugins, registered through the same entry-point group as third-party ones: the core assembly hooks,
the attention backends, one module per architecture family (architectures/) and per task (tasks/)."""
