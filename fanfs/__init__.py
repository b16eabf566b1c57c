"""fanfs: a transient distributed file system for deep-learning training I/O."""
