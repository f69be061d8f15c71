"""The daemon's read path: a read submitted by an engine, checked, planned and handed to the data plane."""
