"""The daemon's the reads an engine submits: the record, its path, the data-plane thread, completions and the reads socket."""
