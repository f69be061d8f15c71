"""The daemon's engine registrations: the registry, slots, the memory engines hand over, holds placed, and the read record with its completions."""
