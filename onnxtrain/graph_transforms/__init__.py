"""ModelProto → ModelProto passes and the node-level pieces of the training step graph."""
